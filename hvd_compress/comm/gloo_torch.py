"""Communicator over a ``torch.distributed`` Gloo process group, beside Horovod.

Horovod runs every collective through its background loop: a request waits for the next
cycle (``HOROVOD_CYCLE_TIME``, 10 ms here), is negotiated with the coordinator by name, and
only then travels; Horovod 0.28.1's loop sleeps out each cycle and nothing wakes it early.
A scheme with several rounds per step (PowerSGD's ``P`` then ``Q``) pays that wait once per
round, and how much of a cycle is left when a round is started varies from step to step.
PyTorch DDP's communication hooks pay none of it: they start Gloo collectives directly.

:class:`GlooCommunicator` does the same for the pipeline's all-reduces, fixed-size
all-gathers and all-to-alls: each is started on the Gloo group from the caller's thread
(``async_op=True``) and waited on with ``Work.wait()``, which blocks without spinning.
Self-delimiting all-gathers (``sizes=None``) and sparse sums, whose sizes the receivers do
not know, still go through ``fallback`` (Horovod, or a parameter server around it).

Gloo matches collectives by the order they are started, not by name. The pipeline starts
them in an order that every rank reproduces when every rank submits the same tensors
(``ordered``: planned buckets start in plan order, as DDP's buckets do); a rank that starts
a different sequence makes Gloo fail with a size mismatch or a timeout naming the
collective, or, for requests of equal size, sums the wrong tensors. Run once with
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` to have every collective checked across ranks.

An all-to-all's ``splits`` must be the same on every sender (the fusion contract of
:class:`~hvd_compress.comm.ops.AllToAll`, which every scheme here meets): Gloo needs the
receive sizes in advance, and they are ``splits[rank]`` from every source.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.horovod_torch import SUM_AS
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a Gloo collective may wait for the other ranks before it raises."""

_SIOCGIFADDR = 0x8915


@dataclass
class _Started:
    op: Collective
    work: Any
    result: Any  # what the collective writes into
    into: torch.Tensor | None = None  # an in-place all-reduce summed in another dtype


class GlooCommunicator:
    """The pipeline's dense collectives on ``group``; the others through ``fallback``."""

    ordered = True
    """Collectives are matched by start order (see :class:`~hvd_compress.pipeline.Pipeline`)."""

    def __init__(self, group: Any, fallback: Communicator) -> None:
        self.group = group
        self.fallback = fallback
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if (self.rank, self.size) != (fallback.rank, fallback.size):
            raise ValueError(f"the Gloo group's rank {self.rank} of {self.size} differs from "
                             f"Horovod's rank {fallback.rank} of {fallback.size}; the group "
                             "must hold Horovod's ranks in Horovod's order")

    def start(self, name: str, op: Collective) -> Any:
        if isinstance(op, AllReduce):
            # bfloat16 is summed in float32, exactly, and rounded once (as over Horovod).
            wide = SUM_AS.get(op.tensor.dtype)
            summed = op.tensor.to(wide) if wide is not None else \
                op.tensor if op.inplace else op.tensor.clone()
            into = op.tensor if op.inplace and wide is not None else None
            return _Started(op, dist.all_reduce(summed, group=self.group, async_op=True),
                            summed, into)
        if isinstance(op, AllGather) and op.sizes is not None:
            return self._all_gather(op)
        if isinstance(op, AllToAll):
            return self._all_to_all(op)
        return self.fallback.start(name, op)

    def wait(self, handle: Any) -> torch.Tensor | list[torch.Tensor]:
        if not isinstance(handle, _Started):
            return self.fallback.wait(handle)
        handle.work.wait()
        op = handle.op
        if isinstance(op, AllReduce):
            if handle.into is not None:
                return handle.into.copy_(handle.result)
            return handle.result.to(op.tensor.dtype)
        pieces, dtype = handle.result
        return [piece.view(dtype) for piece in pieces]

    def _all_gather(self, op: AllGather) -> _Started:
        # Collectives that only move data send bytes: every dtype, bit for bit.
        assert op.sizes is not None
        tensor = op.tensor.contiguous().reshape(-1)
        item = tensor.element_size()
        if tensor.numel() != op.sizes[self.rank]:
            raise ValueError(f"all-gather: this rank's tensor has {tensor.numel()} elements, "
                             f"its size says {op.sizes[self.rank]}")
        longest = max(op.sizes) * item
        sent = tensor.view(torch.uint8)
        if sent.numel() < longest:
            sent = torch.cat([sent, sent.new_zeros(longest - sent.numel())])
        output = sent.new_empty(longest * self.size)
        work = dist.all_gather_into_tensor(output, sent, group=self.group, async_op=True)
        pieces = [output[r * longest:r * longest + n * item] for r, n in enumerate(op.sizes)]
        return _Started(op, work, (pieces, tensor.dtype))

    def _all_to_all(self, op: AllToAll) -> _Started:
        tensor = op.tensor.contiguous().reshape(-1)
        item = tensor.element_size()
        if sum(op.splits) != tensor.numel() or len(op.splits) != self.size:
            raise ValueError(f"all-to-all: splits {list(op.splits)} do not cut a tensor of "
                             f"{tensor.numel()} elements into {self.size} parts")
        sent = tensor.view(torch.uint8)
        receive = op.splits[self.rank] * item
        output = sent.new_empty(receive * self.size)
        work = dist.all_to_all_single(output, sent, [receive] * self.size,
                                      [n * item for n in op.splits], group=self.group,
                                      async_op=True)
        return _Started(op, work, (list(torch.split(output, receive)), tensor.dtype))


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                 struct.pack("256s", interface[:15].encode()))
        except OSError as exc:
            raise ValueError(f"network interface {interface!r} has no IPv4 address "
                             f"({exc}); set GLOO_SOCKET_IFNAME to one that does") from exc
    return socket.inet_ntoa(packed[20:24])


