"""Communicator over Horovod's PyTorch collectives (Gloo or MPI, CPU or GPU tensors)."""

from __future__ import annotations

from typing import Any

import horovod.torch as hvd
import numpy as np
import torch

from hvd_compress.comm.base import poll_until, split_gathered
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
            reduce = hvd.allreduce_async_ if op.inplace else hvd.allreduce_async
            handle = reduce(op.tensor, name=name, op=hvd.Sum, process_set=ps)
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
        poll_until(lambda: hvd.poll(hvd_handle))  # synchronize alone would spin
        result = hvd.synchronize(hvd_handle)
        if isinstance(op, AllReduce):
            return result
        if isinstance(op, AllGather):
            return split_gathered(result, op.sizes)
        if isinstance(op, SparseSum):
            return sum_frames(op, result.numpy())
        output, received = result
        return list(torch.split(output, received.tolist()))
