"""Top-k's gathered sum kept as its pairs (``PairsSum`` -> ``SummedPairs`` -> a
``Scattered`` aggregate): the same aggregates and residuals, bit for bit, as the dense sum
it replaces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.ops import AllGather, SparseSum
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
from hvd_compress.native import available
from hvd_compress.pipeline import DEFAULT_BUCKET_BYTES
from hvd_compress.schemes.base import Scattered
from tests.test_determinism import bits, overlapping, rank_order_sum
from tests.threaded import on_threads

needs_native = pytest.mark.skipif(not available(), reason="native library unavailable")


class FramesCommunicator:
    """A ThreadGroup rank that sends sparse sums as Horovod's all-gather route does: each
    rank's frames gathered, then :func:`sum_gathered`; with ``gathers_frames`` the pipeline
    may hand it a bucket's as one :class:`FramesSum`. Counts the frame gathers it starts
    (``gathers``), the sparse sums they carry (``sums``) and those that came back as
    :class:`SummedPairs` (``pairs``)."""

    def __init__(self, inner: Any, gathers_frames: bool = False) -> None:
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.gathers_frames = gathers_frames
        self.gathers = self.sums = self.pairs = 0

    def start(self, name: str, op: Any) -> Any:
        if isinstance(op, SparseSum | FramesSum):
            self.gathers += 1
            self.sums += len(op.sums) if isinstance(op, FramesSum) else 1
            frame = torch.frombuffer(bytearray(encode_frames(name, self.rank, op)),
                                     dtype=torch.uint8)
            return ("frames", op, self.inner.start(name, AllGather("frames", frame)))
        return self.inner.start(name, op)

    def wait(self, handle: Any) -> Any:
        if isinstance(handle, tuple) and handle[0] == "frames":
            gathered = self.inner.wait(handle[2])
            result = sum_gathered(handle[1], torch.cat(list(gathered)).numpy())
            results = result if isinstance(result, list) else [result]
            self.pairs += sum(isinstance(r, SummedPairs) for r in results)
            return result
        return self.inner.wait(handle)


@needs_native
@pytest.mark.parametrize("values", ["fp32", "fp16"])
def test_summed_pairs_are_the_dense_sum_in_rank_order(values: str) -> None:
    dtype = torch.float16 if values == "fp16" else torch.float32
    parts = [(i, v.to(dtype)) for i, v in overlapping(4, seed=3)]
    parts[1][1][:5] = -0.0  # a lone -0.0 sums to +0.0, as on the dense path
    ops = [PairsSum("sparse", 4096, i, v) for i, v in parts]
    frames = [np.frombuffer(encode_sparse_frame("t", r, op), dtype=np.uint8)
              for r, op in enumerate(ops)]
    expected = bits(rank_order_sum(4096, [(i, v.float()) for i, v in parts]))
    for order in ([0, 1, 2, 3], [2, 0, 3, 1]):
        got = sum_frames(ops[0], np.concatenate([frames[r] for r in order]))
        assert isinstance(got, SummedPairs)
        assert bool((got.indices[1:] > got.indices[:-1]).all())
        dense = Scattered(got.indices, got.values, torch.Size([4096])).materialize()
        assert torch.equal(bits(dense), expected)
        plain = sum_frames(SparseSum("sparse", 4096, *parts[0]),
                           np.concatenate([frames[r] for r in order]))
        assert isinstance(plain, torch.Tensor) and torch.equal(bits(plain), expected)


def test_scattered_writes_a_non_contiguous_output_like_the_dense_form() -> None:
    pairs = Scattered(torch.tensor([1, 5, 6]), torch.tensor([1.5, -2.0, 3.0]),
                      torch.Size([3, 4]))
    out = torch.full((4, 3), 7.0).t()
    assert not out.is_contiguous()
    pairs.write(out, 0.5)
    assert torch.equal(out, pairs.materialize() * 0.5)


SHAPES = {"w1": (300, 200), "w2": (64, 1000), "w3": (7, 3000), "b": (40,)}


def train(make_comm: Callable[[Any], Any], spec: str, ranks: int, steps: int,
          shapes: dict[str, tuple[int, ...]] = SHAPES, min_numel: int = 1,
          bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
          ) -> list[tuple[list[dict[str, torch.Tensor]], dict[str, Any], Any]]:
    """Per ThreadGroup rank (its communicator ``make_comm(thread_rank)``): every step's
    aggregates (``w3`` written into a non-contiguous output), the state dict, the
    communicator."""
    group = ThreadGroup(ranks, timeout=30)

    def work(rank: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, Any], Any]:
        comm = make_comm(group.communicator(rank))
        pipe = Pipeline(Compression.parse(spec), comm, Policy(min_numel=min_numel),
                        average=True, bucket_bytes=bucket_bytes)
        pipe.plan(list(shapes), [torch.Size(s) for s in shapes.values()])
        gen = torch.Generator().manual_seed(100 + rank)
        results = []
        for _ in range(steps):
            grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
            into = {n: torch.empty(s) for n, s in shapes.items()}
            into["w3"] = torch.empty(shapes["w3"][::-1]).t()  # a non-contiguous output
            for name, g in grads.items():
                pipe.submit(name, g)
            results.append({n: t.clone() for n, t in pipe.wait(into).items()})
        return results, pipe.state_dict(), comm

    return on_threads(ranks, work)


@needs_native
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.001,values=fp16"])
def test_topk_over_gathered_frames_trains_bit_for_bit_as_over_a_dense_sum(spec: str) -> None:
    ranks, steps = 3, 4
    dense = train(lambda comm: comm, spec, ranks, steps)
    pairs = train(FramesCommunicator, spec, ranks, steps)
    for _, _, comm in pairs:  # every compressed tensor's sum came back as pairs
        assert comm.pairs == steps * (len(SHAPES) - 1)
    assert_same_training([p[:2] for p in pairs], [d[:2] for d in dense])


def assert_same_training(got: list[tuple[list[dict[str, torch.Tensor]], dict[str, Any]]],
                         want: list[tuple[list[dict[str, torch.Tensor]], dict[str, Any]]]
                         ) -> None:
    """Per rank (steps' aggregates, state dict): ``got`` holds ``want``'s aggregates and
    tensor residuals bit for bit, and every rank of ``got`` the same aggregates."""
    for rank, ((steps, state), (expected_steps, expected_state)) in enumerate(zip(got, want)):
        assert len(steps) == len(expected_steps)
        for step, (row, expected_row) in enumerate(zip(steps, expected_steps)):
            assert row.keys() == expected_row.keys()
            for name in expected_row:
                assert torch.equal(bits(row[name]), bits(expected_row[name])), \
                    (rank, step, name)
        residuals, expected = state["residuals"], expected_state["residuals"]
        assert residuals.keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(bits(residuals[key]), bits(value)), key
    for step, row in enumerate(got[0][0]):  # replicas identical
        for name in row:
            assert all(torch.equal(bits(steps[step][name]), bits(row[name]))
                       for steps, _ in got), (step, name)
