"""Cross-rank sums give the same bits on every rank, at any rank count and on any device.

A sparse sum is defined in rank order (:func:`hvd_compress.comm.ops.sum_pairs`): entry
``i`` is ``((0 + v_0) + v_1) + ...`` over the ranks that sent ``i``, each addition rounded to
float32. The launches run 3 and 4 ranks (at 2 ranks ``a + b == b + a`` hides any order),
with indices shared between ranks and values of very different magnitude, so a sum in any
other order gives other bits (checked: the reverse order differs somewhere). The same
launches check every other scheme's aggregates for the same bits on every rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_compress.comm.ops import SparseSum, sorted_pairs, sum_pairs, wire_dtype
from hvd_compress.comm.sparse_frames import encode_sparse_frame, sum_frames
from hvd_compress.comm.staging import pairs_to_device, pairs_to_host
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.sparse_wire import ValueDType
from tests.harness import run_ranks

SPARSE_SPECS = ["topk:ratio=0.01", "topk:ratio=0.01,values=fp16", "threshold:tau=1.0",
                "dgc:ratio=0.01,momentum=0.9"]
"""Every scheme whose pairs go through a sparse sum (all-gather route without a server)."""

DENSE_SPECS = ["none", "fp16", "bf16", "onebit:bucket_size=64", "qsgd:bits=4", "terngrad",
               "powersgd:rank=2,start_iter=0", "powersgd:rank=2,start_iter=0,alternate=True",
               "randomk:ratio=0.1", "vote"]
"""Every other scheme: all-reduce or compressed all-reduce routes."""

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 tensor's bit patterns, so that -0.0 and 0.0 (and NaNs) are told apart."""
    return t.detach().to(torch.float32).contiguous().view(torch.int32).cpu()


