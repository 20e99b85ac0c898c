"""Fixtures shared by several test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hvd_compress import native
from tests.servers import ServerProcess


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
