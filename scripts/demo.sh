#!/usr/bin/env bash
# Train a small network on scikit-learn's digits on 2 ranks (horovodrun, Gloo, localhost),
# first uncompressed and then with the given scheme, printing progress, test accuracy and
# the bytes each rank's gradients took per step. Installs everything first if needed.
#   scripts/demo.sh [SCHEME] [extra options of examples/digits.py]
#   scripts/demo.sh qsgd:bits=4 --epochs 10
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/install.sh >/dev/null
# shellcheck disable=SC1091
source .venv/bin/activate
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" TF_CPP_MIN_LOG_LEVEL=3
SCHEME="${1:-onebit}"
shift || true
exec horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py --scheme "$SCHEME" --compare "$@"
