"""Rounds that close by quorum without the slowest worker and lose nothing (issue 26,
"Partial aggregation"), in process: the store's rounds, the journal, the client's view of
a late push, and top-k workers over a real gRPC server in threads, where the sum of every
aggregate plus every residual equals the sum of all gradients exactly."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hvd_compress.bench.stragglers import SparseOnly
from hvd_compress.comm.ops import SparseSum
from hvd_compress.comm.parameter_server import (
    PARTIAL,
    ParameterServerCommunicator,
    _ServerRound,
    skip_behind,
)
from hvd_compress.comm.ps_transport.base import (
    LATE,
    PartialSum,
    PendingRound,
    ShardedClient,
    counted_pairs,
)
from hvd_compress.comm.ps_transport.mpi import MPIPSClient
from hvd_compress.ps_protocol import late_detail, missing_of, open_round_of
from hvd_compress.sparse_wire import SERVER_ID, Kind, decode_frame, encode_frame
from ps_server import checkpoint, grpc_transport
from ps_server.__main__ import parse_args
from ps_server.errors import LateRound
from ps_server.service import ShardService
from ps_server.store import (
    ConflictingPush,
    Quorum,
    RequestError,
    ShardStore,
    StaleRound,
)
from tests.workers import quorum as worker

NUMEL = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def push(worker: int, round: int, idx, val, tensor: str = "w") -> bytes:
    return encode_frame(Kind.PUSH, tensor, 0, 1, round, worker, NUMEL,
                        np.asarray(idx, np.int64), np.asarray(val, np.float32))


def pull(round: int, worker: int = 0, tensor: str = "w") -> bytes:
    return encode_frame(Kind.PULL, tensor, 0, 1, round, worker, NUMEL)


def make(workers: int = 3, size: int = 2, grace: float = 1.0, keep: int = 64,
         **kw) -> tuple[ShardService, Clock]:
    clock = Clock()
    store = ShardStore(workers, 0, 1, deadline=10.0, clock=clock,
                       quorum=Quorum(workers, size, grace, keep))
    return ShardService(store, **kw), clock


def pairs_of(data: bytes) -> tuple[list[int], list[float], int]:
    """An aggregate frame's indices, values and worker field."""
    frame = decode_frame(data)
    return frame.indices.tolist(), frame.values.tolist(), frame.worker


@pytest.mark.parametrize(("spec", "workers", "size"), [
    (None, 4, 4), ("3", 4, 3), ("0.75", 4, 3), ("0.5", 3, 2), ("1.0", 5, 5), ("1", 5, 1)])
def test_quorum_is_a_count_or_a_fraction_of_the_workers(spec, workers, size):
    quorum = Quorum.parse(spec, workers, 0.5)
    assert (quorum.size, quorum.partial) == (size, size < workers)


@pytest.mark.parametrize("spec", ["0", "5", "1.5", "-1", "2.5", "half"])
def test_a_bad_quorum_is_refused_by_name(spec):
    with pytest.raises(ValueError, match="quorum"):
        Quorum.parse(spec, 4)


def test_the_command_line_takes_a_quorum_and_a_grace_below_the_deadline(capsys):
    args = parse_args(["--workers", "4", "--quorum", "0.75", "--grace", "0.2"])
    assert (args.quorum.size, args.quorum.grace) == (3, 0.2)
    assert not parse_args(["--workers", "4"]).quorum.partial
    with pytest.raises(SystemExit):
        parse_args(["--workers", "4", "--quorum", "3", "--grace", "200", "--deadline", "5"])
    assert "--grace (200) must be below --deadline (5)" in capsys.readouterr().err


