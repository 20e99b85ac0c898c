"""scripts/gpu_check.sh's refusals, which need no GPU (the whole script ran here with
GPU_CHECK_ALLOW_CPU=1; on a CUDA machine it is the device check itself)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.multiprocess
def test_usage() -> None:
    done = run()
    assert done.returncode == 64 and "usage: scripts/gpu_check.sh OUTDIR" in done.stderr


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the check would run")
def test_without_cuda_it_refuses_unless_allowed(tmp_path: Path) -> None:
    done = run(str(tmp_path), GPU_CHECK_ALLOW_CPU="0")
    assert done.returncode == 2, done.stderr
    assert "torch.cuda.is_available() is False" in done.stderr
    assert "GPU_CHECK_ALLOW_CPU=1" in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["run.log"]
