#!/usr/bin/env bash
# Download the wheels that scripts/gpu_check.sh installs on a CUDA machine which reaches no
# package index, into .gpu-wheels/ (ignored by git: carry it with the working tree).
#
# The machine (Python 3.12) already has torch, triton, numpy, pytest, pytest-timeout, grpcio,
# protobuf, prometheus-client, psutil and mpi4py. What it may lack is a setuptools new
# enough for this project's pyproject.toml (77 or later: the license is an SPDX string),
# which `pip install --no-build-isolation -e .` builds with. Only pure-Python wheels for
# Python 3.12 are fetched, without their dependencies; arguments name more, e.g.
#   scripts/gpu_wheels.sh grpcio-health-checking==1.85.1
# Environment: PYTHON (the interpreter whose pip downloads, default python3),
# GPU_WHEELS_DIR (default .gpu-wheels in the repository root).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS_DIR:-$ROOT/.gpu-wheels}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "setuptools==84.2.1" "$@"
for wheel in "$DEST"/*.whl; do
    case "$(basename "$wheel")" in
        *-py3-none-any.whl|*-py2.py3-none-any.whl) ;;
        *) echo "gpu_wheels: $(basename "$wheel") is not pure Python; it may not install" \
                "on the CUDA machine" >&2 ;;
    esac
done
echo "gpu_wheels: $(find "$DEST" -name '*.whl' | wc -l) wheel(s) in $DEST" \
     "($(du -sh "$DEST" | cut -f1)); carry it: run(carry=[\".gpu-wheels\"])"