def _interface() -> str | None:
    """The interface the Gloo group uses: ``$GLOO_SOCKET_IFNAME``, else the one
    ``horovodrun`` chose for Horovod's own Gloo (``$HOROVOD_GLOO_IFACE``)."""
    return os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("HOROVOD_GLOO_IFACE")


def horovod_gloo_group(hvd: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A Gloo process group over Horovod's global ranks, made once per process.

    If ``torch.distributed`` is already initialized (with Horovod's ranks), its default
    group is used. Otherwise rank 0 opens a ``TCPStore`` on a free port, Horovod broadcasts
    its address, and every rank joins ``torch.distributed``'s default group through it.
    The address is ``$MASTER_ADDR`` if set, else that of the interface in
    ``$GLOO_SOCKET_IFNAME`` or ``$HOROVOD_GLOO_IFACE`` (``horovodrun`` sets it), else the
    host name's; Gloo's own connections use that interface too.
    """
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (hvd.rank(), hvd.size()):
            raise ValueError(f"torch.distributed is initialized with rank "
                             f"{dist.get_rank()} of {dist.get_world_size()}, Horovod with "
                             f"{hvd.rank()} of {hvd.size()}; collectives='gloo' needs the "
                             "same ranks")
        if dist.get_backend() != "gloo":
            return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return dist.group.WORLD
    interface = _interface()
    if interface and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    found: tuple[str, int] | str = ""  # rank 0's store address, or what went wrong
    if hvd.rank() == 0:
        try:
            given = os.environ.get("MASTER_ADDR")
            try:
                host = socket.gethostbyname(given) if given else interface_address(
                    interface) if interface else socket.gethostbyname(socket.gethostname())
            except socket.gaierror as exc:
                raise ValueError(f"{given or socket.gethostname()!r} does not resolve "
                                 f"({exc}); set MASTER_ADDR to rank 0's address or "
                                 "GLOO_SOCKET_IFNAME to its interface") from exc
            if host.startswith("127.") and hvd.cross_size() > 1:
                raise ValueError(f"rank 0's address is {host}, a loopback address, but the "
                                 f"job spans {hvd.cross_size()} hosts; set GLOO_SOCKET_IFNAME "
                                 "to the interface between the hosts (or MASTER_ADDR to rank "
                                 "0's address)")
            store = dist.TCPStore(host, int(os.environ.get("MASTER_PORT") or 0), hvd.size(),
                                  is_master=True, timeout=timeout, wait_for_workers=False)
            found = (host, store.port)
        except (OSError, ValueError, RuntimeError) as exc:
            found = str(exc)
    # Every rank learns rank 0's outcome, so a failure there fails every rank at once.
    found = hvd.broadcast_object(found, root_rank=0, name="hvd_compress.gloo.store")
    if isinstance(found, str):
        raise ValueError(f"collectives='gloo' could not set up its Gloo group on rank 0: "
                         f"{found}")
    if store is None:
        store = dist.TCPStore(found[0], found[1], hvd.size(), is_master=False,
                              timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("hvd_compress", store),
                            rank=hvd.rank(), world_size=hvd.size(), timeout=timeout)
    return dist.group.WORLD
