"""A communicator whose all-reduce runs in two levels: inside the host, then across hosts.

:class:`HostTwoLevelCommunicator` composes the communicator of a host's ``L`` ranks and
the communicator of this local rank on each of ``H`` hosts (those
:func:`hvd_compress.hierarchy.horovod_host_communicators` builds) into one communicator of
the job's ``H * L`` ranks. An :class:`~hvd_compress.comm.ops.AllReduce` of a tensor goes::

    in-host reduce-scatter (an all-to-all of L contiguous chunks of the flat tensor; each
        local rank sums its chunk in local rank order, float16 and bfloat16 in float32)
    -> cross-host all-reduce of this local rank's chunk (among the H ranks of its local rank)
    -> in-host all-gather of the L summed chunks

so every rank gets the same sum, and for integer-valued inputs (sums exact in the dtype)
the flat all-reduce's result bit for bit. Each host link carries ``1/L`` of the tensor per
rank, as in Horovod's hierarchical all-reduce. Other collectives are refused
(``TypeError``): they are not sums and a job has no flat communicator to send them over;
two-level compression uses this communicator only for schemes whose every round is an
all-reduce of something linear in the gradient
(:attr:`~hvd_compress.schemes.base.Scheme.linear_rounds`; docs/user-guide.md#two-level-compression).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective

HOST_ROUND = "host"
"""The round name of every collective inside a host, here and in two-level compression's
dense host sum (:mod:`hvd_compress.hierarchy`): ``collective_bytes`` counts them under it."""


def sum_in_order(parts: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The sum of ``parts`` (one per local rank) in local rank order, as every host sums
    them; float16 and bfloat16 summed in float32 and returned in their own dtype."""
    dtype = parts[0].dtype
    wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    summed = parts[0].to(wide, copy=True)
    for part in parts[1:]:
        summed += part
    return summed.to(dtype)


def wait_sum(local: Communicator, handle: Any) -> torch.Tensor:
    """The in-host sum (:func:`sum_in_order`) of what an all-to-all started on ``local``
    brings this rank: summed as it arrives where the communicator can
    (:meth:`~hvd_compress.comm.shm.ShmHostCommunicator.wait_sum`), the same bits."""
    summing = getattr(local, "wait_sum", None)
    return summing(handle) if summing is not None else sum_in_order(local.wait(handle))


@dataclass
class _Handle:
    name: str
    op: AllReduce
    bounds: list[int]  # the L + 1 cut points of the flat tensor
    scatter: Any = None  # the in-host all-to-all, or this rank's own flat tensor (L = 1)
    result: torch.Tensor | None = None


class HostTwoLevelCommunicator:
    """The job's ``local.size * cross.size`` ranks as one communicator of all-reduces.

    Args:
        local: the communicator of this rank's host (``rank``: the local rank).
        cross: the communicator of this local rank on every host (``rank``: the host).

    ``rank`` is ``host * L + local_rank`` (a position, for schemes' contexts; Horovod's
    global rank may differ), ``size`` is ``H * L``. ``start`` starts the in-host all-to-all
    only; ``wait`` finishes it, then runs the cross-host all-reduce and the in-host
    all-gather, so every rank must wait its handles in the same order: ``ordered`` is true,
    and the pipeline starts and waits planned buckets in plan order.
    :attr:`host_bytes` counts the bytes this rank handed to in-host collectives since it
    was last taken (:meth:`take_host_bytes`).
    """

    def __init__(self, local: Communicator, cross: Communicator) -> None:
        self.local, self.cross = local, cross
        self.rank = cross.rank * local.size + local.rank
        self.size = local.size * cross.size
        # wait() starts the later levels, so every rank must wait its handles in one order:
        # the pipeline then starts (and waits) buckets in plan order on every rank.
        self.ordered = True
        self.host_bytes = 0

    def take_host_bytes(self) -> int:
        """The in-host bytes counted since the last call; resets the count."""
        taken, self.host_bytes = self.host_bytes, 0
        return taken

    def start(self, name: str, op: Collective) -> _Handle:
        if not isinstance(op, AllReduce):
            raise TypeError(
                f"{type(self).__name__} runs all-reduces only, got {type(op).__name__} for "
                f"{name!r}: under hierarchy='host' only schemes with linear_rounds = True "
                "(every round an all-reduce) exchange through it")
        n, parts = op.tensor.numel(), self.local.size
        handle = _Handle(name, op, [n * i // parts for i in range(parts + 1)])
        flat = op.tensor.reshape(-1)
        if parts == 1:
            handle.scatter = flat
            return handle
        splits = tuple(b - a for a, b in zip(handle.bounds, handle.bounds[1:]))
        handle.scatter = self.local.start(f"{name}.host", AllToAll(HOST_ROUND, flat, splits))
        self.host_bytes += flat.numel() * flat.element_size()
        return handle

    def wait(self, handle: _Handle) -> torch.Tensor:
        if handle.result is not None:
            return handle.result
        tensor = handle.op.tensor
        own = self.local.size > 1  # chunk is this communicator's sum, not the caller's
        if not own:
            chunk = handle.scatter
        else:
            chunk = wait_sum(self.local, handle.scatter)
        handle.scatter = None
        if chunk.numel() and self.cross.size > 1:  # the same on every host: same shape
            chunk = self.cross.wait(self.cross.start(
                f"{handle.name}.cross",
                AllReduce(handle.op.round, chunk, inplace=own or handle.op.inplace)))
        if not own:
            total = chunk
        else:
            sizes = tuple(b - a for a, b in zip(handle.bounds, handle.bounds[1:]))
            self.host_bytes += chunk.numel() * chunk.element_size()
            gathered = self.local.wait(self.local.start(
                f"{handle.name}.gather", AllGather(HOST_ROUND, chunk, sizes)))
            total = torch.cat([g.reshape(-1) for g in gathered])
        handle.result = total.view(tensor.shape)
        return handle.result