def test_a_round_closes_with_the_quorum_once_the_grace_has_passed():
    service, clock = make(workers=3, size=2, grace=1.0)
    service.push(push(0, 0, [1, 2], [1.0, 2.0]), "a")
    service.push(push(1, 0, [2, 3], [10.0, 20.0]), "b")
    assert service.store.try_pull(decode_frame(pull(0))) is None  # within the grace
    clock.now = 1.0
    indices, values, sender = pairs_of(service.store.try_pull(decode_frame(pull(0))))
    assert (indices, values, missing_of(sender)) == ([1, 2, 3], [1.0, 12.0, 20.0], 1)
    assert service.store.tensors["w"].last.contributors == (0, 1)
    assert service.store.partial_rounds == 1


def test_a_round_that_every_worker_pushed_closes_at_once_and_says_so():
    service, _ = make(workers=3, size=2, grace=5.0)
    for w in range(3):
        service.push(push(w, 0, [w], [1.0]), "p")
    indices, values, sender = pairs_of(service.pull(pull(0), "p", 0.1))
    assert (indices, values, sender) == ([0, 1, 2], [1.0, 1.0, 1.0], SERVER_ID)
    assert service.store.partial_rounds == 0


def test_a_round_below_the_quorum_waits_for_it_after_the_grace():
    service, clock = make(workers=3, size=2, grace=1.0)
    service.push(push(0, 0, [1], [1.0]), "a")
    clock.now = 5.0
    service.store.expire()
    assert service.store.try_pull(decode_frame(pull(0))) is None
    service.push(push(2, 0, [1], [2.0]), "c")  # the quorum, after the grace: closes now
    assert pairs_of(service.store.try_pull(decode_frame(pull(0))))[:2] == ([1], [3.0])


def test_a_late_push_is_refused_with_its_own_status_and_the_late_worker_pulls_the_round():
    service, _ = make(workers=3, size=2, grace=0.0)
    service.push(push(0, 0, [1], [1.0]), "a")
    service.push(push(1, 0, [1], [2.0]), "b")  # quorum, grace 0: closed
    answer = service.pull(pull(0, worker=0), "a", 0.1)
    with pytest.raises(LateRound, match=r"late: the round closed with 2 of 3 workers") as err:
        service.push(push(2, 0, [1], [4.0]), "c")
    assert err.value.code == LATE == "OUT_OF_RANGE"
    assert service.store.late_pushes == 1
    assert service.pull(pull(0, worker=2), "c", 0.1) == answer  # the same bytes
    assert service.push(push(0, 0, [1], [1.0]), "a")  # a retransmission changes nothing
    with pytest.raises(ConflictingPush):
        service.push(push(1, 0, [1], [9.0]), "b")
    # The late worker goes on with the open round, which waits for the quorum again.
    service.push(push(2, 1, [5], [4.0]), "c")
    assert service.store.try_pull(decode_frame(pull(1))) is None


def test_late_workers_pull_every_kept_round_and_older_ones_are_stale():
    service, _ = make(workers=3, size=2, grace=0.0, keep=3)
    answers = []
    for r in range(5):
        service.push(push(0, r, [r], [1.0]), "a")
        service.push(push(1, r, [r], [2.0]), "b")
        answers.append(service.pull(pull(r), "a", 0.1))
    for r in (2, 3, 4):
        assert service.pull(pull(r, worker=2), "c", 0.1) == answers[r]
    with pytest.raises(StaleRound, match="last 3 closed rounds"):
        service.pull(pull(1, worker=2), "c", 0.1)


def test_a_late_refusal_names_the_open_round_and_the_client_skips_to_it():
    """Rounds 0-3 closed with workers 0 and 1: worker 2's push for round 0 is refused
    naming open round 4, so its rounds 0-3 are closed (but for a shard that took the
    push, only round 0 is), and it may pull round 2 without pushing it."""
    service, _ = make(workers=3, size=2, grace=0.0)
    for r in range(4):
        service.push(push(0, r, [r], [1.0]), "a")
        service.push(push(1, r, [r], [2.0]), "b")
    with pytest.raises(LateRound) as err:
        service.push(push(2, 0, [1], [4.0]), "c")
    assert open_round_of(str(err.value)) == 4 and open_round_of("is late") is None
    assert open_round_of(late_detail("x", 17)) == 17
    late = PendingRound("t", 0, [0, 5, 10], [], [], late=[str(err.value), None])
    assert late.closed_before() == 1  # shard 1 took the push: round 1 may be open there
    late.late[1] = late_detail("late", 3)
    assert late.closed_before() == 3
    assert service.pull(pull(2, worker=2), "c", 0.1)  # a closed round, pulled only


