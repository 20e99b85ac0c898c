"""Sparse schemes on 2 real ranks: summed by Horovod ``allgather``, by a parameter server
over gRPC (its own process), and by server ranks of one MPMD ``mpirun`` over MPI."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.harness import run_ranks
from tests.servers import ServerProcess
from tests.test_multiprocess import check_aggregates, check_idle_wait, check_training

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(900)]

# Top-k and random-k keep what they did not send in their residuals: the aggregate must be
# the sum of x - residual over ranks, whichever way the pairs travel.
AGGREGATE_SPECS = ["topk:ratio=0.05", "topk:ratio=0.2,values=fp16", "randomk:ratio=0.1"]
TRAIN_SPECS = ["topk:ratio=0.05", "dgc:ratio=0.01,momentum=0.9", "randomk:ratio=0.1"]
# Each run's sums travel one way: (launcher, parameter server).
ROUTES = [("gloo", None), ("mpi", None), ("gloo", "grpc"), ("mpi", "mpi")]
DIGITS_SPECS = ["none", "topk:ratio=0.01", "dgc:ratio=0.001,momentum=0.5,warmup_steps=100"]


def run_sparse(target: str, launcher: str, ps: str | None, request: pytest.FixtureRequest,
               **kwargs: object) -> list:
    if ps == "grpc":
        server = request.getfixturevalue("grpc_server")
        return run_ranks(target, launcher=launcher, timeout=600,
                         ps=f"grpc://{server.address}", **kwargs)
    if ps == "mpi":
        return run_ranks(target, launcher=launcher, timeout=600, mpi_servers=1, ps="mpi",
                         **kwargs)
    return run_ranks(target, launcher=launcher, timeout=600, **kwargs)


@pytest.mark.parametrize(("launcher", "ps"), ROUTES)
def test_sparse_sums_and_training_on_every_route(launcher: str, ps: str | None,
                                                 request: pytest.FixtureRequest) -> None:
    ranks = run_sparse("tests.workers.dense:sparse", launcher, ps, request,
                       aggregate_specs=AGGREGATE_SPECS, train_specs=TRAIN_SPECS)
    unbiased = check_aggregates([r["aggregates"] for r in ranks])
    assert not unbiased  # every sparse scheme here reports what it sent
    for r in ranks:  # the sums are sparse: at most k pairs per rank landed
        agg = r["aggregates"]["topk:ratio=0.05/t1"]["aggregate"]
        assert 0 < int((agg != 0).sum()) <= 2 * 512
    check_training([r["training"] for r in ranks], TRAIN_SPECS)


@pytest.mark.parametrize(("launcher", "ps"), [("gloo", "grpc"), ("mpi", "mpi")])
def test_digits_with_a_parameter_server_matches_uncompressed(
        launcher: str, ps: str, request: pytest.FixtureRequest) -> None:
    """Top-k 1% and DGC 0.1% through the server: within 1.0 point of float32."""
    ranks = run_sparse("tests.workers.dense:digits", launcher, ps, request,
                       specs=DIGITS_SPECS, epochs=20)
    accuracy = ranks[0]
    assert accuracy == ranks[1]
    assert accuracy["none"] > 94, accuracy
    for spec, acc in accuracy.items():
        assert acc >= accuracy["none"] - 1.0, f"{spec}: {acc:.2f}% vs {accuracy['none']:.2f}%"


def test_waiting_on_the_mpi_server_leaves_the_core_idle() -> None:
    """A blocking MPI receive spins; the MPI client polls and sleeps while its pull waits
    a second for the other worker's push."""
    ranks = run_ranks("tests.workers.dense:late_partner", launcher="mpi", mpi_servers=1,
                      ps="mpi", delay=1.0)
    check_idle_wait(ranks, 1.0)


def test_topk_sums_agree_between_the_server_and_allgather(
        request: pytest.FixtureRequest) -> None:
    """The same inputs give bit-identical aggregates through either path."""
    specs = AGGREGATE_SPECS[:2]
    via_server = run_sparse("tests.workers.dense:aggregates", "gloo", "grpc", request,
                            specs=specs)
    via_allgather = run_sparse("tests.workers.dense:aggregates", "gloo", None, request,
                               specs=specs)
    for name, row in via_server[0].items():
        assert torch.equal(row["aggregate"], via_allgather[0][name]["aggregate"]), name


def test_training_goes_on_through_a_server_kill_9_and_restart(tmp_path: Path) -> None:
    """The server dies (SIGKILL) mid-training and restarts from its checkpoint; the
    workers retry and end bit-identical to a run that never lost the server."""
    args = ["--workers", "2", "--deadline", "60", "--checkpoint-dir", str(tmp_path / "ckpt")]
    server = ServerProcess(["--bind", "127.0.0.1:0", *args])
    marker = tmp_path / "marker"
    kwargs = {"launcher": "gloo", "timeout": 600, "ps": f"grpc://{server.address}",
              "steps": 30, "pause_at": 8}
    restarted = None
    try:
        with ThreadPoolExecutor(1) as pool:
            job = pool.submit(run_ranks, "tests.workers.dense:through_restart",
                              marker=str(marker), **kwargs)
            give_up = time.monotonic() + 300
            while not marker.exists() and not job.done() and time.monotonic() < give_up:
                time.sleep(0.05)
            assert marker.exists(), "the workers never reached the step before the kill"
            server.kill()
            restarted = ServerProcess(["--bind", server.address, *args])
            interrupted = job.result()
        # The restart came mid-training: the checkpoint held rounds short of the last one.
        resumed = restarted.wait_for(r"resumed from .*open rounds \{(.*)\}").group(1)
        rounds = [int(r) for r in re.findall(r": (\d+)", resumed)]
        assert rounds and all(0 < r < 30 for r in rounds), resumed
        uninterrupted = run_ranks("tests.workers.dense:through_restart",
                                  marker=str(tmp_path / "unused"), **kwargs)
    finally:
        server.kill()
        if restarted is not None:
            restarted.kill()
    assert torch.equal(interrupted[0], interrupted[1])
    assert torch.equal(interrupted[0], uninterrupted[0])
