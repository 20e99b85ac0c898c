#!/usr/bin/env bash
# Run the whole test suite: lint, unit tests and the multi-process tests on 2 ranks under
# horovodrun (Gloo) and mpirun (MPI). Installs everything first if needed (idempotent).
# Extra arguments go to pytest, e.g. scripts/test.sh -k wire
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/install.sh
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL=3
echo "[test] ruff"
ruff check .
echo "[test] pytest"
# Not -q: the header names the CPU and the ATen kernels the run used.
python -m pytest -p no:cacheprovider "$@"