def test_a_behind_worker_pulls_the_closed_rounds_and_pushes_its_residual_in_the_open_one():
    """Told by a late refusal of round 0 that the server has round 3 open, the
    communicator only pulls rounds 1 and 2 (refusing all their pairs to the scheme) and
    counts round 3 as behind too; skip_behind drops the loader's batches of rounds 1-3
    and runs the optimizer's step on zeros for each (for round 3 a push, of what the
    scheme gives it)."""

    class Client(_Client):
        def __init__(self) -> None:
            self.started: list[tuple[int, int, bool]] = []

        def start(self, tensor, round, numel, indices, values, push=True):
            self.started.append((round, len(indices), push))
            late = [late_detail("late", 3) if round == 0 else None]
            return PendingRound(tensor, round, [0, numel], [], [], late=late,
                                pull_only=not push)

        def finish(self, pending):
            pending.missing.append(1)
            return torch.tensor([0]), torch.tensor([5.0])

    client = Client()
    comm = ParameterServerCommunicator(SparseOnly(0, 4), client, "s", partial="unscaled")
    op = SparseSum("sparse", 8, torch.tensor([1, 6]), torch.tensor([3.0, 4.0]))
    results = []

    def step() -> None:
        results.append(comm.wait(comm.start("w", op)))

    class Optimizer:  # as hvd_compress.torch's: its step exchanges, zero_grad clears
        def __init__(self) -> None:
            self._pipeline = SimpleNamespace(comm=comm)
            self.calls: list[str] = []

        def zero_grad(self) -> None:
            self.calls.append("zero_grad")

        def step(self) -> None:
            self.calls.append("step")
            step()

    optimizer, seen = Optimizer(), []
    for batch in skip_behind(range(6), optimizer):
        seen.append(batch)
        step()  # the loop's own step, with a gradient
    assert seen == [0, 4, 5]  # the batches of rounds 1, 2 and 3 were dropped
    assert optimizer.calls == ["zero_grad", "step"] * 3  # a step on zeros for each
    assert client.started == [(0, 2, True), (1, 0, False), (2, 0, False), (3, 2, True),
                              (4, 2, True), (5, 2, True)]
    assert comm.skipped_rounds == 2 and comm.behind() == 0
    refused = [None if r.refused is None else r.refused.tolist() for r in results]
    assert refused == [[True, True]] * 3 + [None] * 3  # late or pulled only: all kept

    # compute_open: the same refusal, but the loop computes round 3's gradient itself.
    client = Client()
    comm = ParameterServerCommunicator(SparseOnly(0, 4), client, "s", partial="unscaled")
    optimizer, seen = Optimizer(), []
    step()
    assert comm.behind() == 3 and comm.behind(open_round=False) == 2
    for batch in skip_behind(range(1, 6), optimizer, compute_open=True):
        seen.append(batch)
        step()
    assert seen == [3, 4, 5] and optimizer.calls == ["zero_grad", "step"] * 2
    assert [push for _, _, push in client.started] == [True, False, False, True, True, True]


def test_without_a_quorum_nothing_changes():
    clock = Clock()
    store = ShardStore(3, 0, 1, deadline=10.0, clock=clock)
    service = ShardService(store)
    service.push(push(0, 0, [1], [1.0]), "a")
    service.push(push(1, 0, [1], [1.0]), "b")
    clock.now = 9.0
    store.expire()
    assert store.try_pull(decode_frame(pull(0))) is None  # waits for everyone
    service.push(push(2, 0, [1], [1.0]), "c")
    assert pairs_of(service.pull(pull(0), "a", 0.1)) == ([1], [3.0], SERVER_ID)
    assert store.tensors["w"].history == {}


