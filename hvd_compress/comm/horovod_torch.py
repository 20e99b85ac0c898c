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

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import horovod.torch as hvd
import torch

# SUM_AS and MOVE_AS live beside the protocol, so communicators without Horovod share them.
from hvd_compress.comm.base import MOVE_AS, SUM_AS, split_gathered
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
    name: str = ""
    began: float = field(default_factory=time.perf_counter)


class Pacer:
    """Sleeps until a Horovod request is done, with few wake-ups.

    Horovod's ``synchronize`` spins (a core busy for the whole wait), so the communicator
    polls and sleeps between polls. Each wake-up costs the thread CPU (20-27 µs here, on a
    loaded 2-core machine), and a sleep schedule that starts at 1 µs and is capped at
    0.5 ms wakes about 28 times over a 10 ms Horovod cycle, 200 times over a 100 ms
    round on a slow link. Collectives keep their names from step to step (Horovod's
    response cache needs that) and a name's round takes about as long each step, so the
    pacer keeps, per name, how long its last :data:`HISTORY` rounds took from their start
    to the poll that saw them done, and first sleeps until :data:`AHEAD` of the shortest
    of those has passed since this round's start; then polls with sleeps from
    :data:`FIRST` (or a twentieth of that shortest round, if longer) doubling up to
    ``longest``. A round that ends sooner than predicted is seen at most ``AHEAD`` x the
    shortest recent round late, and is recorded as that long, so the next prediction
    shrinks by ``AHEAD``; a name with no history waits as before (1 µs doubling).
    A round already done at the first poll is not recorded: it says nothing of its length.
    """

    HISTORY = 4
    AHEAD = 0.8
    FIRST = 1e-6
    NAMES = 4096  # forget every name past this many (a pipeline uses a fixed set)

    def __init__(self, longest: float = 5e-4) -> None:
        self.longest = longest
        self._took: dict[str, deque[float]] = {}

    def wait(self, name: str, began: float, ready: Any) -> None:
        """Return once ``ready()`` is true; ``began``: the request's ``perf_counter`` at
        its start."""
        if ready():
            return
        took = self._took.get(name)
        sleep = self.FIRST
        if took:
            shortest = min(took)
            ahead = began + self.AHEAD * shortest - time.perf_counter()
            if ahead > 0:
                time.sleep(ahead)
            sleep = max(sleep, shortest / 20)
        while not ready():
            time.sleep(sleep)
            sleep = min(2 * sleep, self.longest)
        if took is None:
            if len(self._took) >= self.NAMES:
                self._took.clear()
            took = self._took[name] = deque(maxlen=self.HISTORY)
        took.append(time.perf_counter() - began)


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
        self.pacer = Pacer()

    def start(self, name: str, op: Collective) -> _Started:
        started = self._start(name, op)
        started.name = name
        return started

    def _start(self, name: str, op: Collective) -> _Started:
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
        # synchronize alone would spin
        self.pacer.wait(started.name, started.began, lambda: hvd.poll(started.handle))
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
