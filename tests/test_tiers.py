"""The check in tests/conftest.py that keeps the tiers honest: a test that starts a process
other than a quick tool must be marked ``multiprocess``, and one that runs TensorFlow (here
or in a child) ``tensorflow``; the fast tier (``scripts/test.sh``) deselects both."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import is_launch, uses_tensorflow
from tests.harness import ROOT

pytest_plugins = ["pytester"]

INNER = '''
import subprocess, sys
import pytest

def test_unmarked_launch():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.multiprocess
def test_marked_launch():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_quick_tool_only():
    subprocess.run(["true"], check=True)

@pytest.mark.multiprocess
def test_tensorflow_child_unmarked():
    subprocess.run([sys.executable, "-c", "pass", "tensorflow"], check=True)

@pytest.fixture(scope="module")
def shared_launch():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.multiprocess
def test_first_reader(shared_launch):
    pass

def test_second_reader_unmarked(shared_launch):
    pass
'''


def test_launches_are_child_processes_other_than_quick_tools() -> None:
    assert is_launch([sys.executable, "-m", "tests.rank_main"])
    assert is_launch(["mpirun", "-np", "2", "python"])
    assert is_launch(["bash", str(ROOT / "scripts" / "images.sh")])
    assert not is_launch(["/usr/bin/g++", "-shared", "codecs.cpp"])
    assert not is_launch(["hadolint", "Dockerfile"])
    assert not is_launch([])


def test_tensorflow_children_are_known_by_their_command_line() -> None:
    assert uses_tensorflow(["horovodrun", "-np", "2", sys.executable, "-m", "tests.rank_main",
                            "/tmp/out", "tests.workers.tf_keras:digits", "{}"])
    assert uses_tensorflow(["mpirun", "python", "-m", "tests.workers.mpmd_init", "hvdc",
                            "tensorflow"])
    assert uses_tensorflow([sys.executable, "-c", "import horovod.tensorflow as hvd"])
    assert not uses_tensorflow(["horovodrun", sys.executable, "-m", "tests.rank_main",
                                "/tmp/out", "tests.workers.dense:aggregates", "{}"])
    assert not uses_tensorflow([sys.executable, "tests/frameworks_blocked.py", "-m",
                                "ps_server"])


@pytest.mark.multiprocess
def test_unmarked_launches_fail_at_teardown_and_marked_ones_pass(
        pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session with the conftest's hooks: the unmarked launch, the unmarked TensorFlow
    child and the unmarked reader of a module fixture that launched (after a marked test
    set it up) fail with the reason; the marked launch and the quick tool pass."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "tests.conftest", "-p", "no:cacheprovider",
                                           "-rE", "-W", "ignore::pytest.PytestUnknownMarkWarning")
    outcomes = result.parseoutcomes()
    assert outcomes.get("errors") == 3, result.stdout.str()
    assert outcomes.get("passed") == 6, result.stdout.str()
    result.stdout.fnmatch_lines([
        "*test_unmarked_launch*started*is not marked multiprocess*",
        "*test_tensorflow_child_unmarked*runs TensorFlow but is not marked tensorflow*",
        "*test_second_reader_unmarked*uses the launching fixture(s) shared_launch*"])
    errors = [line for line in result.stdout.lines if line.startswith("ERROR ")]
    assert not [e for e in errors if "marked_launch" in e and "unmarked" not in e], errors
    assert not [e for e in errors if "quick_tool" in e or "first_reader" in e], errors
