"""The deployment files: Dockerfiles lint clean, the compose file is consistent, the
health check works with TLS, and (where podman and buildah are installed) the server image
is built and run for real by ``scripts/images.sh server``."""

from __future__ import annotations

import os
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
                    reason="podman and buildah are not installed "
                    "(scripts/install.sh --with-podman installs them)")
def test_server_image_builds_serves_a_round_and_stops_on_sigterm():
    result = subprocess.run(["bash", str(ROOT / "scripts" / "images.sh"), "server"],
                            capture_output=True, text=True, timeout=900)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "health check in the image: SERVING" in log
    assert '"values": [1.0, 2.0, 3.0, 1.0, 2.0], "health": "SERVING", "frameworks": []' in log
    assert "no torch, TensorFlow or Horovod in the server image" in log
    assert "server stopped by SIGTERM: exit 0, stopped: 1 rounds closed" in log
