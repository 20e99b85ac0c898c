"""The deployment files: Dockerfiles lint clean, the compose file is consistent, the
health check works with TLS, and (where podman and buildah are installed) the server image
is built and run for real by ``scripts/images.sh server``. ``scripts/install.sh --gpu``
selects CUDA builds only; the GPU image (never built by the suite unless
HVD_TEST_GPU_IMAGE=1) holds them and passes ``scripts/images.sh gpu``'s smoke test."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness import ROOT
from tests.servers import ServerProcess

DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def test_every_variant_has_a_dockerfile():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.gpu",
                                             "Dockerfile.server"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile: Path):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    result = subprocess.run([hadolint, "--failure-threshold", "info", str(dockerfile)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    text = dockerfile.read_text()
    assert "ARG BASE=" in text and "scripts/install.sh" in text and "USER 10001" in text


@pytest.mark.multiprocess
def test_compose_references_existing_files_images_and_secrets(tmp_path):
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    built = {}
    for name, service in compose["services"].items():
        if "build" in service:
            context = (DOCKER / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file(), name
            built[service["image"]] = service["build"]["dockerfile"]
    for name, service in compose["services"].items():
        assert service["image"] in built, f"{name} uses an image no service builds"
        for secret in service.get("secrets", []):
            assert secret in compose["secrets"], (name, secret)
        for dependency in service.get("depends_on", {}):
            assert dependency in compose["services"], (name, dependency)
    assert built == {"hvd-compress/server:0.1.0": "docker/Dockerfile.server",
                     "hvd-compress/cpu:0.1.0": "docker/Dockerfile.cpu"}
    # the secrets are the files docker/make-secrets.sh writes, never baked into an image
    subprocess.run(["bash", str(DOCKER / "make-secrets.sh"), str(tmp_path)], check=True,
                   capture_output=True, timeout=60)
    for secret in compose["secrets"].values():
        assert secret["file"].startswith("./secrets/")
        assert (tmp_path / Path(secret["file"]).name).stat().st_size > 0
    assert "docker/secrets" in (ROOT / ".dockerignore").read_text().split()
    server_env = compose["services"]["ps"]["environment"]
    assert server_env["HVD_PS_TOKEN_FILE"].startswith("/run/secrets/")
    assert server_env["HVD_PS_WORKERS"] == str(sum(1 for n in compose["services"]
                                                    if n.startswith("worker")))


@pytest.mark.multiprocess
def test_health_check_with_tls_and_token(tmp_path):
    subprocess.run(["bash", str(DOCKER / "make-secrets.sh"), str(tmp_path)], check=True,
                   capture_output=True, timeout=60)
    server = ServerProcess(["--workers", "2", "--bind", "127.0.0.1:0",
                            "--token-file", str(tmp_path / "ps_token"),
                            "--tls-cert", str(tmp_path / "ps_tls_cert"),
                            "--tls-key", str(tmp_path / "ps_tls_key")])
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT),
                   HVD_PS_TLS_CERT=str(tmp_path / "ps_tls_cert"), HVD_PS_HEALTH_TLS_NAME="ps")
        check = [sys.executable, "-m", "ps_server.healthcheck", server.address]
        ok = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
        assert ok.returncode == 0, ok.stderr
        env.pop("HVD_PS_TLS_CERT")  # plain text against a TLS server: unhealthy, exit 1
        bad = subprocess.run(check, env=env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 1 and "unhealthy" in bad.stderr
    finally:
        server.kill()


@pytest.mark.skipif(not (shutil.which("podman") and shutil.which("buildah")),
                    reason="needs podman and buildah, which are not installed "
                    "(scripts/install.sh --with-podman installs them)")
@pytest.mark.multiprocess
def test_server_image_builds_serves_a_round_and_stops_on_sigterm():
    result = subprocess.run(["bash", str(ROOT / "scripts" / "images.sh"), "server"],
                            capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "health check in the image: SERVING" in log
    assert '"values": [1.0, 2.0, 3.0, 1.0, 2.0], "health": "SERVING", "frameworks": []' in log
    assert "no torch, TensorFlow or Horovod in the server image" in log
    assert "server stopped by SIGTERM: exit 0, stopped: 1 rounds closed" in log


def _requirements(*options: str) -> list[str]:
    """The pip requirements ``scripts/install.sh OPTIONS`` selects, in install order."""
    result = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), *options,
                             "--print-requirements"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.multiprocess
def test_install_gpu_selects_cuda_builds_and_nothing_cpu_over_them():
    from packaging.specifiers import SpecifierSet

    gpu = _requirements("--gpu")
    # torch first, pinned exactly: a local CPU build (2.13.0+cpu, in a --wheels or
    # find-links directory) does not satisfy it, PyPI's CUDA build does
    assert gpu[0] == "torch===2.13.0"
    assert not SpecifierSet("===2.13.0").contains("2.13.0+cpu")
    assert SpecifierSet("===2.13.0").contains("2.13.0")
    # no TensorFlow at all (its CUDA build is CUDA 12.9, torch's 13.0), so no
    # tensorflow-cpu over a CUDA build either; the CUDA compiler and NCCL as wheels
    assert not [r for r in gpu if r.startswith("tensorflow")]
    assert [r for r in gpu if r.startswith("cuda-toolkit[")] == \
        ["cuda-toolkit[nvcc,cccl,cudart]==13.0.3"]
    assert [r for r in gpu if r.startswith("nvidia-nccl")] == ["nvidia-nccl-cu13==2.29.7"]
    assert gpu[-2:] == ["horovod==0.28.1", "hvd-compress[torch,grpc,mpi,server,test]"]
    assert _requirements("--gpu", "--deps-only", "--no-dev")[-1] == "horovod==0.28.1"
    # the default (CPU) install keeps CPU TensorFlow and the plain torch pin
    cpu = _requirements()
    assert cpu[0] == "torch==2.13.0" and "tensorflow-cpu==2.21.0" in cpu
    assert cpu[-1] == "hvd-compress[torch,grpc,mpi,server,tensorflow,test]"
    assert not [r for r in cpu if r.startswith(("cuda-toolkit", "nvidia-"))]


# The GPU image is multi-GB and takes many minutes to build, so the suite never builds it
# unless asked: its tests run on an image already built (scripts/images.sh gpu), or build
# one first when HVD_TEST_GPU_IMAGE=1.
VERSION = re.search(r'^version = "(.*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
GPU_IMAGE = f"localhost/hvd-compress/gpu:{VERSION}"


def _gpu_image_skip_reason() -> str | None:
    if not (shutil.which("podman") and shutil.which("buildah")):
        return ("needs podman and buildah, which are not installed "
                "(scripts/install.sh --with-podman installs them)")
    if os.environ.get("HVD_TEST_GPU_IMAGE") == "1":
        return None
    if subprocess.run(["podman", "image", "exists", GPU_IMAGE], capture_output=True,
                      timeout=60).returncode != 0:
        return (f"{GPU_IMAGE} is not built and the suite does not build it (multi-GB, "
                "many minutes): run scripts/images.sh gpu, or set HVD_TEST_GPU_IMAGE=1")
    return None


_GPU_IMAGE_SKIP = _gpu_image_skip_reason()
needs_gpu_image = pytest.mark.skipif(_GPU_IMAGE_SKIP is not None, reason=str(_GPU_IMAGE_SKIP))


@pytest.fixture(scope="module")
def gpu_image_log() -> str:
    """scripts/images.sh gpu: builds the image if HVD_TEST_GPU_IMAGE=1, else only
    smoke-tests the one there (--no-build)."""
    build = os.environ.get("HVD_TEST_GPU_IMAGE") == "1"
    args = ["gpu"] if build else ["gpu", "--no-build"]
    result = subprocess.run(["bash", str(ROOT / "scripts" / "images.sh"), *args],
                            capture_output=True, text=True, timeout=7200 if build else 900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-20000:]
    return log


@pytest.mark.multiprocess
@needs_gpu_image
def test_gpu_image_holds_cuda_torch_and_nccl_and_no_cpu_tensorflow(gpu_image_log):
    container = subprocess.run(["buildah", "from", "-q", GPU_IMAGE], capture_output=True,
                               text=True, timeout=300, check=True).stdout.strip()
    try:
        script = (
            "import importlib.metadata as m, json, torch\n"
            "print(json.dumps({'dists': {d.metadata['Name'].lower(): d.version\n"
            "                            for d in m.distributions()},\n"
            "                  'cuda': torch.version.cuda}))\n")
        result = subprocess.run(["buildah", "run", "--isolation", "chroot", container, "--",
                                 "python", "-c", script], capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        found = json.loads(result.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True, timeout=120)
    dists = found["dists"]
    assert found["cuda"] is not None and found["cuda"].startswith("13.")  # a CUDA build
    assert dists["torch"] == "2.13.0"
    assert dists["nvidia-nccl-cu13"] == "2.29.7"
    assert dists["horovod"] == "0.28.1" and "hvd-compress" in dists
    assert "tensorflow-cpu" not in dists and "tensorflow" not in dists


@pytest.mark.multiprocess
@needs_gpu_image
def test_gpu_image_smoke_test_nccl_and_digits_on_two_ranks(gpu_image_log):
    log = gpu_image_log
    assert "[X] NCCL" in log, log[-5000:]
    assert "nccl_built: True" in log and "TensorFlow: none" in log
    accuracies = [float(a) for a in re.findall(r"test acc\s+([\d.]+)%", log)]
    assert accuracies and accuracies[-1] > 50, log[-5000:]  # 10 classes: chance is 10%
