"""A straggler that is stopped outright (SIGSTOP) for several rounds, with a real server
running ``--quorum 2 --grace 0.15`` for 3 worker processes (issue 26, "Partial
aggregation"): the others go on, the stopped one catches up after SIGCONT, every worker
applies the same aggregates, and no gradient mass is lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.harness import ROOT
from tests.servers import start_servers  # noqa: F401 (fixture `start`)

WORKERS, STEPS, PACE = 3, 40, 0.05


def _worker(address: str, rank: int, out: str, skip: bool) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "tests.workers.quorum", address, str(rank),
                             str(WORKERS), str(STEPS), out, str(PACE)]
                            + (["skip"] if skip else []), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_step(proc: subprocess.Popen[str], step: int, seen: list[str]) -> None:
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == f"step {step}":
            return
    raise AssertionError(f"worker exited ({proc.wait()}) before step {step}:\n"
                         + "".join(seen))


@pytest.mark.multiprocess
@pytest.mark.parametrize("skip", [False, True], ids=["computing", "skipping"])
def test_a_stopped_worker_catches_up_and_nothing_is_lost(start, tmp_path, skip):
    """``skipping``: the stopped worker's loader goes through skip_behind, so after
    SIGCONT it computes no gradient for the rounds that closed meanwhile."""
    server = start("--workers", str(WORKERS), "--quorum", "2", "--grace", "0.15",
                   "--deadline", "30")
    outs = [str(tmp_path / f"w{r}.npz") for r in range(WORKERS)]
    procs = [_worker(server.address, r, outs[r], skip) for r in range(WORKERS)]
    seen: list[str] = []
    try:
        _wait_for_step(procs[2], 5, seen)
        os.kill(procs[2].pid, signal.SIGSTOP)
        time.sleep(1.5)  # the others close rounds without it meanwhile
        os.kill(procs[2].pid, signal.SIGCONT)
        for proc in procs:
            rest, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, rest
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
    results = [np.load(out) for out in outs]
    late = results[2]["rounds"]  # (contributors, refused pairs) per round
    assert late[:, 1].sum() > 0  # its pairs were refused while it was stopped, and kept
    assert (int(results[2]["skipped"]) > 0) == skip  # no gradient for rounds it missed
    for result in results:
        assert len(result["aggregates"]) == STEPS  # every worker took part in every round
    assert any(tuple(r) == (3, 0) for r in late[-5:])  # it caught up and contributed again
    # Refused once it runs again; the rounds the refusal names as closed are only pulled.
    assert server.log().count("is late: the round closed with 2 of 3 workers") >= 1
    for r in (1, 2):
        np.testing.assert_array_equal(results[r]["aggregates"], results[0]["aggregates"])
    grads = sum(r["grads"] for r in results)
    kept = sum(r["residual"] for r in results)
    np.testing.assert_array_equal(results[0]["applied"] + kept, grads)
