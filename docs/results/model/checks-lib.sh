# Sourced by the checks.sh of the pages under docs/results/model/: `check` runs one
# `bench model --check` and writes NAME.json and NAME.md into $here (the page), printing
# the summary line. Run from the repository root.
check() {  # NAME RUN FIT PROFILES OVERHEAD [more options]
    local name=$1 run=$2 fit=$3 profiles=$4 overhead=$5
    shift 5
    python -m hvd_compress.bench model --check "$run" ${fit:+--fitted "$fit"} \
        --profiles "$profiles" --overhead "$overhead" \
        --json "$here/$name.json" --markdown "$here/$name.md" "$@" > /dev/null
    tail -1 "$here/$name.md" | sed "s/^/$name: /"
}
