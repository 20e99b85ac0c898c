"""Keras 3 elastic training (hvd_compress.tensorflow.elastic.KerasState) under
``horovodrun`` on localhost (tests/workers/elastic_keras.py): a discovery script whose
output changes 2 -> 3 -> 2 workers. Every rank's weights are identical at every step;
what was applied plus what is still owed equals every gradient submitted, across both
resizes (1-bit through DistributedOptimizer); Keras OneBitAdam goes through its freeze
and both resizes. (Compression.auto's decision at every reset: tests/test_elastic.py on
threads, tests/test_elastic_horovodrun.py under horovodrun.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import rank_env, run_command
from tests.test_elastic_horovodrun import elastic_launch

RESIZE = "10=localhost:2+127.0.0.1:1;25=localhost:2"
STEPS = 40


def run_keras_job(tmp: Path, scheme: str, resize: str = RESIZE, kill_step: int = -1,
                  gloo_timeout: int = 120) -> dict:
    hosts, launch = elastic_launch(tmp, "keras")
    out = tmp / "keras.json"
    # Where nothing is killed, a long timeout only gives a slow joining process
    # (TensorFlow's start-up on a loaded machine) room to reach the rendezvous; with a kill
    # it is how long the survivors take to notice.
    cmd = [*launch, "--gloo-timeout-seconds", str(gloo_timeout), "python", "-m",
           "tests.workers.elastic_keras", "--scheme", scheme, "--steps", str(STEPS),
           "--hosts", str(hosts), "--resize", resize, "--kill-step", str(kill_step),
           "--out", str(out)]
    env = dict(rank_env(), OMP_NUM_THREADS="1", TF_CPP_MIN_LOG_LEVEL="2")
    result = run_command(cmd, timeout=500, env=env)
    lines = [line for line in result.stdout.splitlines() if "oneDNN" not in line]
    assert out.exists(), "no result; output tail:\n" + "\n".join(lines[-80:])
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.tensorflow
@pytest.mark.parametrize("scheme", ["onebit", "onebit_adam"])
def test_keras_elastic_resizes(tmp_path: Path, scheme: str) -> None:
    run = run_keras_job(tmp_path, scheme)
    print(f"{scheme}: {json.dumps(run)}")
    assert run["sizes"] == [[1, 2], [11, 3], [26, 2]], run
    assert run["resets"] == 2, run
    assert run["mismatches"] == [], run
    assert run["checks"] >= STEPS
    assert run["accuracy"] > 50.0, run
    if scheme == "onebit":
        assert run["owed_norm"] > 0.0
        assert run["conservation_error"] <= 1e-5 * max(run["given_scale"], 1.0), run


@pytest.mark.multiprocess
@pytest.mark.tensorflow
def test_keras_elastic_survives_a_sigkill(tmp_path: Path) -> None:
    """2 -> 3, then the third worker kills itself (SIGKILL) after a backward pass: the
    survivors notice at the Gloo timeout, Horovod's TF ``run`` restores the last commit
    (step 20) and the job ends on 2 ranks with identical weights at every step. (The
    conservation sums are not checked here: the killed rank's steps since the commit are
    rolled back, and rank 0 counted them.)"""
    run = run_keras_job(tmp_path, "onebit", resize="10=localhost:2+127.0.0.1:1",
                        kill_step=22, gloo_timeout=30)
    print(f"onebit, SIGKILL: {json.dumps(run)}")
    assert run["sizes"] == [[1, 2], [11, 3], [21, 2]], run
    assert run["resets"] == 2 and run["size"] == 2, run
    assert run["mismatches"] == [], run
    assert run["checks"] >= STEPS
    assert run["accuracy"] > 50.0, run
