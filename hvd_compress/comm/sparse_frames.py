"""A :class:`~hvd_compress.comm.ops.SparseSum` as parameter-server frames, for the
Horovod ``allgather`` fallback: the same bytes a worker would push to a server.

A communicator that gathers frames (``gathers_frames = True``) may also be handed a
:class:`FramesSum`: several of a bucket's :class:`PairsSum` requests as one all-gather of
every rank's frames back to back (frames are self-delimiting and carry their member's
place), split by member on arrival (:func:`sum_gathered`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hvd_compress.comm.ops import SparseSum, sorted_pairs, sum_pairs
from hvd_compress.comm.staging import pairs_to_device
from hvd_compress.native import sparse as native_sparse
from hvd_compress.sparse_wire import Frame, Kind, encode_frame, frame_bound, split_frames


@dataclass(frozen=True)
class PairsSum(SparseSum):
    """A :class:`~hvd_compress.comm.ops.SparseSum` whose sender can use the sum kept as
    its pairs: a communicator that gathers frames (:func:`sum_frames`) answers it with
    :class:`SummedPairs` when the values are on the CPU and the native merge is there, so
    that nothing of the tensor's dense size is written, read or copied for it; any other
    communicator (a parameter server, threads in one process) answers it as a plain
    ``SparseSum``, with the dense sum. Both hold the same sums, bit for bit.

    Every rank sends the same number of pairs (top-k's ``k``), so every rank knows the
    most bytes any rank's frame can take (:func:`frames_bound`) and a collective of that
    fixed size can carry them, started at once."""


@dataclass(frozen=True)
class SummedPairs:
    """The sum over ranks of a :class:`PairsSum` as pairs: the union of every rank's
    indices, strictly increasing (int64), and the float32 sum at each, added in rank order
    from 0 (``((0 + v_0) + v_1) + ...``, the bits of :func:`~hvd_compress.comm.ops.
    sum_pairs` there); every other entry of the sum is 0."""

    indices: torch.Tensor
    values: torch.Tensor


@dataclass(frozen=True)
class FramesSum:
    """Several :class:`PairsSum` requests of one bucket's phase as one collective: each
    rank's frames of every member in turn, all-gathered as one byte string
    (:func:`encode_frames`), and summed per member on arrival (:func:`sum_gathered`).

    Only for a communicator whose ``gathers_frames`` is true (it all-gathers a sparse
    sum's frames, as Horovod's does); never for one that sends a
    :class:`~hvd_compress.comm.ops.SparseSum` to a parameter server, which keys rounds by
    tensor. The result is one result per member, in order, the bits the member alone
    would have got (:func:`sum_frames`). Member ``m``'s frames are named ``str(m)``."""

    round: str
    sums: tuple[PairsSum, ...]


def encode_sparse_frame(name: str, rank: int, op: SparseSum) -> bytes:
    """Rank ``rank``'s pairs as one push frame of the whole tensor (shard 0 of 1, round 0)."""
    idx, val = sorted_pairs(op.numel, *op.host, f"tensor {name!r}")
    return encode_frame(Kind.PUSH, name, 0, 1, 0, rank, op.numel, idx, val, op.value_dtype)


def _frames_of(name: str, op: SparseSum | FramesSum) -> list[tuple[str, SparseSum]]:
    """Each frame's name and sparse sum, in the order :func:`encode_frames` sends them:
    ``op`` itself named ``name``, or a :class:`FramesSum`'s member ``m`` named ``str(m)``."""
    if isinstance(op, FramesSum):
        return [(str(m), member) for m, member in enumerate(op.sums)]
    return [(name, op)]


def encode_frames(name: str, rank: int, op: SparseSum | FramesSum) -> bytes:
    """What rank ``rank`` all-gathers for ``op``: its one frame of a sparse sum named
    ``name`` (:func:`encode_sparse_frame`), or its frames of a :class:`FramesSum`'s
    members back to back, member ``m``'s named ``str(m)``."""
    return b"".join(encode_sparse_frame(n, rank, member) for n, member in _frames_of(name, op))


def frames_bound(name: str, op: SparseSum | FramesSum) -> int | None:
    """The most bytes :func:`encode_frames` gives for ``op`` on any rank
    (:func:`~hvd_compress.sparse_wire.frame_bound` of each frame), when every rank knows it:
    for a :class:`PairsSum` or a :class:`FramesSum` (every rank's count is this rank's);
    ``None`` for another sparse sum, whose count may differ between ranks."""
    frames = _frames_of(name, op)
    if not all(isinstance(member, PairsSum) for _, member in frames):
        return None
    return sum(frame_bound(n, member.numel, member.indices.numel(), member.value_dtype)
               for n, member in frames)


def sum_gathered(op: SparseSum | FramesSum, gathered: np.ndarray
                 ) -> torch.Tensor | SummedPairs | list[torch.Tensor | SummedPairs]:
    """The result of ``op`` from every rank's :func:`encode_frames` concatenated: for a
    sparse sum, :func:`sum_frames`; for a :class:`FramesSum`, one such result per member
    (its frames picked out by their names), in order. Raises :class:`RuntimeError` when a
    member's frames are not one per rank."""
    if not isinstance(op, FramesSum):
        return sum_frames(op, gathered)
    members: list[list[Frame]] = [[] for _ in op.sums]
    for frame in split_frames(gathered):
        m = int(frame.tensor) if frame.tensor.isdigit() else -1
        if not 0 <= m < len(members):
            raise RuntimeError(f"fused sparse sum {op.round!r}: a frame of rank "
                               f"{frame.worker} names member {frame.tensor!r} of "
                               f"{len(members)}")
        members[m].append(frame)
    ranks = len(members[0])
    for m, frames in enumerate(members):
        if len(frames) != ranks or len({f.worker for f in frames}) != ranks:
            raise RuntimeError(f"fused sparse sum {op.round!r}: member {m} has frames of "
                               f"ranks {sorted(f.worker for f in frames)}, member 0 of "
                               f"{ranks} ranks")
    return [_sum_split(member, frames) for member, frames in zip(op.sums, members)]


def sum_frames(op: SparseSum, gathered: np.ndarray) -> torch.Tensor | SummedPairs:
    """The sum of every rank's frame in ``gathered`` (their concatenation), added in the
    order of the frames' worker ids, i.e. rank order (:func:`~hvd_compress.comm.ops.
    sum_pairs`), so every rank gets the same bits whatever the device: for a
    :class:`PairsSum` on the CPU, as :class:`SummedPairs` (one native merge of the frames'
    sorted pairs, :func:`hvd_compress.native.sparse.merge_sum`); otherwise the dense
    float32 sum, on the device of ``op.values``, whose pairs reach a device in one copy
    (:func:`~hvd_compress.comm.staging.pairs_to_device`)."""
    return _sum_split(op, split_frames(gathered))


def _sum_split(op: SparseSum, frames: Sequence[Frame]) -> torch.Tensor | SummedPairs:
    """:func:`sum_frames` of the frames already split."""
    frames = sorted(frames, key=lambda frame: frame.worker)
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
