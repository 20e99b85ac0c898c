"""``collectives="gloo"``: the dense rounds on a torch.distributed Gloo group, on 2 real ranks
under horovodrun (Gloo) and mpirun (MPI)."""

from __future__ import annotations

import pytest
import torch

from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.pipeline import Pipeline
from hvd_compress.schemes.dense import NoCompression
from tests.harness import LAUNCHERS, run_ranks

EXCHANGE_SPECS = ["none", "fp16", "bf16-grads", "onebit:bucket_size=64",
                  "qsgd:bucket_size=64", "powersgd:rank=2,start_iter=0", "topk:ratio=0.1"]
TRAIN_SPECS = ["none", "powersgd:start_iter=2", "onebit", "topk:ratio=0.05"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_gloo_aggregates_equal_horovods_bit_for_bit(launcher: str) -> None:
    # At 2 ranks a sum has one order (a + b == b + a), so any difference would be a
    # collective that moved or summed the wrong bytes: every kind of round is covered
    # (all-reduce in fp32, fp16 and bf16-as-fp32, all-to-all and all-gather of packed
    # bytes, PowerSGD's P and Q, and top-k's pairs gathered as frames).
    ranks = run_ranks("tests.workers.gloo:aggregates", launcher=launcher,
                      specs=EXCHANGE_SPECS)
    for spec in EXCHANGE_SPECS:
        row = ranks[0][spec]
        assert row["gloo_collectives"] == row["horovod_collectives"] > 0, spec
        # Every round stays on the group, top-k's sums too (frames in slots of a size
        # every rank knows): none waits for Horovod's cycle.
        assert row["handed_to_horovod"] == [], spec
    names = [n for n in ranks[0] if n not in EXCHANGE_SPECS]
    assert len(names) == 4 * len(EXCHANGE_SPECS)
    for name in names:
        for rank in ranks:
            assert torch.equal(rank[name]["gloo"], rank[name]["horovod"]), name
            assert rank[name]["gloo"].dtype == rank[name]["horovod"].dtype, name
        assert torch.equal(ranks[1][name]["gloo"], ranks[0][name]["gloo"]), name


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_training_over_gloo_equals_training_over_horovod(launcher: str) -> None:
    # Buckets of 0.01 MiB: several buckets, started during backward in plan order.
    ranks = run_ranks("tests.workers.gloo:training", launcher=launcher, specs=TRAIN_SPECS)
    for spec in TRAIN_SPECS:
        rows = [r[spec] for r in ranks]
        assert torch.isfinite(rows[0]["gloo"]).all(), spec
        assert all(torch.equal(r["gloo"], rows[0]["gloo"]) for r in rows), spec
        assert torch.equal(rows[0]["gloo"], rows[0]["horovod"]), spec
        assert rows[0]["gloo_collectives"] == rows[0]["horovod_collectives"] > 1, spec


class _Recorder:
    """A ThreadGroup rank that records the order collectives start in, and says it is
    ordered (as the Gloo communicator does)."""

    ordered = True

    def __init__(self, comm: object) -> None:
        self.comm = comm
        self.rank, self.size = comm.rank, comm.size  # type: ignore[attr-defined]
        self.started: list[str] = []

    def start(self, name: str, op: object) -> object:
        self.started.append(name)
        return self.comm.start(name, op)  # type: ignore[attr-defined]

    def wait(self, handle: object) -> object:
        return self.comm.wait(handle)  # type: ignore[attr-defined]


def test_ordered_communicator_gets_buckets_in_plan_order() -> None:
    # Gradients arrive in the reverse of the plan: an unordered communicator starts each
    # bucket as it completes; an ordered one holds them back until the earlier ones start.
    group = ThreadGroup(1)
    names, numels = ["a", "b", "c"], [4, 4, 4]
    for ordered, expected in ((False, ["hvdc.c.dense", "hvdc.b.dense", "hvdc.a.dense"]),
                              (True, ["hvdc.a.dense", "hvdc.b.dense", "hvdc.c.dense"])):
        comm = _Recorder(group.communicator(0))
        comm.ordered = ordered
        pipe = Pipeline(NoCompression(), comm, bucket_bytes=16)  # type: ignore[arg-type]
        assert pipe.plan(names, numels) == [["a"], ["b"], ["c"]]
        for name in reversed(names):
            pipe.submit(name, torch.ones(4))
        if ordered:
            assert comm.started == expected  # a, submitted last, let all three start
        pipe.wait()
        assert comm.started == expected


def test_optimizer_refuses_unknown_collectives_at_construction() -> None:
    """Before ``hvd.init()`` and before any group is joined."""
    from hvd_compress.torch import DistributedOptimizer

    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match=r"collectives must be one of \('horovod', 'gloo', "
                                         r"'nccl'\), got 'mpi'"):
        DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), collectives="mpi")


@pytest.mark.multiprocess
def test_a_bad_store_address_fails_every_rank_at_construction() -> None:
    ranks = run_ranks("tests.workers.gloo:refused_address", timeout=120,
                      address="no-such-host.invalid")
    for message in ranks:
        assert message.startswith("collectives='gloo' could not set up its Gloo group on "
                                  "rank 0: 'no-such-host.invalid' does not resolve"), message
        assert "set MASTER_ADDR" in message
