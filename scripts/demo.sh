#!/usr/bin/env bash
# Train a small network on scikit-learn's digits on 2 workers plus a parameter server, all
# on localhost: first uncompressed, then with the given scheme, printing progress, test
# accuracy and the bytes each worker's gradients took per step. Installs everything first
# if needed.
#   scripts/demo.sh [SCHEME] [extra options of examples/digits.py]
#   scripts/demo.sh                              # top-k 1%, pairs summed by the server
#   scripts/demo.sh dgc:ratio=0.001,momentum=0.5,warmup_steps=100
#   scripts/demo.sh qsgd:bits=4 --epochs 10      # dense schemes use Horovod's collectives
#   PS_TRANSPORT=mpi scripts/demo.sh             # one MPMD mpirun: 2 workers + 1 server rank
# With PS_TRANSPORT=grpc (the default) the server is its own process (python -m ps_server)
# and the workers run under horovodrun with Gloo; server options come from HVD_PS_*
# variables (HVD_PS_CHECKPOINT_DIR=ckpt scripts/demo.sh keeps checkpoints), and its CPU
# time is printed at the end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/install.sh >/dev/null
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL=3
SCHEME="${1:-topk:ratio=0.01}"
shift || true
WORKERS=2

case "${PS_TRANSPORT:-grpc}" in
mpi)
    # OpenMPI's ring all-reduce (coll_tuned options): on throttled links it reached 80% of
    # the ideal bandwidth where the default algorithm choice reached half.
    exec mpirun --allow-run-as-root --oversubscribe --bind-to none \
        --mca btl self,tcp --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo \
        --mca coll_tuned_use_dynamic_rules 1 --mca coll_tuned_allreduce_algorithm 4 \
        -x OMP_NUM_THREADS -x TF_CPP_MIN_LOG_LEVEL -x PATH \
        -np "$WORKERS" python examples/digits.py --scheme "$SCHEME" --compare --ps mpi "$@" \
        : -np 1 python -m ps_server --transport mpi --workers "$WORKERS"
    ;;
grpc)
    LOG="$(mktemp -t hvdc-ps-server.XXXXXX.log)"
    python -m ps_server --workers "$WORKERS" --bind 127.0.0.1:0 --deadline 120 >"$LOG" 2>&1 &
    SERVER=$!
    trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
    ADDRESS=""
    for _ in $(seq 100); do
        ADDRESS="$(sed -n 's/.*serving shard 0\/1 on \([^ ]*\) .*/\1/p' "$LOG")"
        [ -n "$ADDRESS" ] && break
        kill -0 "$SERVER" 2>/dev/null || { cat "$LOG"; exit 1; }
        sleep 0.2
    done
    [ -n "$ADDRESS" ] || { echo "parameter server did not start:"; cat "$LOG"; exit 1; }
    echo "parameter server: pid $SERVER at grpc://$ADDRESS (log: $LOG)"
    horovodrun -np "$WORKERS" -H "localhost:$WORKERS" --gloo \
        python examples/digits.py --scheme "$SCHEME" --compare --ps "grpc://$ADDRESS" "$@"
    # utime + stime of the server process, in clock ticks (fields 14 and 15).
    CPU="$(awk -v hz="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / hz}' \
        "/proc/$SERVER/stat" 2>/dev/null || echo "?")"
    kill "$SERVER"
    wait "$SERVER" || true
    echo "parameter server: $(tail -n 1 "$LOG")"
    echo "parameter server CPU: $CPU s"
    ;;
*)
    echo "PS_TRANSPORT must be grpc or mpi, got ${PS_TRANSPORT}" >&2
    exit 2
    ;;
esac
