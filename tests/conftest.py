"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hvd_compress import native
from tests.servers import ServerProcess


def pytest_report_header() -> list[str]:
    """The CPU and the kernels ATen chose for it: results compared bit for bit between two
    implementations can depend on both, so a failure says on which machine it happened."""
    import torch

    from tests.harness import cpu_info, simd_flags

    chosen = torch.backends.cpu.get_cpu_capability()
    asked = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    return [f"cpu: {cpu_info()[0]}; vector flags: {' '.join(simd_flags()) or 'none'}",
            f"torch {torch.__version__}: ATen CPU kernels {chosen} "
            f"(ATEN_CPU_CAPABILITY {asked})"]


@pytest.fixture(params=["native", "numpy"])
def sparse_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the native sparse kernels, then with the numpy code."""
    if request.param == "native":
        assert native.available(), "the native kernels failed to build"
        yield request.param
    else:
        with native.disabled():
            assert not native.available()
            yield request.param


@pytest.fixture
def grpc_server() -> Iterator[ServerProcess]:
    """One shard for two workers on a free loopback port."""
    server = ServerProcess(["--bind", "127.0.0.1:0", "--workers", "2", "--deadline", "60"])
    try:
        yield server
    finally:
        server.kill()
