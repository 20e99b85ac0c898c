"""A bucket's top-k sums as one all-gather of every rank's frames (``FramesSum``) where the
communicator gathers frames: the same aggregates, residuals and replicas, bit for bit, as one
all-gather per tensor; never fused for a communicator without ``gathers_frames`` (a
parameter server keys rounds by tensor)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.ops import SparseSum
from hvd_compress.comm.sparse_frames import (
    FramesSum,
    PairsSum,
    SummedPairs,
    encode_frames,
    encode_sparse_frame,
    sum_frames,
    sum_gathered,
)
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.fusion import fuse, fusion_key
from tests.test_determinism import bits, overlapping
from tests.test_topk_pairs import (
    FramesCommunicator,
    assert_same_training,
    needs_native,
    train,
)
from tests.threaded import on_threads

SHAPES = {"w1": (300, 200), "w2": (64, 1000), "b1": (40,), "w3": (7, 3000), "w4": (50, 90),
          "b2": (64,)}


def _train(fused: bool, spec: str, ranks: int, steps: int, bucket_bytes: int
           ) -> list[tuple[list[dict[str, torch.Tensor]], dict[str, Any], Any]]:
    return train(lambda comm: FramesCommunicator(comm, fused), spec, ranks, steps, SHAPES,
                 min_numel=1000, bucket_bytes=bucket_bytes)


@needs_native
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.001,values=fp16"])
@pytest.mark.parametrize("bucket_bytes", [300_000, 1 << 30])
def test_fused_frames_train_bit_for_bit_as_one_gather_per_tensor(spec: str,
                                                                 bucket_bytes: int) -> None:
    ranks, steps = 3, 4
    alone = _train(False, spec, ranks, steps, bucket_bytes)
    fused = _train(True, spec, ranks, steps, bucket_bytes)
    compressed = 4  # the four 2-D tensors; the biases are below min_numel
    for rank in range(ranks):
        gathers, sums = fused[rank][2].gathers, fused[rank][2].sums
        assert alone[rank][2].gathers == alone[rank][2].sums == sums == steps * compressed
        # One gather per bucket holding top-k tensors: at 300 KB w1 (240 KB), w2 (256 KB)
        # and w3 (84 KB) with w4 (18 KB) are three buckets; 1 GiB holds all four.
        assert gathers == steps * (3 if bucket_bytes == 300_000 else 1)
    assert_same_training([f[:2] for f in fused], [a[:2] for a in alone])

def _members(ranks: int, dtype: torch.dtype) -> list[list[PairsSum]]:
    """Per rank, three PairsSum requests of different lengths, overlapping indices."""
    out: list[list[PairsSum]] = [[] for _ in range(ranks)]
    for m, seed in enumerate((3, 4, 5)):
        for rank, (i, v) in enumerate(overlapping(ranks, seed=seed)):
            keep = i < 4096 - 1000 * m
            out[rank].append(PairsSum("sparse", 4096 - 1000 * m, i[keep], v[keep].to(dtype)))
    return out


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sum_gathered_splits_each_member_as_it_would_be_summed_alone(
        dtype: torch.dtype) -> None:
    ranks = 4
    members = _members(ranks, dtype)
    batches = [FramesSum("sparse", tuple(ms)) for ms in members]
    sent = [np.frombuffer(encode_frames("ignored", r, b), dtype=np.uint8)
            for r, b in enumerate(batches)]
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        got = sum_gathered(batches[0], np.concatenate([sent[r] for r in order]))
        assert isinstance(got, list) and len(got) == 3
        for m, result in enumerate(got):
            alone = sum_frames(members[0][m], np.concatenate([
                np.frombuffer(encode_sparse_frame(f"t{m}", r, members[r][m]), dtype=np.uint8)
                for r in order]))
            assert isinstance(result, SummedPairs) and isinstance(alone, SummedPairs)
            assert torch.equal(result.indices, alone.indices)
            assert torch.equal(bits(result.values), bits(alone.values))


@needs_native
def test_sum_gathered_refuses_a_member_missing_a_rank() -> None:
    members = _members(2, torch.float32)
    whole = encode_frames("x", 0, FramesSum("sparse", tuple(members[0])))
    short = encode_frames("x", 1, FramesSum("sparse", tuple(members[1][:2])))
    gathered = np.frombuffer(whole + short, dtype=np.uint8)
    with pytest.raises(RuntimeError, match="member 2 has frames of ranks"):
        sum_gathered(FramesSum("sparse", tuple(members[0])), gathered)
    stray = encode_sparse_frame("w1", 1, members[1][0])  # a frame not named by its place
    with pytest.raises(RuntimeError, match="names member 'w1'"):
        sum_gathered(FramesSum("sparse", tuple(members[0])),
                     np.frombuffer(whole + stray, dtype=np.uint8))


def test_pairs_sums_fuse_only_for_a_communicator_that_gathers_frames() -> None:
    a = PairsSum("sparse", 10, torch.tensor([1, 3]), torch.tensor([1.0, 2.0]))
    b = PairsSum("sparse", 20, torch.tensor([4]), torch.tensor([5.0]))
    half = PairsSum("sparse", 20, torch.tensor([4]), torch.tensor([5.0]).half())
    plain = SparseSum("sparse", 20, torch.tensor([4]), torch.tensor([5.0]))
    assert fusion_key(a) is None and fusion_key(plain, gathers_frames=True) is None
    assert fusion_key(a, gathers_frames=True) == fusion_key(b, gathers_frames=True)
    assert fusion_key(half, gathers_frames=True) != fusion_key(a, gathers_frames=True)
    op = fuse([a, b], 0, 2, "test")
    assert isinstance(op, FramesSum) and op.sums == (a, b) and op.round == "sparse"


@needs_native
def test_a_communicator_without_gathers_frames_gets_one_sparse_sum_per_tensor() -> None:
    group = ThreadGroup(2, timeout=30)

    def work(rank: int) -> list[str]:
        inner = group.communicator(rank)
        seen: list[str] = []

        class Server:  # stands for a parameter server: no gathers_frames attribute
            rank, size = inner.rank, inner.size

            def start(self, name: str, op: Any) -> Any:
                seen.append(type(op).__name__)
                return inner.start(name, op)

            def wait(self, handle: Any) -> Any:
                return inner.wait(handle)

        pipe = Pipeline(Compression.parse("topk:ratio=0.01"), Server(), Policy(min_numel=1000),
                        bucket_bytes=1 << 30)
        pipe.reduce({n: torch.randn(s) for n, s in SHAPES.items()})
        return seen

    for seen in on_threads(2, work):
        assert seen.count("PairsSum") == 4 and "FramesSum" not in seen


@needs_native
@pytest.mark.multiprocess
def test_fused_frames_over_horovodrun_match_one_gather_per_tensor() -> None:
    from tests.harness import run_ranks

    ranks = run_ranks("tests.workers.topk_fused:train", np=2, launcher="gloo", timeout=300,
                      spec="topk:ratio=0.01")
    for out in ranks:
        # w1 and w2 are alone in their buckets; w3 and w4 share one: a FramesSum a step.
        assert out["fused"]["batches"] == 3 and out["alone"]["batches"] == 0
    assert_same_training(
        [(out["fused"]["steps"], {"residuals": out["fused"]["residuals"]}) for out in ranks],
        [(out["alone"]["steps"], {"residuals": out["alone"]["residuals"]}) for out in ranks])
