#!/usr/bin/env bash
# The GPU check, for a bare CUDA machine without Horovod and without network (Python 3.12,
# torch with CUDA, Triton, nvcc and a C++ compiler), within 9 minutes. Usage:
#   scripts/gpu_check.sh OUTDIR
# Steps (each one's output in OUTDIR/run.log, its exit status and seconds in the summary):
#  1. wheels   install the wheels carried in .gpu-wheels/ (scripts/gpu_wheels.sh: setuptools
#              new enough for pyproject.toml) into a scratch folder put on PYTHONPATH;
#  2. install  pip install --no-index --no-build-isolation --no-deps -e . (compiles the native
#              CPU kernels, -march=native, where a C++ compiler is); should pip fail, the tree
#              goes on PYTHONPATH and `python -m hvd_compress.native build` compiles them;
#  3. pytest   the tests marked gpu, in every tests/test_*.py that uses the marker
#              (OUTDIR/pytest.xml): tests/test_triton_kernels.py runs the compiled Triton
#              kernels on CUDA against the CPU codecs, bit for bit;
#  4. kernels  every codec's encode+decode on 1 M, 16 M and 64 M float32 elements against a
#              device-to-device copy, CUDA events, median of 5 after 3 warm-ups, and the
#              Triton table: each Triton kernel against the torch ops of the same operation
#              (top-k 0.1% against torch.topk, with recall; GRACE where it imports)
#              (python -m hvd_compress.bench kernels --device cuda: OUTDIR/kernels.json and
#              kernels.md); fails if anything imported horovod, or (on CUDA) if the Triton
#              table is missing or ran the torch fallback;
#  5. summary  OUTDIR/summary.json and summary.md: the machine (Triton's version too), each
#              step, the test counts and the kernels tables.
# Environment: PYTHON (default python3); GPU_CHECK_ALLOW_CPU=1 runs the same steps on the CPU
# where CUDA is not available (smaller sizes; the gpu tests then skip, saying why), to check
# this script; GPU_CHECK_SIZES and GPU_CHECK_REPEAT override the benchmark's sizes and
# repeats; GPU_CHECK_BUDGET the seconds for all steps (default 530).
# Exit status: 0 every step passed (and on CUDA some gpu tests ran), 1 a step failed (the
# summary names it), 2 no CUDA here (and GPU_CHECK_ALLOW_CPU unset), 64 no OUTDIR given.
# On the device machine: scripts/gpu_wheels.sh here first, then run it with
# carry=[".gpu-wheels"] and OUTDIR=$OUT (it writes 6 files: run.log, pytest.xml,
# kernels.json, kernels.md, summary.json, summary.md).
set -uo pipefail
if [[ $# -ne 1 ]]; then
    echo "usage: scripts/gpu_check.sh OUTDIR" >&2
    exit 64
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1" && OUTDIR="$(cd "$1" && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python3}"
LOG="$OUTDIR/run.log"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
STEPS="$WORK/steps.tsv"
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET:-530}))
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
: >"$LOG"
: >"$STEPS"

# step NAME LIMIT COMMAND...: run with at most LIMIT seconds (less if the budget is nearly
# spent), output appended to run.log; records and returns its exit status (124: timed out).
step() {
    local name=$1 limit=$2 started=$SECONDS rc
    shift 2
    local left=$((DEADLINE - SECONDS))
    ((left < limit)) && limit=$left
    if ((limit < 5)); then
        echo "[gpu_check] $name: skipped, the time budget is spent" | tee -a "$LOG"
        printf '%s\t%s\t%s\n' "$name" "skipped" 0 >>"$STEPS"
        return 124
    fi
    echo "[gpu_check] $name (at most ${limit}s): $*" | tee -a "$LOG"
    timeout --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - started))" >>"$STEPS"
    echo "[gpu_check] $name: exit $rc after $((SECONDS - started)) s" | tee -a "$LOG"
    return "$rc"
}

if [[ "$("$PYTHON" -c 'import torch; print(int(torch.cuda.is_available()))' 2>>"$LOG")" == 1 ]]
then
    DEVICE=cuda
    BENCH=(--device cuda --sizes "${GPU_CHECK_SIZES:-1M,16M,64M}" --repeat "${GPU_CHECK_REPEAT:-5}")
elif [[ "${GPU_CHECK_ALLOW_CPU:-0}" == 1 ]]; then
    DEVICE=cpu
    echo "[gpu_check] no CUDA here: GPU_CHECK_ALLOW_CPU=1, running the steps on the CPU" \
        | tee -a "$LOG"
    BENCH=(--device cpu --sizes "${GPU_CHECK_SIZES:-1M}" --repeat "${GPU_CHECK_REPEAT:-3}"
           --no-tf --selection-sizes 64K)
else
    echo "gpu_check: torch.cuda.is_available() is False for $PYTHON (see $LOG); set" \
         "GPU_CHECK_ALLOW_CPU=1 to run the steps on the CPU" >&2
    exit 2
fi

if compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    step wheels 90 "$PYTHON" -m pip install --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$WORK/site" .gpu-wheels/*.whl
    export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "[gpu_check] no wheels in .gpu-wheels/ (scripts/gpu_wheels.sh): the environment's" \
         "own setuptools builds" | tee -a "$LOG"
