#!/usr/bin/env bash
# Build the Docker images with podman and smoke-test them through buildah.
#   scripts/images.sh [server] [cpu] [gpu] [--no-test] [--no-build]    (default: server)
#     server  docker/Dockerfile.server -> hvd-compress/server:VERSION, then serves a round
#             from the host to a server inside it, checks its health, stops it by SIGTERM
#     cpu     docker/Dockerfile.cpu -> hvd-compress/cpu:VERSION (workers), with the
#             Horovod wheel built by scripts/install.sh as a build input, then runs
#             `horovodrun --check-build` and a 2-rank digits run with top-k inside it
#             against a server running inside the server image. CPU torch and TensorFlow
#             wheels found in $HVD_IMAGES_WHEEL_DIRS (default: /opt/wheels and
#             $HVD_COMPRESS_CACHE/wheels) are build inputs too; others come from PyPI
#     gpu     docker/Dockerfile.gpu -> hvd-compress/gpu:VERSION (workers on NVIDIA GPUs: torch's
#             CUDA build, CUDA and NCCL from NVIDIA's pip wheels, Horovod compiled with NCCL
#             in the image; no CUDA base image or GPU needed to build), then checks that
#             `horovodrun --check-build` lists NCCL, horovod.torch.nccl_built(), the
#             installed distributions (torch a CUDA build, NCCL, no TensorFlow), and runs
#             the same 2-rank digits run as for cpu, on the CPU, inside it. Layer-cached:
#             with scripts/install.sh unchanged, a rebuild reinstalls only hvd-compress
# The base image is $BASE if set, else debian:bookworm-slim from a registry, else (no
# registry reachable, or HVD_IMAGES_LOCAL_BASE=1) a Debian bookworm root made locally with
# mmdebstrap and imported as localhost/debian:bookworm-local (cached in
# $HVD_COMPRESS_CACHE/images). A CA bundle ($HVD_IMAGES_CA_BUNDLE, default the system's)
# is passed to the builds as the secret `ca_bundle`, for networks that inspect TLS.
# Containers are run with `buildah run --isolation chroot` (works without cgroups or
# user namespaces); `scripts/install.sh --with-podman` installs podman, buildah, mmdebstrap.
set -euo pipefail
shopt -s inherit_errexit
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
CACHE="${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd-compress}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
CA="${HVD_IMAGES_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
TEST=1 BUILD=1 TARGETS=()
for arg in "$@"; do
  case "$arg" in
    server|cpu|gpu) TARGETS+=("$arg") ;;
    --no-test) TEST=0 ;;
    --no-build) BUILD=0 ;;  # smoke-test the images already built
    *) echo "images.sh: unknown argument $arg (server, cpu, gpu, --no-test, --no-build)" >&2
       exit 2 ;;
  esac
