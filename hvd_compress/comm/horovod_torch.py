"""Communicator over Horovod's PyTorch collectives (Gloo or MPI, CPU or GPU tensors)."""

from __future__ import annotations

import time
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

from hvd_compress.comm.base import split_gathered
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, SparseSum
from hvd_compress.comm.sparse_frames import encode_sparse_frame, sum_frames


class HorovodTorchCommunicator:
    """Starts each request with Horovod's ``*_async`` functions and waits with ``synchronize``.

    Horovod negotiates collectives by name in its background thread, so requests may be
    started in any order on different ranks as long as every rank starts the same names.
    """

    def __init__(self, process_set: Any = None) -> None:
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.rank = self.process_set.rank()
        self.size = self.process_set.size()

    def start(self, name: str, op: Collective) -> tuple[Collective, int]:
        ps = self.process_set
        if isinstance(op, AllReduce):
            handle = hvd.allreduce_async(op.tensor, name=name, op=hvd.Sum, process_set=ps)
        elif isinstance(op, AllGather):
            handle = hvd.allgather_async(op.tensor, name=name, process_set=ps)
        elif isinstance(op, SparseSum):
            # Each rank's pairs as one frame (the parameter server's format): frames are
            # self-delimiting, so the gathered bytes split back into one frame per rank.
            frame = encode_sparse_frame(name, self.rank, op)
            handle = hvd.allgather_async(torch.from_numpy(np.frombuffer(frame, np.uint8)),
                                         name=name, process_set=ps)
        elif isinstance(op, AllToAll):
            splits = torch.tensor(op.splits, dtype=torch.int32)
            handle = hvd.alltoall_async(op.tensor, splits=splits, name=name, process_set=ps)
        else:
            raise TypeError(f"unknown collective request {op!r}")
        return op, handle

    def wait(self, handle: tuple[Collective, int]) -> torch.Tensor | list[torch.Tensor]:
        op, hvd_handle = handle
        result = hvd.synchronize(_done(hvd_handle))
        if isinstance(op, AllReduce):
            return result
        if isinstance(op, AllGather):
            return split_gathered(result, op.sizes)
        if isinstance(op, SparseSum):
            return sum_frames(op, result.numpy())
        output, received = result
        return list(torch.split(output, received.tolist()))


def _done(hvd_handle: int, longest_sleep: float = 1e-4) -> int:
    """Return ``hvd_handle`` once its collective has finished, sleeping between polls.

    ``hvd.synchronize`` spins (``std::this_thread::yield``) until the collective is done,
    keeping a core busy that Horovod's background thread, the other ranks on the host and
    a parameter server's client threads need; sleeping costs at most ``longest_sleep``
    seconds of latency per wait.
    """
    sleep = 1e-6
    while not hvd.poll(hvd_handle):
        time.sleep(sleep)
        sleep = min(2 * sleep, longest_sleep)
    return hvd_handle
