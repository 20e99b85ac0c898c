"""A :class:`~hvd_compress.comm.ops.SparseSum` as parameter-server frames, for the
Horovod ``allgather`` fallback: the same bytes a worker would push to a server."""

from __future__ import annotations

import numpy as np
import torch

from hvd_compress.comm.ops import SparseSum, sorted_pairs, sum_pairs
from hvd_compress.comm.staging import pairs_to_device
from hvd_compress.sparse_wire import Kind, encode_frame, split_frames


def encode_sparse_frame(name: str, rank: int, op: SparseSum) -> bytes:
    """Rank ``rank``'s pairs as one push frame of the whole tensor (shard 0 of 1, round 0)."""
    idx, val = sorted_pairs(op.numel, *op.host, f"tensor {name!r}")
    return encode_frame(Kind.PUSH, name, 0, 1, 0, rank, op.numel, idx, val, op.value_dtype)


def sum_frames(op: SparseSum, gathered: np.ndarray) -> torch.Tensor:
    """The dense float32 sum of every rank's frame in ``gathered`` (their concatenation),
    on the device of ``op.values``: added in the order of the frames' worker ids, i.e.
    rank order (:func:`~hvd_compress.comm.ops.sum_pairs`), so every rank gets the same
    bits whatever the device. The pairs reach a device in one copy
    (:func:`~hvd_compress.comm.staging.pairs_to_device`)."""
    frames = sorted(split_frames(gathered), key=lambda frame: frame.worker)
    for frame in frames:
        if frame.numel != op.numel:
            raise RuntimeError(f"rank {frame.worker} sent {frame.numel} elements for tensor "
                               f"{frame.tensor!r}, this rank has {op.numel}")
    device = op.values.device
    parts = pairs_to_device([(f.indices, f.values) for f in frames], device)
    return sum_pairs(op.numel, parts, device)