done
((${#TARGETS[@]})) || TARGETS=(server)
log() { printf '[images] %s\n' "$*"; }
for tool in podman buildah; do
  command -v "$tool" >/dev/null ||
    { echo "images.sh: $tool not found; run scripts/install.sh --with-podman" >&2; exit 1; }
done

base_image() {  # print the base image to build on, making it locally if need be
  if [ -n "${BASE:-}" ]; then echo "$BASE"; return; fi
  if [ "${HVD_IMAGES_LOCAL_BASE:-0}" != 1 ] &&
     timeout 60 podman pull -q docker.io/library/debian:bookworm-slim >/dev/null 2>&1; then
    echo docker.io/library/debian:bookworm-slim; return
  fi
  local image=localhost/debian:bookworm-local tar="$CACHE/images/debian-bookworm-local.tar"
  if ! podman image exists "$image"; then
    if [ ! -s "$tar" ]; then
      log "no registry: making the Debian bookworm base with mmdebstrap ($tar)" >&2
      mkdir -p "$(dirname "$tar")"
      # Like debian:bookworm-slim: no documentation, manuals or package lists.
      mmdebstrap --variant=minbase --quiet \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
        bookworm "${tar%.tar}.partial.tar" http://deb.debian.org/debian >&2
      mv "${tar%.tar}.partial.tar" "$tar"
    fi
    podman import -q "$tar" "$image" >/dev/null
  fi
  echo "$image"
}

build() {  # build NAME DOCKERFILE [podman build options...]
  local name="$1" file="$2"; shift 2
  ((BUILD)) || return 0
  local secret=()
  [ -s "$CA" ] && secret=(--secret "id=ca_bundle,src=$CA")
  log "building hvd-compress/$name:$VERSION from $file on $BASE_IMAGE"
  local start=$SECONDS
  local out; out="$(mktemp -t "hvdc-image-$name.XXXXXX.log")"
  if ! podman build --format docker --isolation chroot "${secret[@]}" \
    --build-arg "BASE=$BASE_IMAGE" -f "$file" -t "localhost/hvd-compress/$name:$VERSION" \
    "$@" . >"$out" 2>&1; then
    tail -n 60 "$out" >&2; echo "images.sh: building $name failed (the whole log: $out)" >&2
    exit 1
  fi
  rm -f "$out"
  log "built hvd-compress/$name:$VERSION in $((SECONDS - start)) s, $(podman image inspect \
    --format '{{.Size}}' "localhost/hvd-compress/$name:$VERSION" | numfmt --to=si)B"
}

CONTAINERS=() PIDS=()
cleanup() {
  local pid c
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for c in "${CONTAINERS[@]}"; do buildah rm "$c" >/dev/null 2>&1 || true; done
}
trap cleanup EXIT

start_server() {  # start_server PORT WORKERS: a server inside the server image, on loopback
  local port="$1" workers="$2" c
  c="$(buildah from -q "localhost/hvd-compress/server:$VERSION")"
  CONTAINERS+=("$c")
  SERVER_LOG="$(mktemp -t hvdc-image-server.XXXXXX.log)"
  buildah run --isolation chroot --env HVD_PS_WORKERS="$workers" \
    --env HVD_PS_BIND="127.0.0.1:$port" --env HVD_PS_METRICS_PORT=0 \
    --env HVD_PS_CHECKPOINT_DIR=/var/lib/hvd-ps/checkpoints "$c" -- hvd-ps-server \
    >"$SERVER_LOG" 2>&1 &
  PIDS+=($!)
  SERVER_RUNNER=$! SERVER_CONTAINER="$c"
  for _ in $(seq 150); do
    grep -q "serving shard" "$SERVER_LOG" && return 0
    kill -0 "$SERVER_RUNNER" 2>/dev/null || break
    sleep 0.2
  done
  cat "$SERVER_LOG" >&2; echo "images.sh: the server in the image did not start" >&2; exit 1
}

innermost() {  # innermost PID: the deepest descendant of PID (buildah run -> runtime -> exec)
  local pid="$1" child
  while child="$(pgrep -P "$pid" | head -n1)" && [ -n "$child" ]; do pid="$child"; done
  echo "$pid"
}

stop_server() {  # SIGTERM to the server process inside; it must exit 0 after a checkpoint
  kill -TERM "$(innermost "$SERVER_RUNNER")"
  if wait "$SERVER_RUNNER"; then
    log "server stopped by SIGTERM: exit 0, $(tail -n 1 "$SERVER_LOG" | sed 's/.*INFO //')"
  else
    cat "$SERVER_LOG" >&2; echo "images.sh: the server did not exit 0 on SIGTERM" >&2; exit 1
  fi
  buildah run --isolation chroot "$SERVER_CONTAINER" -- \
    ls /var/lib/hvd-ps/checkpoints/shard-0-of-1.npz >/dev/null
}

free_port() { "${PY:-python3}" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

test_server() {
  local port; port="$(free_port)"
  start_server "$port" 2
  buildah run --isolation chroot "$SERVER_CONTAINER" -- python3 -m ps_server.healthcheck \
    "127.0.0.1:$port"
  log "health check in the image: SERVING"
  log "round from the host: $(PYTHONPATH="$ROOT" "$PY" tests/frameworks_blocked.py \
    tests.torch_free_client "127.0.0.1:$port" 2)"
  buildah run --isolation chroot "$SERVER_CONTAINER" -- python3 -c \
    'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ("torch", "tensorflow", "horovod")))'
  log "no torch, TensorFlow or Horovod in the server image"
  stop_server
}

stage_wheels() {  # the Horovod wheel (and a CPU torch wheel, if cached) as build inputs
  rm -rf docker/wheels && mkdir -p docker/wheels
  bash scripts/install.sh >/dev/null  # builds and caches the Horovod wheel if needed
  cp "$CACHE"/horovod-0.28.1-torch2.13.0-tf2.21.0/horovod-*.whl docker/wheels/
  local dir wheel
  # shellcheck disable=SC2086
  for dir in ${HVD_IMAGES_WHEEL_DIRS:-/opt/wheels $CACHE/wheels}; do
    for wheel in "$dir"/torch-2.13.0+cpu-*.whl "$dir"/tensorflow_cpu-2.21.0-*.whl; do
      [ -f "$wheel" ] && cp "$wheel" docker/wheels/
    done
  done
  log "build inputs: $(cd docker/wheels && echo *.whl)"
}

test_workers() {  # test_workers NAME: check-build and 2-rank digits in a workers' image
  local c port
  c="$(buildah from -q "localhost/hvd-compress/$1:$VERSION")"
  CONTAINERS+=("$c")
  # Horovod's Gloo resolves the host name: without one in /etc/hosts, hvd.init() crashes.
  buildah run --isolation chroot --hostname localhost --env TF_CPP_MIN_LOG_LEVEL=3 "$c" -- \
    horovodrun --check-build
  port="$(free_port)"
  start_server "$port" 2
  buildah run --isolation chroot --hostname localhost --env OMP_NUM_THREADS=1 \
    --env TF_CPP_MIN_LOG_LEVEL=3 "$c" -- \
    horovodrun -np 2 -H localhost:2 --gloo python examples/digits.py \
    --scheme topk:ratio=0.01 --ps "grpc://127.0.0.1:$port" --epochs 2
  stop_server
}

test_gpu() {  # what the GPU image holds, then the workers' smoke test on the CPU
  local c
  c="$(buildah from -q "localhost/hvd-compress/gpu:$VERSION")"
  CONTAINERS+=("$c")
  buildah run --isolation chroot --hostname localhost "$c" -- python -c '
import importlib.metadata as m, sys
import torch, horovod.torch as hvd, hvd_compress
names = {d.metadata["Name"].lower(): d.version for d in m.distributions()}
tf = ", ".join(sorted(n for n in names if n.startswith(("tensorflow", "tf-")))) or "none"
nccl = ", ".join(sorted(n + " " + v for n, v in names.items() if n.startswith("nvidia-nccl")))
ours = names.get("hvd-compress")
print(f"[images] in the GPU image: torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"nccl_built: {bool(hvd.nccl_built())} ({hvd.nccl_built()}), {nccl or None}, "
      f"TensorFlow: {tf}, hvd-compress {ours}")
sys.exit(not (torch.version.cuda and hvd.nccl_built() and nccl and tf == "none"))'
  test_workers gpu
}

PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY=python3
BASE_IMAGE="$(base_image)"
for target in "${TARGETS[@]}"; do
  case "$target" in
    server) build server docker/Dockerfile.server; ((TEST)) && test_server ;;
    cpu)
      podman image exists "localhost/hvd-compress/server:$VERSION" || build server docker/Dockerfile.server
      ((BUILD)) && stage_wheels
      build cpu docker/Dockerfile.cpu
      ((TEST)) && test_workers cpu ;;
    gpu)
      podman image exists "localhost/hvd-compress/server:$VERSION" || build server docker/Dockerfile.server
      ((BUILD)) && rm -rf docker/wheels  # the CPU image's build inputs, not this one's
      build gpu docker/Dockerfile.gpu
      ((TEST)) && test_gpu ;;
  esac
done
log "done"
