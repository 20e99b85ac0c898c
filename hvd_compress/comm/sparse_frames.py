"""A :class:`~hvd_compress.comm.ops.SparseSum` as parameter-server frames, for the
Horovod ``allgather`` fallback: the same bytes a worker would push to a server."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hvd_compress.comm.ops import SparseSum, sorted_pairs, sum_pairs
from hvd_compress.comm.staging import pairs_to_device
from hvd_compress.native import sparse as native_sparse
from hvd_compress.sparse_wire import Kind, encode_frame, split_frames


@dataclass(frozen=True)
class PairsSum(SparseSum):
    """A :class:`~hvd_compress.comm.ops.SparseSum` whose sender can use the sum kept as
    its pairs: a communicator that gathers frames (:func:`sum_frames`) answers it with
    :class:`SummedPairs` when the values are on the CPU and the native merge is there, so
    that nothing of the tensor's dense size is written, read or copied for it; any other
    communicator (a parameter server, threads in one process) answers it as a plain
    ``SparseSum``, with the dense sum. Both hold the same sums, bit for bit."""


@dataclass(frozen=True)
class SummedPairs:
    """The sum over ranks of a :class:`PairsSum` as pairs: the union of every rank's
    indices, strictly increasing (int64), and the float32 sum at each, added in rank order
    from 0 (``((0 + v_0) + v_1) + ...``, the bits of :func:`~hvd_compress.comm.ops.
    sum_pairs` there); every other entry of the sum is 0."""

    indices: torch.Tensor
    values: torch.Tensor


def encode_sparse_frame(name: str, rank: int, op: SparseSum) -> bytes:
    """Rank ``rank``'s pairs as one push frame of the whole tensor (shard 0 of 1, round 0)."""
    idx, val = sorted_pairs(op.numel, *op.host, f"tensor {name!r}")
    return encode_frame(Kind.PUSH, name, 0, 1, 0, rank, op.numel, idx, val, op.value_dtype)


def sum_frames(op: SparseSum, gathered: np.ndarray) -> torch.Tensor | SummedPairs:
    """The sum of every rank's frame in ``gathered`` (their concatenation), added in the
    order of the frames' worker ids, i.e. rank order (:func:`~hvd_compress.comm.ops.
    sum_pairs`), so every rank gets the same bits whatever the device: for a
    :class:`PairsSum` on the CPU, as :class:`SummedPairs` (one native merge of the frames'
    sorted pairs, :func:`hvd_compress.native.sparse.merge_sum`); otherwise the dense
    float32 sum, on the device of ``op.values``, whose pairs reach a device in one copy
    (:func:`~hvd_compress.comm.staging.pairs_to_device`)."""
    frames = sorted(split_frames(gathered), key=lambda frame: frame.worker)
    for frame in frames:
        if frame.numel != op.numel:
            raise RuntimeError(f"rank {frame.worker} sent {frame.numel} elements for tensor "
                               f"{frame.tensor!r}, this rank has {op.numel}")
    device = op.values.device
    if isinstance(op, PairsSum) and device.type == "cpu":
        merged = native_sparse.merge_sum([(f.indices, f.values) for f in frames])
        if merged is not None:
            return SummedPairs(torch.from_numpy(merged[0]), torch.from_numpy(merged[1]))
    parts = pairs_to_device([(f.indices, f.values) for f in frames], device)
    return sum_pairs(op.numel, parts, device)
