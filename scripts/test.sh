#!/usr/bin/env bash
# Run the tests. Installs everything first if needed (scripts/install.sh is idempotent).
#
#   scripts/test.sh          the fast tier (at most 5 minutes on a 2-core machine): ruff, the
#                            in-process tests and one smoke launch per launcher and transport
#                            (horovodrun/Gloo, mpirun/MPI, the server over gRPC and over MPI)
#   scripts/test.sh --full   everything (what .ci/run calls): ruff and the whole suite, with
#                            the 20 slowest tests and every skip with its reason at the end
#
# Extra arguments go to pytest, e.g. scripts/test.sh -k wire, scripts/test.sh --full -x.
# The markers that select the tiers are in setup.cfg; tests/conftest.py fails a test that
# starts processes or runs TensorFlow without the marker that says so.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
FAST="(not multiprocess and not tensorflow) or smoke"
tier=fast
if [[ "${1:-}" == "--full" ]]; then
    tier=full
    shift
fi
bash scripts/install.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL=3
echo "[test] ruff"
ruff check .
# Not -q: the header names the CPU and the ATen kernels the run used.
if [[ "$tier" == full ]]; then
    echo "[test] pytest: the full tier"
    python -m pytest -p no:cacheprovider --durations=20 -rs "$@"
else
    echo "[test] pytest: the fast tier (-m '$FAST'); scripts/test.sh --full runs everything"
    python -m pytest -p no:cacheprovider -m "$FAST" -rs "$@"
fi
