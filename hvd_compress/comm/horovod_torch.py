"""Communicator over Horovod's PyTorch collectives (Gloo or MPI, CPU or GPU tensors).

Horovod 0.28.1 refuses some dtypes outright ("Tensor type torch.BFloat16Tensor is not
supported"). Such tensors take an exact route (:data:`SUM_AS`, :data:`MOVE_AS`): sums run in
a wider dtype that holds every sum exactly and are rounded back once (bfloat16 as float32:
its 8-bit significand fits float32's 24 bits, so the only rounding is the final one, the
same on every rank), and collectives that only move data (all-gather, all-to-all,
broadcast) send the bit patterns as a same-sized integer type, so what arrives is the sent
value bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch

# SUM_AS and MOVE_AS live beside the protocol, so communicators without Horovod share them.
from hvd_compress.comm.base import MOVE_AS, SUM_AS, poll_until, split_gathered
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, SparseSum
from hvd_compress.comm.sparse_frames import FramesSum, encode_frames, sum_gathered

__all__ = ["MOVE_AS", "SUM_AS", "HorovodTorchCommunicator", "as_movable"]


def as_movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` or, for a dtype in :data:`MOVE_AS`, a view of its bits (same storage, so
    an in-place collective on the view writes into ``tensor``). Needs a contiguous tensor
    for such dtypes."""
    wire = MOVE_AS.get(tensor.dtype)
    return tensor if wire is None else tensor.view(wire)


@dataclass
class _Started:
    op: Collective
    handle: int
    dtype: torch.dtype | None = None  # set when the result must be turned back into it
    into: torch.Tensor | None = None  # an in-place all-reduce summed in another dtype


class HorovodTorchCommunicator:
    """Starts each request with Horovod's ``*_async`` functions and waits with ``synchronize``.

    Horovod negotiates collectives by name in its background thread, so requests may be
    started in any order on different ranks as long as every rank starts the same names.
    """

    gathers_frames = True
    """Sparse sums are all-gathers of frames, so a bucket's may be one (:class:`FramesSum`)."""

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()

    def start(self, name: str, op: Collective) -> _Started:
        ps = self.process_set
        if isinstance(op, AllReduce):
            wide = SUM_AS.get(op.tensor.dtype)
            if wide is not None:
                handle = hvd.allreduce_async_(op.tensor.to(wide), name=name, op=hvd.Sum,
                                              process_set=ps)
                return _Started(op, handle, op.tensor.dtype,
                                op.tensor if op.inplace else None)
            reduce = hvd.allreduce_async_ if op.inplace else hvd.allreduce_async
            return _Started(op, reduce(op.tensor, name=name, op=hvd.Sum, process_set=ps))
        if isinstance(op, AllGather):
            tensor = as_movable(op.tensor.contiguous())
            return _Started(op, hvd.allgather_async(tensor, name=name, process_set=ps),
                            op.tensor.dtype)
        if isinstance(op, SparseSum | FramesSum):
            # Each rank's pairs as one frame (the parameter server's format): frames are
            # self-delimiting, so the gathered bytes split back into one frame per rank.
            # A writable copy (a few microseconds): torch warns on read-only buffers.
            frame = bytearray(encode_frames(name, self.rank, op))
            return _Started(op, hvd.allgather_async(
                torch.frombuffer(frame, dtype=torch.uint8), name=name, process_set=ps))
        if isinstance(op, AllToAll):
            splits = torch.tensor(op.splits, dtype=torch.int32)
            tensor = as_movable(op.tensor.contiguous())
            return _Started(op, hvd.alltoall_async(tensor, splits=splits, name=name,
                                                   process_set=ps), op.tensor.dtype)
        raise TypeError(f"unknown collective request {op!r}")

    def wait(self, started: _Started) -> torch.Tensor | list[torch.Tensor]:
        op = started.op
        poll_until(lambda: hvd.poll(started.handle))  # synchronize alone would spin
        result = hvd.synchronize(started.handle)
        if isinstance(op, AllReduce):
            if started.into is not None:
                return started.into.copy_(result)
            return result if started.dtype is None else result.to(started.dtype)
        if isinstance(op, SparseSum | FramesSum):
            return sum_gathered(op, result.numpy())
        if isinstance(op, AllGather):
            return split_gathered(result.view(started.dtype), op.sizes)
        output, received = result
        return list(torch.split(output.view(started.dtype), received.tolist()))