def test_contributors_survive_the_journal_and_a_late_push_stays_late(tmp_path):
    service, clock = make(workers=3, size=2, grace=1.0, checkpoint_dir=str(tmp_path),
                          checkpoint_every=100)
    service.restore()
    for w in range(3):
        service.push(push(w, 0, [2], [1.0]), "x")  # a full round: no contributors recorded
    service.pull(pull(0), "a", 5.0)
    service.push(push(0, 1, [1], [1.0]), "a")
    service.push(push(2, 1, [1], [2.0]), "c")
    clock.now = 2.0
    answer = service.pull(pull(1), "a", 5.0)  # answered: so it is in the journal
    journal = checkpoint.journal_path(checkpoint.path_for(tmp_path, 0, 1), service.generation)
    changes, _ = checkpoint.read_journal(journal, service.store._config())
    assert [(c.round, c.contributors) for c in changes if c.binding is None] == \
        [(0, None), (1, (0, 2))]
    service.close()
    restored, _ = make(workers=3, size=2, grace=0.0, checkpoint_dir=str(tmp_path))
    restored.restore()
    assert restored.store.rounds() == {"w": 2}
    with pytest.raises(LateRound):
        restored.push(push(1, 1, [1], [5.0]), "b")
    assert restored.pull(pull(1, worker=1), "b", 5.0) == answer


def test_the_snapshot_keeps_the_last_rounds_contributors(tmp_path):
    service, _ = make(workers=3, size=2, grace=0.0, checkpoint_dir=str(tmp_path),
                      checkpoint_every=1)
    service.restore()
    service.push(push(0, 0, [1], [1.0]), "a")
    service.push(push(1, 0, [1], [2.0]), "b")
    answer = service.pull(pull(0), "a", 5.0)
    service.close()
    restored, _ = make(workers=3, size=2, grace=0.0, checkpoint_dir=str(tmp_path))
    restored.restore()
    assert restored.store.tensors["w"].last.contributors == (0, 1)
    with pytest.raises(LateRound):
        restored.push(push(2, 0, [1], [5.0]), "c")
    assert restored.pull(pull(0, worker=2), "c", 5.0) == answer


def test_refused_pairs_are_those_of_the_late_shards_and_stay_out_of_what_was_sent():
    pending = PendingRound("t", 0, [0, 10, 20, 30], [], [], late=[None, "late", None])
    indices = torch.tensor([25, 3, 12, 19, 0])
    assert pending.refused(indices).tolist() == [False, False, True, True, False]
    values = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    total = torch.zeros(30)
    result = PartialSum(total, pending.refused(indices), (3, 2, 3))
    got_total, kept_idx, kept_val = counted_pairs(result, indices, values)
    assert got_total is total
    assert kept_idx.tolist() == [25, 3, 0] and kept_val.tolist() == [1.0, 2.0, 5.0]
    assert counted_pairs(total, indices, values)[1] is indices
    assert PendingRound("t", 0, [0, 5], [], [], late=[None]).refused(indices) is None


@pytest.fixture
def quorum_server():
    """A gRPC server in process for 3 workers, quorum 2, grace 0.15 s."""
    store = ShardStore(3, 0, 1, deadline=30.0, quorum=Quorum(3, 2, 0.15))
    service = ShardService(store)
    server, port = grpc_transport.serve(service, "127.0.0.1:0", 30.0)
    yield store, f"127.0.0.1:{port}"
    server.stop(0)
    service.close()


