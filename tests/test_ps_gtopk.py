"""The server's ``--mode gtopk`` (global top-k with the residual on the workers): the
aggregate is the ``k`` largest entries of the exact union sum, answered as a
``Kind.SELECTED`` frame, and each worker keeps the pairs it pushed outside it; over a real
gRPC server the sum of every aggregate applied plus every worker's residual equals the sum
of all gradients exactly, and a pull carries one push's pairs whatever the workers."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
import torch

import hvd_compress.native as native
from hvd_compress.comm.ps_transport.base import PendingRound
from hvd_compress.schemes.topk import sparse_count
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server import grpc_transport
from ps_server.rounds import aggregate, close_pushes, new_state
from ps_server.service import ShardService
from ps_server.store import Quorum, ShardStore
from tests.test_ps_native_round import serve_rounds
from tests.workers import quorum as worker

ROUTES = ["native", "numpy"]


def route(name: str) -> contextlib.AbstractContextManager:
    """The route ``name`` runs on: the numpy one with the library disabled; the native one
    as it is, skipped where the library was not built."""
    if name == "native" and not native.available():
        pytest.skip("native library unavailable")
    return native.disabled() if name == "numpy" else contextlib.nullcontext()


def push(worker_id: int, round: int, idx, val, numel: int) -> bytes:
    return encode_frame(Kind.PUSH, "w", 0, 1, round, worker_id, numel,
                        np.asarray(idx, np.int64), np.asarray(val, np.float32))


def brute_force(pushes: list[tuple[np.ndarray, np.ndarray]], numel: int, k: int):
    """The k largest |sum| over the union, of equal ones the lowest indices, by sorting."""
    total = np.zeros(numel, np.float32)
    for idx, val in pushes:
        total[idx] += val
    union = np.unique(np.concatenate([idx for idx, _ in pushes]))
    order = sorted(union, key=lambda i: (-abs(float(total[i])), i))[:k]
    chosen = np.sort(np.asarray(order, np.int64))
    return chosen, total[chosen]


@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("workers", [1, 3, 8])
def test_the_aggregate_is_the_k_largest_of_the_union_sum(name, workers):
    rng = np.random.default_rng(workers)
    numel, k = 5000, 120
    # integer values: many equal magnitudes, so the ties' order matters
    pushes = [(np.sort(rng.choice(numel, k, replace=False)).astype(np.int64),
               rng.integers(-6, 7, k).astype(np.float32)) for _ in range(workers)]
    frames = [decode_frame(push(w, 0, i, v, numel)) for w, (i, v) in enumerate(pushes)]
    with route(name):
        state = new_state("gtopk", numel, 0, 0.0)
        (u_idx, _), (idx, val) = close_pushes("gtopk", state, frames, k)
    assert state.residual is None  # nothing kept on the server
    want_idx, want_val = brute_force(pushes, numel, min(k, u_idx.size))
    np.testing.assert_array_equal(idx, want_idx)
    np.testing.assert_array_equal(val, want_val)


def largest_by_sorting(idx: np.ndarray, val: np.ndarray, k: int):
    order = np.lexsort((idx, -np.abs(val)))[:k]  # by |value| down, then index up
    chosen = np.sort(order)
    return idx[chosen], val[chosen]


@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("case", ["random", "integers", "misleading-sample", "one-winner"])
def test_large_sums_select_exactly_whatever_the_sample_guesses(name, case):
    """Sums large enough that the native selection guesses the k-th from a sample and keeps
    candidates: integer values (ties at the k-th), a sample that sees only the largest
    values (its guess lets fewer than k through: every pair becomes a candidate), and
    k = 1."""
    rng = np.random.default_rng(len(case))
    n, k = 60_000, 7_000
    idx = np.sort(rng.choice(10 * n, n, replace=False)).astype(np.int64)
    val = rng.standard_normal(n).astype(np.float32)
    if case == "integers":
        val = rng.integers(-20, 21, n).astype(np.float32)
    elif case == "misleading-sample":  # the sampled positions c * n // 2048 hold 100s
        val = np.ones(n, np.float32)
        val[np.arange(2048) * n // 2048] = 100.0
    elif case == "one-winner":
        k = 1
    with route(name):
        got = aggregate("gtopk", new_state("gtopk", 10 * n, 0, 0.0), idx, val, k)
    want = largest_by_sorting(idx, val, k)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("name", ROUTES)
def test_fewer_pairs_than_k_and_a_non_finite_sum_give_the_whole_union(name):
    idx = np.array([3, 7, 9], np.int64)
    with route(name):
        state = new_state("gtopk", 10, 0, 0.0)
        got = aggregate("gtopk", state, idx, np.array([1, -2, 0], np.float32), 5)
        np.testing.assert_array_equal(got[0], idx)
        bad = aggregate("gtopk", state, idx, np.array([1, np.nan, 5], np.float32), 1)
        np.testing.assert_array_equal(bad[0], idx)  # whole: the workers see the NaN
        assert np.isnan(bad[1][1])
        assert aggregate("gtopk", state, idx, np.ones(3, np.float32), 0)[0].size == 0
        many = np.arange(50_007, dtype=np.int64)  # large enough to guess from a sample
        for at in (0, 24_000, many.size - 1):  # in a 16-wide block, and past the last one
            values = np.ones(many.size, np.float32)
            values[at] = -np.inf
            assert aggregate("gtopk", state, many, values, 10)[0].size == many.size


def test_the_server_answers_a_selected_frame_of_k_pairs():
    service = ShardService(ShardStore(2, 0, 1, "gtopk"))
    numel = 100
    service.push(push(0, 0, [1, 5, 9], [4.0, -1.0, 0.5], numel), "a")
    service.push(push(1, 0, [2, 5, 8], [-3.0, 3.0, 0.25], numel), "b")
    reply = decode_frame(service.pull(encode_frame(Kind.PULL, "w", 0, 1, 0, 0, numel),
                                      "a", 5.0))
    assert reply.kind is Kind.SELECTED
    np.testing.assert_array_equal(reply.indices, [1, 2, 5])  # |4|, |-3|, |2|
    np.testing.assert_array_equal(reply.values, [4.0, -3.0, 2.0])


def test_the_unselected_pairs_are_those_outside_a_selected_shards_aggregate():
    pending = PendingRound("t", 0, [0, 10, 20], [], [], late=[None, None],
                           selected=[True, False])
    pushed = torch.tensor([15, 2, 4, 11, 7])
    summed = torch.tensor([4, 12, 13])  # shard 0 chose 4; shard 1 summed its union
    mask = pending.unselected(pushed, summed)
    assert mask.tolist() == [False, True, False, False, True]
    pending.selected = [False, False]
    assert pending.unselected(pushed, summed) is None


@pytest.fixture(params=[None, Quorum(3, 2, 0.15)], ids=["full", "quorum"])
def gtopk_server(request):
    """A gRPC server in process for 3 workers, every round full or closed by a quorum of 2
    after 0.15 s."""
    store = ShardStore(3, 0, 1, "gtopk", deadline=30.0, quorum=request.param)
    service = ShardService(store)
    server, port = grpc_transport.serve(service, "127.0.0.1:0", 30.0)
    yield store, f"127.0.0.1:{port}"
    server.stop(0)
    service.close()


def test_topk_workers_through_a_gtopk_server_lose_no_gradient_mass(gtopk_server):
    """Three top-k workers (integer gradients, 5% of 4096 entries each) for 12 rounds: each
    round's aggregate holds at most one push's count of pairs, so pairs are left out;
    those stay in their workers' residuals. With a quorum, worker 2 stalls for 1 s once:
    rounds close without it and its late push stays in its residual too (the default
    ``owed``: the aggregate scaled, the stand-in owed). Every worker applies the same
    aggregates, and the gradients' sum equals the applied sums plus every residual,
    exactly."""
    store, address = gtopk_server
    steps = 12

    def stall(rank: int, step: int) -> None:  # with a quorum, rank 2 is late at step 3
        time.sleep(1.0 if store.quorum.partial and rank == 2 and step == 3 else 0.05)

    results = worker.run_in_threads(address, 3, steps, stall)
    assert sorted(results) == [0, 1, 2]
    assert store.closed_rounds == steps
    assert (store.late_pushes >= 1) == store.quorum.partial
    k = sparse_count(worker.RATIO, int(np.prod(worker.SHAPE)))  # a push's pairs
    for rank in (0, 1, 2):
        assert len(results[rank]["aggregates"]) == steps
        assert sum(left for _, left in results[rank]["rounds"]) > 0  # some pairs kept
    for rank in (1, 2):
        assert results[rank]["aggregates"] == results[0]["aggregates"]  # replicas agree
    for agg in results[0]["aggregates"]:
        assert np.count_nonzero(np.frombuffer(agg, np.float32)) <= k
    grads = sum(r["grads"] for r in results.values())
    kept = sum(r["residual"] for r in results.values())
    np.testing.assert_array_equal(results[0]["applied"] + kept, grads)


def test_a_restart_answers_the_rounds_as_a_server_that_never_stopped(tmp_path):
    """A gtopk server keeps no state between rounds: one restarted from the checkpoint
    and journal of one that stopped after 5 rounds answers the last of them and the next
    ones byte for byte as a server that never stopped."""
    numel, rng = 30000, np.random.default_rng(4)
    rounds = [[push(w, r, np.sort(rng.choice(numel, 900, replace=False)),
                    rng.standard_normal(900), numel) for w in range(2)] for r in range(8)]

    def serve(service: ShardService, which: range) -> list[bytes]:
        return serve_rounds(service, rounds, which, numel)

    expected = serve(ShardService(ShardStore(2, 0, 1, "gtopk")), range(8))
    stopped = ShardService(ShardStore(2, 0, 1, "gtopk"), checkpoint_dir=str(tmp_path),
                           checkpoint_every=3)
    stopped.restore()
    assert serve(stopped, range(5)) == expected[:5]
    assert stopped.snapshots >= 1 and stopped.journaled > 0  # rounds to replay
    restarted = ShardService(ShardStore(2, 0, 1, "gtopk"), checkpoint_dir=str(tmp_path),
                             checkpoint_every=3)
    restarted.restore()
    assert restarted.store.rounds() == {"w": 5}
    assert restarted.store.tensors["w"].residual is None
    last = restarted.pull(encode_frame(Kind.PULL, "w", 0, 1, 4, 0, numel), "t", 5.0)
    assert last == expected[4]
    assert serve(restarted, range(5, 8)) == expected[5:]
