"""Fixtures shared by several test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


QUICK_TOOLS = frozenset({"cc", "c++", "gcc", "g++", "clang", "clang++", "false", "true", "git",
                         "hadolint", "ip", "tc", "mount", "umount", "nvidia-smi", "uname",
                         "nproc"})
"""Programs a test may run without being a launch: compilers (the native kernels' build, or
``false`` standing in for a broken one), linters and system tools that start no rank,
server or worker. Anything else a test starts (Python, a launcher, a shell script, a
container tool) is a launch."""

TF_WORKERS = tuple(f"tests.workers.{path.stem}:" for path in
                   sorted((Path(__file__).parent / "workers").glob("tf_*.py")))
"""``run_ranks`` targets whose module imports TensorFlow on every rank."""
TF_WORDS = ("import tensorflow", "tensorflow as tf", "horovod.tensorflow", "_keras.py")
"""What the command line of a child that runs TensorFlow contains (``python -c`` code, a
Keras example), besides a :data:`TF_WORKERS` target or the argument ``tensorflow``."""

_children: list[list[str]] = []
_launching_fixtures: set[tuple[str, str]] = set()
TF_BEFORE = pytest.StashKey[bool]()
_spawn = subprocess.Popen._execute_child  # type: ignore[attr-defined]


def _recording_spawn(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> Any:
    """Note the command line of every child this process starts, then start it."""
    shell = rest[8] if len(rest) > 8 else kw.get("shell", False)
    argv = [str(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    _children.append(["/bin/sh", "-c", *argv] if shell else argv)
    return _spawn(self, args, *rest, **kw)


subprocess.Popen._execute_child = _recording_spawn  # type: ignore[attr-defined]


def is_launch(argv: list[str]) -> bool:
    """Whether a child is a launch (a rank, a server, a worker, a launcher, a container):
    anything but :data:`QUICK_TOOLS`."""
    return bool(argv) and Path(argv[0]).name not in QUICK_TOOLS


def uses_tensorflow(argv: list[str]) -> bool:
    """Whether a child runs TensorFlow, judged from its command line: a ``run_ranks`` target
    in :data:`TF_WORKERS`, the argument ``tensorflow`` (``tests.workers.mpmd_init``'s
    binding) or one of :data:`TF_WORDS`."""
    return "tensorflow" in argv or any(
        word in arg for arg in argv for word in (*TF_WORKERS, *TF_WORDS))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    """Forget the children of earlier tests; note whether TensorFlow was imported yet."""
    _children.clear()
    item.stash[TF_BEFORE] = "tensorflow" in sys.modules
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Iterator[Any]:
    """Remember the fixtures whose setup launched something: every test that uses one (a
    launch shared per module) counts as launching, not only the first to set it up."""
    before = len(_children)
    try:
        return (yield)
    finally:
        if any(map(is_launch, _children[before:])):
            _launching_fixtures.add((fixturedef.baseid, fixturedef.argname))


def shared_launches(item: pytest.Item) -> list[str]:
    """The fixtures ``item`` uses whose setup launched something."""
    return [name for base, name in sorted(_launching_fixtures)
            if name in getattr(item, "fixturenames", ()) and item.nodeid.startswith(base)]


def marker_problems(item: pytest.Item) -> list[str]:
    """What ``item`` did that its markers do not say: a launch (its own, or a fixture's it
    uses) without ``multiprocess``, TensorFlow (here or in a child) without ``tensorflow``."""
    launches = [argv for argv in _children if is_launch(argv)]
    problems = []
    if item.get_closest_marker("multiprocess") is None:
        if launches:
            problems.append(f"started {' '.join(launches[0])[:300]!r} (and "
                            f"{len(launches) - 1} more) but is not marked multiprocess")
        elif shared := shared_launches(item):
            problems.append(f"uses the launching fixture(s) {', '.join(shared)} but is not "
                            "marked multiprocess")
    imported = "tensorflow" in sys.modules and not item.stash.get(TF_BEFORE, True)
    if ((imported or any(map(uses_tensorflow, launches)))
            and item.get_closest_marker("tensorflow") is None):
        problems.append("runs TensorFlow but is not marked tensorflow")
    return problems


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    """Fail a test, at its teardown, that launched processes or ran TensorFlow without the
    marker that keeps it out of the fast tier (``scripts/test.sh``)."""
    report = yield
    if call.when == "teardown" and report.passed and (problems := marker_problems(item)):
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid}: " + "; ".join(problems) + ". Mark it (see "
                           "setup.cfg's markers) so that the tiers select it correctly.")
    return report


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
def package_index() -> None:
    """Skip the test, saying so, when pip's package index is out of reach (offline)."""
    from tests.harness import package_index_unreachable

    if (reason := package_index_unreachable()) is not None:
        pytest.skip(reason)


@pytest.fixture
def grpc_server() -> Iterator[ServerProcess]:
    """One shard for two workers on a free loopback port."""
    server = ServerProcess(["--bind", "127.0.0.1:0", "--workers", "2", "--deadline", "60"])
    try:
        yield server
    finally:
        server.kill()