@pytest.mark.parametrize("partial", ["unscaled", "owed"])
@pytest.mark.parametrize("skip", [False, True], ids=["computing", "skipping"])
def test_topk_workers_with_a_straggler_lose_no_gradient_mass(quorum_server, skip, partial):
    """Every step computes for 0.05 s; worker 2 stalls for 1 s at step 3 while the others
    go on: rounds close without it and its push is refused as late and kept in its
    residual; the refusal names the open round, so it only pulls the rounds before it
    (they are ready, while the others wait out the grace each round) and catches up.
    ``skipping``: its loader goes through skip_behind, so it computes no gradient for
    those rounds nor for the one open then (a step on zeros for each, which pulls the
    closed rounds' aggregates and pushes its residual's pairs to the open one). Every
    worker takes part in every round and applies the same aggregates, and the sum of the
    gradients computed equals the sum of the aggregates applied plus every worker's
    residual, exactly: ``unscaled`` applies the contributors' sums as they are, ``owed``
    scales them by 3/2 and the missing worker's residual gives up the stand-in."""
    store, address = quorum_server
    steps = 24

    def stall(rank: int, step: int) -> None:
        time.sleep(1.0 if rank == 2 and step == 3 else 0.05)

    results = worker.run_in_threads(address, 3, steps, stall, skip, partial)
    assert sorted(results) == [0, 1, 2]
    assert store.partial_rounds >= 2 and store.late_pushes >= 1
    late = results[2]["rounds"]
    assert sum(refused for _, refused in late) > 0  # its pairs were kept, not lost
    assert (3, 0) in late[-5:]  # it caught up and contributed again
    if skip:
        assert results[2]["skipped"] >= 2  # the 1 s stall spans several 0.2 s rounds
    for rank in (0, 1, 2):
        assert len(results[rank]["aggregates"]) == steps  # a round per batch, skipped or not
    for rank in (1, 2):
        assert results[rank]["aggregates"] == results[0]["aggregates"]  # replicas agree
    grads = sum(r["grads"] for r in results.values())
    kept = sum(r["residual"] for r in results.values())
    np.testing.assert_array_equal(results[0]["applied"] + kept, grads)


class _Client:
    worker = 0

    def expect_workers(self, workers: int) -> None:
        pass


@pytest.mark.parametrize("partial", PARTIAL)
def test_each_shards_sum_is_scaled_and_owed_as_partial_says(partial):
    """4 workers; shard 0 (entries 0-3) summed by 3 of them, shard 1 by all. Scaled
    designs multiply shard 0 by 4/3 (the mean over its 3 contributors), ``unscaled``
    leaves it; a full shard is left alone. This worker owes the stand-in (shard 0's sum
    over 3) when ``owed`` and it missed the shard (late or pulled only), and when
    ``refund`` and its push was refused as late, not when it only pulled."""
    op = SparseSum("sparse", 8, torch.tensor([1, 6]), torch.tensor([3.0, 4.0]))
    scaled = partial != "unscaled"
    for late, skipped in ((None, False), ("late", False), (None, True)):
        comm = ParameterServerCommunicator(SparseOnly(0, 4), _Client(), "s", partial=partial)
        pending = PendingRound("t", 0, [0, 4, 8], [], [], late=[late, None], missing=[1, 0])
        result = comm._partial(_ServerRound("t", op, pending, skipped), torch.full((8,), 3.0),
                               torch.arange(8))
        assert isinstance(result, PartialSum) and result.contributors == (3, 4)
        factor = np.float32(4 / 3) if scaled else 1.0
        assert result.total.tolist() == [3.0 * factor] * 4 + [3.0] * 4
        owes = (partial == "owed" and (late or skipped)) or (partial == "refund" and late)
        if owes:
            assert result.owed.tolist() == [1.0] * 4 + [0.0] * 4  # 3.0 over 3 workers
        else:
            assert result.owed is None
    full = PendingRound("t", 0, [0, 4, 8], [], [], late=[None, None], missing=[0, 0])
    total = torch.ones(8)
    assert comm._partial(_ServerRound("t", op, full), total, torch.arange(8)) is total
    with pytest.raises(ValueError, match="partial must be one of unscaled"):
        ParameterServerCommunicator(SparseOnly(0, 4), _Client(), "s", partial="mean")


