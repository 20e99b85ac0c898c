"""The parameter server's round state machine, shard store and checkpoints, in-process."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server import checkpoint
from ps_server.service import ACCEPTED, DUPLICATE, ShardService
from ps_server.store import (
    ConflictingPush,
    FutureRound,
    OverBudget,
    RequestError,
    RoundFailed,
    ShardStore,
    StaleRound,
    UnknownTensor,
)

NUMEL = 2000

pytestmark = pytest.mark.usefixtures("sparse_path")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def push(worker: int, round: int, idx, val, tensor: str = "w", dtype: str = "fp32",
         numel: int = NUMEL) -> bytes:
    return encode_frame(Kind.PUSH, tensor, 0, 1, round, worker, numel, np.asarray(idx),
                        np.asarray(val, np.float32), dtype)


def pull(round: int, worker: int = 0, tensor: str = "w", dtype: str = "fp32") -> bytes:
    return encode_frame(Kind.PULL, tensor, 0, 1, round, worker, NUMEL, dtype=dtype)


def random_pushes(workers: int, seed: int, k: int = 300):
    rng = np.random.default_rng(seed)
    pushes = []
    for _ in range(workers):
        idx = np.sort(rng.choice(NUMEL // 2, k, replace=False))  # overlapping supports
        pushes.append((idx, rng.standard_normal(k).astype(np.float32)))
    return pushes


def make(workers: int = 3, mode: str = "union", deadline: float = 10.0, **kw):
    clock = Clock()
    store = ShardStore(workers, 0, 1, mode, deadline, clock=clock)
    return ShardService(store, **kw), clock


def dense(frame_bytes: bytes) -> np.ndarray:
    frame = decode_frame(frame_bytes)
    out = np.zeros(frame.numel, np.float32)
    out[frame.indices] = frame.values
    return out


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_union_is_exact_sum_of_decoded_pushes(dtype):
    service, _ = make()
    pushes = random_pushes(3, seed=0)
    expected = np.zeros(NUMEL, np.float32)
    support = np.zeros(NUMEL, bool)
    for w, (idx, val) in enumerate(pushes):
        data = push(w, 0, idx, val, dtype=dtype)
        decoded = decode_frame(data)
        expected[decoded.indices] += decoded.values.astype(np.float32)
        support[decoded.indices] = True
        assert service.push(data, "test") == ACCEPTED
        if w < 2:
            assert service.store.try_pull(decode_frame(pull(0))) is None  # open till all push
    result = decode_frame(service.pull(pull(0), "test", timeout=1.0))
    np.testing.assert_array_equal(result.indices, np.flatnonzero(support))
    np.testing.assert_allclose(dense(service.pull(pull(0), "t", 1.0)), expected, rtol=1e-6)
    np.testing.assert_array_equal(dense(service.pull(pull(0, dtype="fp32"), "t", 1.0)),
                                  expected)


def test_round_sum_spans_blocks_and_does_not_depend_on_arrival_order():
    """A shard far larger than the merge's block, supports clustered at block edges and
    spread thinly elsewhere (most blocks empty), 5 workers pushing in two orders: both
    aggregates are byte-identical and equal the float32 sum taken in worker order."""
    numel, workers = 3_000_000, 5
    rng = np.random.default_rng(7)
    edges = np.array([0, 8191, 8192, 16383, 16384, numel - 1])
    pushes = [np.unique(np.concatenate([rng.choice(numel, 3000, replace=False), edges]))
              for _ in range(workers)]
    scales = [10.0 ** rng.integers(-3, 4, i.size) for i in pushes]  # rounding shows order
    values = [(rng.standard_normal(i.size) * s).astype(np.float32)
              for i, s in zip(pushes, scales, strict=True)]
    expected = np.zeros(numel, np.float32)
    for idx, val in zip(pushes, values, strict=True):
        expected[idx] += val
    aggregates = []
    for order in (range(workers), [3, 0, 4, 2, 1]):
        service, _ = make(workers=workers)
        for w in order:
            service.push(encode_frame(Kind.PUSH, "w", 0, 1, 0, w, numel, pushes[w], values[w]),
                         "t")
        aggregates.append(service.pull(encode_frame(Kind.PULL, "w", 0, 1, 0, 0, numel), "t",
                                       1.0))
    assert aggregates[0] == aggregates[1]
    result = decode_frame(aggregates[0])
    np.testing.assert_array_equal(result.indices, np.unique(np.concatenate(pushes)))
    np.testing.assert_array_equal(result.values, expected[result.indices])


def test_topk_mode_keeps_a_server_residual():
    service, _ = make(workers=2, mode="topk")
    residual = np.zeros(NUMEL, np.float32)
    for r in range(3):
        pushes = random_pushes(2, seed=r, k=50)
        total = residual.copy()
        for w, (idx, val) in enumerate(pushes):
            service.push(push(w, r, idx, val), "t")
            total[idx] += val
        result = decode_frame(service.pull(pull(r), "t", 1.0))
        assert result.count == 50  # k = the most pairs any worker pushed
        top = np.sort(np.argsort(-np.abs(total), kind="stable")[:50])
        np.testing.assert_array_equal(result.indices, top)
        np.testing.assert_allclose(result.values, total[top], rtol=1e-6)
        residual = total.copy()
        residual[top] = 0
        np.testing.assert_allclose(service.store.tensors["w"].residual, residual, rtol=1e-6)


def test_retransmission_is_ignored_and_rounds_are_checked():
    service, _ = make(workers=2)
    assert service.push(push(0, 4, [1, 2], [1.0, 2.0]), "t") == ACCEPTED
    assert service.push(push(0, 4, [1, 2], [1.0, 2.0]), "t") == DUPLICATE
    with pytest.raises(FutureRound, match="ahead of the server, which is at round 4"):
        service.push(push(1, 5, [1], [1.0]), "t")
    with pytest.raises(StaleRound, match="stale: the server is at round 4"):
        service.push(push(1, 3, [1], [1.0]), "t")
    assert service.push(push(1, 4, [2], [1.0]), "t") == ACCEPTED
    np.testing.assert_array_equal(dense(service.pull(pull(4), "t", 1.0))[:3], [0, 1, 3])
    assert service.push(push(1, 4, [2], [1.0]), "t") == DUPLICATE  # a retry after close
    with pytest.raises(StaleRound):
        service.pull(pull(3), "t", 1.0)
    with pytest.raises(FutureRound):
        service.pull(pull(6), "t", 1.0)
    with pytest.raises(UnknownTensor, match="no worker has pushed"):
        service.pull(pull(0, tensor="other"), "t", 1.0)
    assert service.metrics.value("hvd_ps_requests_total", method="push",
                                 outcome="duplicate") == 2


def test_missing_worker_fails_the_round_by_name_and_the_next_round_works():
    service, clock = make(workers=3, deadline=5.0)
    service.push(push(0, 0, [1], [1.0]), "t")
    service.push(push(2, 0, [1], [1.0]), "t")
    clock.now = 5.5
    with pytest.raises(RoundFailed, match=r"worker 1 did not push within the 5 s deadline"):
        service.pull(pull(0), "t", timeout=1.0)
    with pytest.raises(RoundFailed, match="worker 1 did not push"):
        service.push(push(1, 0, [1], [1.0]), "t")  # the late worker learns why
    for w in range(3):
        service.push(push(w, 1, [7], [2.0]), "t")
    assert dense(service.pull(pull(1), "t", 1.0))[7] == 6.0
    assert service.metrics.value("hvd_ps_rounds_failed_total") == 1


@pytest.mark.parametrize("bad", [
    lambda f: f[:-3],
    lambda f: f[:-1] + bytes([f[-1] ^ 0xFF]),
    lambda f: push(0, 0, [1], [1.0], numel=NUMEL + 1),  # size differs from registration
    lambda f: encode_frame(Kind.PUSH, "w", 0, 2, 0, 0, NUMEL, [1], [1.0]),  # wrong shard
    lambda f: encode_frame(Kind.PUSH, "w", 0, 1, 0, 9, NUMEL, [1], [1.0]),  # unknown worker
    lambda f: encode_frame(Kind.PULL, "w", 0, 1, 0, 0, NUMEL),  # pull sent as push
    lambda f: encode_frame(Kind.PUSH, "w", 0, 1, 0, 0, 1 << 30),  # absurd size
], ids=["truncated", "crc", "numel", "shard", "worker", "kind", "absurd"])
def test_malformed_push_is_rejected_and_changes_nothing(bad):
    service, _ = make(workers=2)
    service.store.max_numel = 1 << 20
    service.push(push(0, 0, [1, 3], [1.0, 1.0]), "t")
    before = service.store.snapshot()
    with pytest.raises(RequestError):
        service.push(bad(push(1, 0, [3], [1.0])), "t")
    assert service.store.snapshot()["tensors"]["w"]["round"] == before["tensors"]["w"]["round"]
    assert list(service.store.tensors["w"].pushed) == [0]
    service.push(push(1, 0, [3], [1.0]), "t")
    np.testing.assert_array_equal(dense(service.pull(pull(0), "t", 1.0))[[1, 3]], [1, 2])


def test_a_different_second_push_fails_the_round_for_both_senders():
    service, _ = make(workers=2)
    service.push(push(0, 0, [1], [1.0]), "peer-a")
    with pytest.raises(ConflictingPush, match=r"worker 0 pushed twice with different content "
                       r"\(first from peer-a, then from peer-b\)"):
        service.push(push(0, 0, [1], [9.0]), "peer-b")
    with pytest.raises(RoundFailed, match="worker 0 pushed twice"):  # the first sender too
        service.pull(pull(0), "peer-a", 1.0)
    assert service.metrics.value("hvd_ps_rounds_failed_total") == 1
    for w in range(2):  # the next round is clean
        service.push(push(w, 1, [1], [1.0]), "t")
    assert dense(service.pull(pull(1), "t", 1.0))[1] == 2.0
    # After the close, an identical retransmission is a no-op, a different one an error.
    assert service.push(push(1, 1, [1], [1.0]), "t") == DUPLICATE
    with pytest.raises(ConflictingPush, match="already closed with the first content"):
        service.push(push(1, 1, [1], [2.0]), "t")


def test_checkpoint_roundtrip_resumes_rounds_residuals_and_last_aggregate(tmp_path):
    service, _ = make(workers=2, mode="topk", checkpoint_dir=str(tmp_path))
    service.restore()
    for w in range(2):
        service.push(push(w, 0, [1, 2, 3], [1.0, -2.0, 0.5 * w]), "t")
    first = service.pull(pull(0), "t", 1.0)
    path = checkpoint.path_for(tmp_path, 0, 1)
    assert path.exists()
    restored, _ = make(workers=2, mode="topk", checkpoint_dir=str(tmp_path))
    restored.restore()
    assert restored.pull(pull(0), "t", 1.0) == first
    np.testing.assert_array_equal(restored.store.tensors["w"].residual,
                                  service.store.tensors["w"].residual)
    assert restored.push(push(0, 0, [1, 2, 3], [1.0, -2.0, 0.0]), "t") == DUPLICATE
    for w in range(2):
        restored.push(push(w, 1, [1], [1.0]), "t")
    assert decode_frame(restored.pull(pull(1), "t", 1.0)).round == 1
    other, _ = make(workers=3, mode="topk", checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match="matching configuration"):
        other.restore()


@pytest.mark.parametrize("mode", ["union", "topk"])
def test_journal_replays_every_answered_round_exactly(tmp_path, mode):
    """Between snapshots every round goes to the journal before it is answered; a restore
    (snapshot + journal replay) gives the same rounds, aggregates and residuals."""
    service, _ = make(workers=2, mode=mode, checkpoint_dir=str(tmp_path), checkpoint_every=7)
    service.restore()
    answers = {}
    for r in range(10):
        for name in ("a", "b"):
            for w, (idx, val) in enumerate(random_pushes(2, 100 * r + len(name), k=50)):
                service.push(push(w, r, idx, val, tensor=name), "t")
            answers[name, r] = service.pull(pull(r, tensor=name), "t", 5.0)
    assert service.snapshots >= 2 and service.journaled > 0  # a snapshot, then a journal
    journal = checkpoint.journal_path(checkpoint.path_for(tmp_path, 0, 1), service.generation)
    assert journal.stat().st_size > 0
    restored, _ = make(workers=2, mode=mode, checkpoint_dir=str(tmp_path), checkpoint_every=7)
    restored.restore()
    assert restored.store.rounds() == {"a": 10, "b": 10}
    for name in ("a", "b"):
        assert restored.pull(pull(9, tensor=name), "t", 5.0) == answers[name, 9]
        if mode == "topk":
            np.testing.assert_array_equal(restored.store.tensors[name].residual,
                                          service.store.tensors[name].residual)
    with pytest.raises(FutureRound):  # no worker can be ahead of what was answered
        restored.push(push(0, 11, [1], [1.0], tensor="a"), "t")


def test_a_torn_journal_write_is_ignored_and_its_round_reopens(tmp_path):
    service, _ = make(workers=1, checkpoint_dir=str(tmp_path))
    service.restore()
    for r in range(3):
        service.push(push(0, r, [1], [float(r)]), "t")
        service.pull(pull(r), "t", 5.0)
    journal = checkpoint.journal_path(checkpoint.path_for(tmp_path, 0, 1), service.generation)
    journal.write_bytes(journal.read_bytes()[:-5])  # the last write cut short
    restored, _ = make(workers=1, checkpoint_dir=str(tmp_path))
    restored.restore()
    assert restored.store.rounds() == {"w": 2}
    restored.push(push(0, 2, [1], [7.0]), "t")
    assert dense(restored.pull(pull(2), "t", 5.0))[1] == 7.0


def test_idle_tensors_expire_and_are_freed(caplog):
    clock = Clock()
    store = ShardStore(1, 0, 1, "topk", deadline=5.0, clock=clock, idle_timeout=60.0)
    service = ShardService(store)
    for name in ("s1/a", "s1/b", "s2/a"):
        service.push(push(0, 0, [1], [1.0], tensor=name), "t")
    clock.now = 30.0
    service.push(push(0, 1, [1], [1.0], tensor="s2/a"), "t")
    held = store.held_bytes()
    assert held >= 3 * NUMEL * 4  # three dense residuals
    clock.now = 61.0
    with caplog.at_level("INFO", "ps_server"):
        service.tick()
    assert sorted(store.tensors) == ["s2/a"]
    assert "session 's1' expired after 60 s idle: freed 2 tensors" in caplog.text
    assert store.held_bytes() < held / 2


def test_a_journal_write_holds_only_the_rounds_that_finished(tmp_path):
    """One round of one tensor costs the same record with 1 or 300 tensors registered."""
    sizes = []
    for tensors in (1, 300):
        service, _ = make(workers=1, mode="topk", checkpoint_dir=str(tmp_path / str(tensors)))
        service.restore()
        for t in range(tensors):
            service.push(push(0, 0, [1, 2], [1.0, 2.0], tensor=f"t{t}"), "t")
            service.pull(pull(0, tensor=f"t{t}"), "t", 5.0)
        before = service.journal_bytes
        service.push(push(0, 1, [3], [1.0], tensor="t0"), "t")
        service.pull(pull(1, tensor="t0"), "t", 5.0)
        sizes.append(service.journal_bytes - before)
        service.close()
    assert sizes[0] == sizes[1] < 200, sizes


def test_a_stopped_server_reads_waiting_pushes_before_failing_the_round():
    """A gap longer than freeze_gap between checks (SIGSTOP) moves deadlines: the push
    that waited in the socket closes the round; without a gap the deadline still holds."""
    service, clock = make(workers=2, deadline=10.0)
    service.store.freeze_gap = 2.0
    service.push(push(0, 0, [1], [1.0]), "t")
    clock.now = 1.0
    service.tick()
    clock.now = 200.0  # stopped for 199 s, far past the deadline
    service.push(push(1, 0, [1], [2.0]), "t")
    assert dense(service.pull(pull(0), "t", 1.0))[1] == 3.0
    service.push(push(0, 1, [1], [1.0]), "t")
    for step in range(1, 12):  # ticks every second: the deadline passes normally
        clock.now = 200.0 + step
        service.tick()
    with pytest.raises(RoundFailed, match="worker 1 did not push within the 10 s deadline"):
        service.pull(pull(1), "t", 1.0)


def test_a_pull_carrying_pairs_is_refused():
    service, _ = make(workers=1)
    service.push(push(0, 0, [1], [1.0]), "t")
    carrying = encode_frame(Kind.PULL, "w", 0, 1, 0, 0, NUMEL, np.array([5]),
                            np.array([9.0], np.float32))
    with pytest.raises(RequestError, match="a pull carries no pairs, this one has 1"):
        service.pull(carrying, "t", 1.0)
    assert dense(service.pull(pull(0), "t", 1.0))[1] == 1.0


def test_pushes_beyond_the_memory_budget_are_refused_before_being_held():
    """Budget 30 KB: each push of 1,000 pairs holds 12 KB decoded (int64 + float32)."""
    store = ShardStore(3, 0, 1, push_budget=30_000)
    service = ShardService(store)
    idx, val = np.arange(1000), np.ones(1000, np.float32)
    for w in range(2):
        service.push(push(w, 0, idx, val, tensor="a"), "t")
    assert store.pending_bytes == 24_000
    with pytest.raises(OverBudget, match=r"over the server's budget of 0.0 MB"):
        service.push(push(0, 0, idx, val, tensor="b"), "t")
    assert "b" not in store.tensors or not store.tensors["b"].pushed
    service.push(push(2, 0, idx, val, tensor="a"), "t")  # closes round 0 of "a"
    assert store.pending_bytes == 0
    service.push(push(0, 0, idx, val, tensor="b"), "t")  # room again


def test_a_worker_id_pushing_from_another_host_is_logged(caplog):
    service, _ = make(workers=1)
    with caplog.at_level("WARNING", "ps_server"):
        service.push(push(0, 0, [1], [1.0], tensor="s/a"), "ipv4:10.0.0.1:5000")
        service.push(push(0, 1, [1], [1.0], tensor="s/a"), "ipv4:10.0.0.1:5001")  # reconnect
        assert not caplog.records
        service.push(push(0, 0, [1], [1.0], tensor="s/b"), "ipv4:10.0.0.2:6000")
    assert "worker 0 of session 's' pushed from ipv4:10.0.0.2:6000, but its first pushes " \
        "came from ipv4:10.0.0.1" in caplog.text
