"""Top-k's gathered sum kept as its pairs (``PairsSum`` -> ``SummedPairs`` -> a
``Scattered`` aggregate): the same aggregates and residuals, bit for bit, as the dense sum
it replaces."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy
from hvd_compress.comm.ops import AllGather, SparseSum
from hvd_compress.comm.sparse_frames import (
    PairsSum,
    SummedPairs,
    encode_sparse_frame,
    sum_frames,
)
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.native import available
from hvd_compress.schemes.base import Scattered
from tests.test_determinism import bits, overlapping, rank_order_sum
from tests.threaded import on_threads

needs_native = pytest.mark.skipif(not available(), reason="native library unavailable")


class FramesCommunicator:
    """A ThreadGroup rank that sends sparse sums as Horovod's all-gather route does: each
    rank's frame gathered, then :func:`sum_frames`."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.pairs = 0  # results that came back as SummedPairs

    def start(self, name: str, op: Any) -> Any:
        if isinstance(op, SparseSum):
            frame = torch.frombuffer(bytearray(encode_sparse_frame(name, self.rank, op)),
                                     dtype=torch.uint8)
            return ("frames", op, self.inner.start(name, AllGather("frames", frame)))
        return self.inner.start(name, op)

    def wait(self, handle: Any) -> Any:
        if isinstance(handle, tuple) and handle[0] == "frames":
            gathered = self.inner.wait(handle[2])
            result = sum_frames(handle[1], torch.cat(list(gathered)).numpy())
            self.pairs += isinstance(result, SummedPairs)
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


def _train(frames: bool, spec: str, ranks: int, steps: int
           ) -> list[tuple[list[dict[str, torch.Tensor]], dict[str, Any]]]:
    group = ThreadGroup(ranks, timeout=30)
    shapes = {"w1": (300, 200), "w2": (64, 1000), "w3": (7, 3000), "b": (40,)}

    def work(rank: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, Any]]:
        comm: Any = group.communicator(rank)
        if frames:
            comm = FramesCommunicator(comm)
        pipe = Pipeline(Compression.parse(spec), comm, Policy(min_numel=1),
                        average=True)
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
        if frames:  # every compressed tensor's sum came back as pairs
            assert comm.pairs == steps * (len(shapes) - 1)
        return results, pipe.state_dict()

    return on_threads(ranks, work)


@needs_native
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "topk:ratio=0.001,values=fp16"])
def test_topk_over_gathered_frames_trains_bit_for_bit_as_over_a_dense_sum(spec: str) -> None:
    ranks, steps = 3, 4
    dense = _train(False, spec, ranks, steps)
    pairs = _train(True, spec, ranks, steps)
    for rank in range(ranks):
        (got, got_state), (want, want_state) = pairs[rank], dense[rank]
        for step in range(steps):
            for name in want[step]:
                assert torch.equal(bits(got[step][name]), bits(want[step][name])), \
                    (rank, step, name)
        residuals, expected = got_state["residuals"], want_state["residuals"]
        assert residuals.keys() == expected.keys()
        for key, value in expected.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(bits(residuals[key]), bits(value)), key
    for step in range(steps):  # replicas identical
        for name in pairs[0][0][step]:
            assert all(torch.equal(bits(pairs[r][0][step][name]),
                                   bits(pairs[0][0][step][name])) for r in range(ranks))