def test_partial_comes_from_the_environment_when_not_given(monkeypatch):
    """The bindings build the communicator without ``partial``: $HVD_COMPRESS_PS_PARTIAL
    chooses it, the argument overrides it, and a bad value is refused at construction,
    naming the variable."""
    monkeypatch.delenv("HVD_COMPRESS_PS_PARTIAL", raising=False)
    assert ParameterServerCommunicator(SparseOnly(0, 4), _Client(), "s").partial == "owed"
    monkeypatch.setenv("HVD_COMPRESS_PS_PARTIAL", "unscaled")
    assert ParameterServerCommunicator(SparseOnly(0, 4), _Client(), "s").partial == "unscaled"
    assert ParameterServerCommunicator(SparseOnly(0, 4), _Client(), "s",
                                       partial="refund").partial == "refund"
    monkeypatch.setenv("HVD_COMPRESS_PS_PARTIAL", "mean")
    with pytest.raises(ValueError, match=r"\$HVD_COMPRESS_PS_PARTIAL must be one of"):
        ParameterServerCommunicator(SparseOnly(0, 4), _Client(), "s")


def test_what_a_worker_owes_counts_as_sent_so_its_residual_gives_it_up():
    """counted_pairs with ``owed``: the counted pairs plus the owed entries, summed where
    they meet, so error feedback (x - sent) takes the owed mass from the residual."""
    indices, values = torch.tensor([5, 1, 7]), torch.tensor([2.0, 3.0, 4.0])
    owed = torch.tensor([0.0, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0])
    refused = torch.tensor([False, False, True])
    result = PartialSum(torch.zeros(8), refused, (3,), owed)
    _, got_idx, got_val = counted_pairs(result, indices, values)
    assert got_idx.tolist() == [1, 2, 5] and got_val.tolist() == [3.5, 0.25, 2.0]
    x = torch.zeros(8)
    x[indices] = values
    x.index_add_(0, got_idx, got_val, alpha=-1)
    assert x.tolist() == [0.0, -0.5, -0.25, 0.0, 0.0, 0.0, 0.0, 4.0]  # refused 7 kept


class _LoopWorld:
    """Stands in for MPI.COMM_WORLD: server ranks are :class:`ShardService` objects in
    this process, each request answered as ``ps_server.mpi_transport`` answers it."""

    def __init__(self, services: dict[int, ShardService], worker: int) -> None:
        self.services, self.worker = services, worker
        self.replies: dict[int, list[tuple[str, object]]] = {r: [] for r in services}

    def isend(self, message, dest: int, tag: int):
        op, data = message
        service = self.services[dest]
        try:
            if op == "push":
                reply = ("OK", service.push(data, "loop", self.worker))
            else:
                frame = service.decode_pull(data, "loop", self.worker)
                reply = ("OK", service.try_pull(frame, "loop"))
        except RequestError as err:
            reply = (err.code, str(err))
        self.replies[dest].append(reply)
        return SimpleNamespace(wait=lambda: None)

    def Iprobe(self, source: int, tag: int) -> bool:
        return bool(self.replies[source])

    def recv(self, source: int, tag: int):
        return self.replies[source].pop(0)


