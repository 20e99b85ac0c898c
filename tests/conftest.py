"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from hvd_compress import native
from tests.servers import ServerProcess

# Ask NVML, not the CUDA runtime, whether there is a GPU: the check then initialises no CUDA
# in this process, which would break the tests that fork ranks afterwards.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

NO_CUDA = "needs CUDA: torch.cuda.is_available() is False"
"""Why the tests marked ``gpu`` are skipped here."""


def pytest_report_header() -> list[str]:
    """The CPU and the kernels ATen chose for it: results compared bit for bit between two
    implementations can depend on both, so a failure says on which machine it happened.
    Then whether CUDA is there, which decides whether the ``gpu`` tests run."""
    import torch

    from tests.harness import cpu_info, simd_flags

    chosen = torch.backends.cpu.get_cpu_capability()
    asked = os.environ.get("ATEN_CPU_CAPABILITY", "unset")
    if torch.cuda.is_available():
        cuda = (f"cuda: available, {torch.cuda.device_count()} device(s), torch built with "
                f"CUDA {torch.version.cuda}: the gpu tests run")
    else:
        cuda = (f"cuda: not available (torch.cuda.is_available() is False; torch built with "
                f"CUDA {torch.version.cuda}): the gpu tests are skipped")
    return [f"cpu: {cpu_info()[0]}; vector flags: {' '.join(simd_flags()) or 'none'}",
            f"torch {torch.__version__}: ATen CPU kernels {chosen} "
            f"(ATEN_CPU_CAPABILITY {asked})", cuda]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip the tests marked ``gpu`` where CUDA is not available, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=NO_CUDA))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """One line naming how many ``gpu`` tests were skipped and why (without ``-rs`` pytest
    prints no reasons)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", [])
               if isinstance(r.longrepr, tuple) and NO_CUDA in r.longrepr[2]]
    if skipped:
        terminalreporter.write_line(f"gpu: {len(skipped)} test(s) skipped: {NO_CUDA}")


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