def rank_order_sum(numel: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The defined order, written out densely: 0, then each rank's values added in turn
    (``x + 0 == x`` exactly, so the entries a rank did not send change nothing)."""
    total = torch.zeros(numel, dtype=torch.float32)
    for indices, values in pairs:
        dense = torch.zeros(numel, dtype=torch.float32)
        dense[indices.long().cpu()] = values.float().cpu()
        total = total + dense
    return total


def overlapping(ranks: int, numel: int = 4096, seed: int = 0
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank's unique indices, half of them shared by every rank, with values of
    magnitude 1 and 3e4 of either sign by rank, which partly cancel (the sum's bits depend
    on the order)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randperm(numel, generator=gen)[:numel // 8]
    parts = []
    for rank in range(ranks):
        own = torch.randperm(numel, generator=gen)[:numel // 8]
        indices = torch.unique(torch.cat([shared, own]))
        values = torch.randn(indices.numel(), generator=gen) * (1.0, 3e4, -3e4, 0.7)[rank % 4]
        parts.append((indices[torch.randperm(indices.numel(), generator=gen)], values))
    return parts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ranks", [3, 4, 7])
def test_sum_pairs_adds_in_the_order_given_bit_for_bit(ranks: int, device: str) -> None:
    parts = overlapping(ranks)
    on = [(i.to(device), v.to(device)) for i, v in parts]
    total = sum_pairs(4096, on, torch.device(device))
    assert total.device.type == device
    assert torch.equal(bits(total), bits(rank_order_sum(4096, parts)))
    reverse = rank_order_sum(4096, parts[::-1])
    assert not torch.equal(bits(total), bits(reverse))  # the order matters for these values


@pytest.mark.parametrize("device", DEVICES)
def test_frames_sum_in_worker_order_whatever_order_they_arrive_in(device: str) -> None:
    parts = overlapping(4, seed=1)
    ops = [SparseSum("sparse", 4096, i.to(device), v.to(device)) for i, v in parts]
    frames = [np.frombuffer(encode_sparse_frame("t", r, op), dtype=np.uint8)
              for r, op in enumerate(ops)]
    expected = bits(rank_order_sum(4096, parts))
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        total = sum_frames(ops[0], np.concatenate([frames[r] for r in order]))
        assert total.device.type == device
        assert torch.equal(bits(total), expected)


def test_thread_group_sums_in_rank_order() -> None:
    import threading

    parts = overlapping(3, seed=2)
    group = ThreadGroup(3)
    results: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        comm = group.communicator(rank)
        results[rank] = comm.wait(comm.start("t", SparseSum("sparse", 4096, *parts[rank])))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = bits(rank_order_sum(4096, parts))
    for rank in range(3):
        assert torch.equal(bits(results[rank]), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pairs_reach_the_host_once_and_come_back_unchanged(device: str,
                                                          dtype: torch.dtype) -> None:
    indices = torch.tensor([5, 2, 9, 0], device=device)
    values = torch.tensor([1.5, -2.25, 3.0, 0.125], device=device).to(dtype)
    op = SparseSum("sparse", 10, indices, values)
    idx, val = op.host
    assert idx.dtype == np.int64 and val.dtype == op.value_dtype.numpy
    assert op.value_dtype == (ValueDType.FP16 if dtype == torch.float16 else ValueDType.FP32)
    assert idx.tolist() == [5, 2, 9, 0]
    assert val.astype(np.float32).tolist() == [1.5, -2.25, 3.0, 0.125]
    assert wire_dtype(val) == op.value_dtype
    s_idx, s_val = sorted_pairs(10, *op.host, "t")
    assert s_idx.tolist() == [0, 2, 5, 9]
    assert s_val.astype(np.float32).tolist() == [0.125, -2.25, 1.5, 3.0]
    [(i, v), (j, w)] = pairs_to_device([(s_idx, s_val), (s_idx[:1], s_val[:1])],
                                       torch.device(device))
    assert i.device.type == device and i.dtype == torch.int64 and v.dtype == torch.float32
    assert i.tolist() == [0, 2, 5, 9] and v.tolist() == [0.125, -2.25, 1.5, 3.0]
    assert j.tolist() == [0] and w.tolist() == [0.125]


def test_host_copies_of_device_pairs_are_the_callers_own() -> None:
    """Arrays that came through the reused staging buffer do not change when the next
    transfer reuses it (checked on the CPU path too, where nothing is staged)."""
    device = DEVICES[-1]
    first = pairs_to_host(torch.arange(4, device=device), torch.ones(4, device=device),
                          torch.float32)
    pairs_to_host(torch.arange(100, 104, device=device), torch.zeros(4, device=device),
                  torch.float32)
    assert first[0].tolist() == [0, 1, 2, 3] and first[1].tolist() == [1.0] * 4


def _check_launch(ranks: list[dict]) -> None:
    sensitive = 0
    for spec in SPARSE_SPECS:
        for step, row in enumerate(ranks[0][spec]):
            for name, mine in row.items():
                where = f"{spec} step {step} tensor {name}"
                numel = mine["aggregate"].numel()
                pairs = [(r[spec][step][name]["indices"], r[spec][step][name]["values"])
                         for r in ranks]
                shared = set.intersection(*(set(i.tolist()) for i, _ in pairs))
                assert shared, f"{where}: the ranks sent no index in common"
                expected = bits(rank_order_sum(numel, pairs))
                for rank, result in enumerate(ranks):
                    got = bits(result[spec][step][name]["aggregate"].reshape(-1))
                    assert torch.equal(got, bits(mine["aggregate"].reshape(-1))), \
                        f"{where}: rank {rank}'s replica differs from rank 0's"
                    assert torch.equal(got, expected), \
                        f"{where}: rank {rank}'s aggregate is not the rank-order float32 sum"
                sensitive += not torch.equal(expected, bits(rank_order_sum(numel,
                                                                           pairs[::-1])))
    assert sensitive, "no sum depended on the order: the test would not catch a wrong one"


@pytest.mark.multiprocess
@pytest.mark.parametrize("np_", [3, 4])
def test_replicas_are_bit_identical_on_every_rank(np_: int) -> None:
    """Sparse sums as defined (above), and every other scheme's aggregates the same bits on
    every rank."""
    ranks = run_ranks("tests.workers.determinism:replicas", np=np_, timeout=400,
                      sparse=SPARSE_SPECS, dense=DENSE_SPECS)
    _check_launch(ranks)
    for spec in DENSE_SPECS:
        for step, mine in enumerate(ranks[0][spec]):
            for rank, result in enumerate(ranks[1:], 1):
                for name, aggregate in mine.items():
                    assert torch.equal(bits(result[spec][step][name]), bits(aggregate)), \
                        f"{spec} step {step} tensor {name}: rank {rank} differs from rank 0"