def test_the_mpi_client_keeps_a_late_shard_and_pulls_its_closed_round():
    """Two shards of 20 elements, 3 workers, quorum 2, grace 0: shard 0 closed round 0
    with workers 0 and 1, shard 1 has worker 0's push only. Worker 2's push is late on
    shard 0 (its pairs there are refused) and closes shard 1 (counted)."""
    services = {10 + s: ShardService(ShardStore(3, s, 2, deadline=10.0,
                                                quorum=Quorum(3, 2, 0.0))) for s in range(2)}
    for w in (0, 1):
        services[10].push(encode_frame(Kind.PUSH, "s/t", 0, 2, 0, w, 10, np.array([1]),
                                       np.array([1.0], np.float32)), "x", w)
    services[11].push(encode_frame(Kind.PUSH, "s/t", 1, 2, 0, 0, 10, np.array([2]),
                                   np.array([5.0], np.float32)), "x", 0)
    client = MPIPSClient.__new__(MPIPSClient)
    ShardedClient.__init__(client, 2, None)
    client.world, client.servers = _LoopWorld(services, 2), [10, 11]
    client.addresses = ["mpi rank 10", "mpi rank 11"]
    pending = client.start("s/t", 0, 20, torch.tensor([3, 12]), torch.tensor([7.0, 9.0]))
    indices, values = client.finish(pending)
    assert pending.late[0] is not None and "is late" in pending.late[0]
    assert pending.late[1] is None and pending.missing == [1, 1]
    assert (indices.tolist(), values.tolist()) == ([1, 12], [2.0, 14.0])
    assert pending.refused(torch.tensor([3, 12])).tolist() == [True, False]


def test_the_stragglers_bench_runs_every_mode(capsys):
    """``python -m hvd_compress.bench.stragglers``: one row per mode, the straggler's
    computed steps never above the rounds, all of them without skipping."""
    from hvd_compress.bench import stragglers

    assert stragglers.main(["--steps", "4", "--compute", "0.01", "--delay", "3",
                            "--every", "2", "--modes", ",".join(stragglers.MODES)]) == 0
    out = capsys.readouterr().out
    rows = {line[:28].strip(): line for line in out.splitlines()}
    assert set(stragglers.MODES.values()) <= set(rows), out
    for label in stragglers.MODES.values():
        computed = int(rows[label].split()[-3].split("/")[0])
        assert computed <= 4 and (computed == 4 or "skipping" in label), out


def test_the_stragglers_bench_names_the_designs_it_takes(capsys):
    """``--designs`` takes the communicator's ``partial`` values, each with ``+open``."""
    from hvd_compress.bench import stragglers

    with pytest.raises(SystemExit):
        stragglers.main(["--task", "digits", "--designs", "unscaled,mean,owed+close"])
    err = capsys.readouterr().err
    assert "--designs takes unscaled, scaled, owed, refund" in err
    assert "got mean, owed+close" in err


def test_a_pull_only_round_sends_no_push_over_mpi():
    """A round the worker skips (``push=False``): the MPI client sends each shard its pull
    only, and gets the round that closed without it."""
    services = {10 + s: ShardService(ShardStore(3, s, 2, deadline=10.0,
                                                quorum=Quorum(3, 2, 0.0))) for s in range(2)}
    for s, w in ((0, 0), (0, 1), (1, 0), (1, 1)):
        services[10 + s].push(encode_frame(Kind.PUSH, "s/t", s, 2, 0, w, 10,
                                           np.array([s + w]), np.array([1.0], np.float32)),
                              "x", w)
    client = MPIPSClient.__new__(MPIPSClient)
    ShardedClient.__init__(client, 2, None)
    world = _LoopWorld(services, 2)
    sent: list[str] = []
    isend = world.isend
    world.isend = lambda message, dest, tag: (sent.append(message[0]), isend(message, dest,
                                                                           tag))[1]
    client.world, client.servers = world, [10, 11]
    client.addresses = ["mpi rank 10", "mpi rank 11"]
    pending = client.start("s/t", 0, 20, torch.tensor([3]), torch.tensor([7.0]), push=False)
    indices, values = client.finish(pending)
    assert sent == ["pull", "pull"] and pending.pull_only and pending.pushes == []
    assert (indices.tolist(), values.tolist()) == ([0, 1, 11, 12], [1.0, 1.0, 1.0, 1.0])
    assert pending.missing == [1, 1]
    assert all(service.store.late_pushes == 0 for service in services.values())