fi

if ! step install 180 "$PYTHON" -m pip install --no-index --no-build-isolation --no-deps -e .
then
    echo "[gpu_check] pip could not install the tree: using it from PYTHONPATH" | tee -a "$LOG"
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    step native-build 120 "$PYTHON" -m hvd_compress.native build
fi

mapfile -t GPU_TESTS < <(grep -lE 'mark\.gpu\b' tests/test_*.py)
step pytest 300 "$PYTHON" -m pytest -m gpu -rs -p no:cacheprovider \
    --junitxml "$OUTDIR/pytest.xml" "${GPU_TESTS[@]}"

# The benchmark's own main, then a check that nothing it ran imported horovod and (on
# CUDA) that the Triton table ran the Triton kernels.
step kernels 200 "$PYTHON" -c '
import json, sys
from hvd_compress.bench.cli import main
status = main(sys.argv[1:])
if "horovod" in sys.modules:
    print("gpu_check: the kernels benchmark imported horovod", file=sys.stderr)
    status = status or 1
if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cuda":
    rows = json.loads(open(sys.argv[sys.argv.index("--json") + 1]).read())
    routes = {r["route"] for r in rows if r["benchmark"] == "triton"}
    if routes != {"triton"}:
        ran = ", ".join(sorted(routes)) or "no rows"
        print(f"gpu_check: the Triton table ran {ran}, not the Triton kernels alone",
              file=sys.stderr)
        status = status or 1
sys.exit(status)
' kernels "${BENCH[@]}" --json "$OUTDIR/kernels.json" --markdown "$OUTDIR/kernels.md"

"$PYTHON" - "$OUTDIR" "$STEPS" "$DEVICE" <<'EOF' 2>>"$LOG"
"""Write summary.json and summary.md from the steps, the JUnit XML and the kernels rows."""
import importlib.util
import json
import platform
import shutil
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

out, steps_file, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]


def first_line(*argv: str) -> str:
    """The first line a command prints, or why there is none."""
    if shutil.which(argv[0]) is None:
        return f"{argv[0]}: not found"
    done = subprocess.run(argv, capture_output=True, text=True)
    lines = (done.stdout or done.stderr).strip().splitlines()
    return lines[0] if lines else f"exit {done.returncode}"


machine = {"device": device, "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
           "nvidia_smi": first_line("nvidia-smi", "-L"), "cxx": first_line("g++", "--version")}
try:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from hvd_compress.native import cpu, loader
        lib = loader.library()
    path = Path(lib._name) if lib is not None else None
    record = cpu.read_record(path) if path is not None else None
    machine["native"] = {"library": str(path) if path else None,
                         "features": record["features"] if record else None,
                         "warnings": [str(w.message) for w in caught]}
    machine["cpu"] = cpu.cpu_info().model
except Exception as err:  # the summary is written whatever failed
    machine["native"] = {"error": repr(err)}
machine["horovod_installed"] = importlib.util.find_spec("horovod") is not None
try:
    import triton
    machine["triton"] = triton.__version__
except Exception as err:  # the summary is written whatever failed
    machine["triton"] = f"not importable: {err!r}"

steps = [dict(zip(("step", "exit", "seconds"), line.split("\t")))
         for line in steps_file.read_text().splitlines()]
tests = None
if (out / "pytest.xml").exists():
    suite = ET.parse(out / "pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    reasons = sorted({s.get("message", "") for s in suite.iter("skipped")})
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    tests = {**counts, "skip_reasons": reasons, "failed": failed}
rows = json.loads((out / "kernels.json").read_text()) if (out / "kernels.json").exists() else []
# On CUDA the gpu tests must have run, not only been skipped.
ok = all(s["exit"] == "0" for s in steps) and tests is not None and not tests["failed"] \
    and (device == "cpu" or tests["passed"] > 0)
summary = {"ok": ok, "machine": machine, "steps": steps, "tests": tests, "kernels": rows}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

md = [f"# GPU check: {'passed' if ok else 'FAILED'} ({device})", ""]
md += [f"- {key}: {value}" for key, value in machine.items() if key != "native"]
native = machine.get("native", {})
md += [f"- native kernels: {native.get('library') or native.get('error') or 'unavailable'}"
       + "".join(f"; warning: {w}" for w in native.get("warnings", []))]
md += ["", "| step | exit | seconds |", "| --- | --- | --- |"]
md += [f"| {s['step']} | {s['exit']} | {s['seconds']} |" for s in steps]
if tests is not None:
    md += ["", f"Tests marked gpu: {tests['passed']} passed, {tests['failures']} failed, "
           f"{tests['errors']} errors, {tests['skipped']} skipped"
           + "".join(f"; skipped because: {r}" for r in tests["skip_reasons"])]
    md += [f"- failed: {name}" for name in tests["failed"]]
if (out / "kernels.md").exists():
    md += ["", (out / "kernels.md").read_text()]
(out / "summary.md").write_text("\n".join(md).rstrip("\n") + "\n")
print("\n".join(md))
sys.exit(0 if ok else 1)
EOF
status=$?
echo "[gpu_check] wrote $(ls "$OUTDIR" | tr '\n' ' ')in $OUTDIR after $SECONDS s"
exit "$status"
