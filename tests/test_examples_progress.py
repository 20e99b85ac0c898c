"""The examples show progress: a line per epoch on rank 0 (PyTorch and Keras), the run's
compression summary, and TensorBoard logs when asked."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.harness import launch_command, run_command

pytestmark = pytest.mark.multiprocess

EPOCH = re.compile(r"\[onebit\] epoch +(\d+)/2  loss [0-9.]+  test acc +[0-9.]+%  "
                   r"bytes/step [0-9,]+ \(fp32 104,488, [0-9.]+x\)")


def run_example(script: str, *args: str) -> str:
    cmd = [*launch_command("gloo", 2), sys.executable, f"examples/{script}",
           "--scheme", "onebit", "--epochs", "2", *args]
    done = run_command(cmd, 400)
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def epochs_printed(out: str) -> list[tuple[str, int]]:
    """(horovodrun's rank prefix, epoch) of every epoch line."""
    return [(line.split(":")[0], int(m.group(1))) for line in out.splitlines()
            if (m := EPOCH.search(line))]


@pytest.mark.tensorflow
def test_keras_example_prints_each_epoch_on_rank_0() -> None:
    assert epochs_printed(run_example("digits_keras.py")) == [("[0]<stdout>", 1),
                                                              ("[0]<stdout>", 2)]


def test_torch_example_prints_epochs_summary_and_logs_to_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    out = run_example("digits.py", "--tensorboard", str(tmp_path))
    assert epochs_printed(out) == [("[0]<stdout>", 1), ("[0]<stdout>", 2)]
    assert re.search(r"\[onebit\] 44 steps: sent [0-9.]+ kB for 4.6 MB of float32 gradients "
                     r"\([0-9.]+x smaller\)", out), out[-3000:]
    assert list((tmp_path / "onebit").glob("events.out.tfevents.*"))
