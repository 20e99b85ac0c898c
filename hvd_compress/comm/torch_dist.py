"""Communicator over a ``torch.distributed`` process group (Gloo or NCCL), beside Horovod or
on its own.

Horovod starts every collective from its background loop, once per ``HOROVOD_CYCLE_TIME``
cycle and after a negotiation by name, so a scheme with several rounds per step
(PowerSGD's ``P`` then ``Q``) waits for a cycle per round. :class:`TorchDistCommunicator`
starts the pipeline's all-reduces, fixed-size all-gathers and all-to-alls at once on the
group, as DDP's communication hooks do (``async_op=True``, then ``Work.wait()``): ``gloo``
for CPU tensors (``collectives="gloo"``), ``nccl`` for CUDA tensors
(``collectives="nccl"``). See docs/design.md for the comparison with Horovod's loop.

Top-k's sums (:class:`~hvd_compress.comm.sparse_frames.PairsSum`, a bucket's as one
:class:`~hvd_compress.comm.sparse_frames.FramesSum`) go on the group, unless the fallback
sends them to a parameter server (``gathers_frames`` is false). Every rank sends the same
number of pairs, so every rank knows the most bytes a rank's frames can take
(:func:`~hvd_compress.comm.sparse_frames.frames_bound`), and one all-gather of that size,
each rank's frames behind their length, starts at once. They are the frames a Horovod
``allgather`` carries, summed the same way, so the sums are the same bits. Other
self-delimiting all-gathers (``sizes=None``) and sparse sums go through ``fallback`` when
there is one (Horovod, or a parameter server around it); without one the group carries
them in two collectives, the byte counts and then the bytes padded to the longest.

Invariant: collectives are matched by the order they start, not by name. The pipeline
starts them in an order every rank reproduces when every rank submits the same tensors
(planned buckets in plan order); a rank that starts a different sequence makes the backend
fail with a size mismatch or a timeout, or, for requests of equal size, sums the wrong
tensors. ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` checks every collective across ranks.

An all-to-all's ``splits`` must be the same on every sender (the fusion contract of
:class:`~hvd_compress.comm.ops.AllToAll`, which every scheme here meets): the backend needs
the receive sizes in advance, and they are ``splits[rank]`` from every source.

This module imports neither Horovod nor TensorFlow: with ``fallback=None`` the pipeline runs
on ``torch.distributed`` alone (``tests/test_torch_dist.py`` does, on a bare CUDA machine
too). :func:`horovod_group` takes Horovod's module as an argument.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hvd_compress.comm.base import SUM_AS, Communicator
from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective, SparseSum
from hvd_compress.comm.sparse_frames import FramesSum, encode_frames, frames_bound, sum_gathered

BACKENDS = ("gloo", "nccl")
"""The ``torch.distributed`` backends the communicator runs on."""

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a collective may wait for the other ranks before it raises."""

_SIOCGIFADDR = 0x8915

_LENGTH = np.dtype("<u8")
"""What precedes a rank's frames in a bounded all-gather (:meth:`TorchDistCommunicator.
_gather_bounded`): their length in bytes."""


@dataclass
class _Started:
    op: Collective
    work: Any
    result: Any  # what the collective writes into
    into: torch.Tensor | None = None  # an in-place all-reduce summed in another dtype


@dataclass
class _Bounded:
    """An all-gather of every rank's frames, each in a slot of ``slot`` bytes (its length,
    then its frames, then zeros): :meth:`TorchDistCommunicator._gather_bounded`."""

    op: SparseSum | FramesSum
    work: Any
    output: torch.Tensor
    slot: int


@dataclass
class _Counted:
    """A variable-size all-gather whose byte counts are in flight (:meth:`_gather_counts`)."""

    op: AllGather | SparseSum | FramesSum
    work: Any
    counts: torch.Tensor
    sent: torch.Tensor  # this rank's bytes, on the collective's device
    dtype: torch.dtype  # what the gathered bytes are views of


class TorchDistCommunicator:
    """The pipeline's collectives on the ``torch.distributed`` process group ``group``.

    ``fallback``: the communicator for self-delimiting all-gathers and sparse sums
    (Horovod's, or a parameter server's around it); it must hold the group's ranks in the
    same order. ``None``: the group carries those too (module docstring).

    On an NCCL group every tensor a collective sends must be on this process's CUDA device
    (the pipeline's requests are on the gradients' device; the host-side frames of sparse
    sums are moved there and back).
    """

    ordered = True
    """Collectives are matched by start order (see :class:`~hvd_compress.pipeline.Pipeline`)."""

    @property
    def gathers_frames(self) -> bool:
        """Whether a bucket's top-k sums may travel as one
        :class:`~hvd_compress.comm.sparse_frames.FramesSum`: the group gathers sparse sums'
        frames itself (no ``fallback``), or its fallback does (Horovod's)."""
        return self.fallback is None or bool(getattr(self.fallback, "gathers_frames", False))

    def __init__(self, group: Any = None, fallback: Communicator | None = None) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.backend = str(dist.get_backend(self.group)).lower()
        self.fallback = fallback
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)
        if fallback is not None and (self.rank, self.size) != (fallback.rank, fallback.size):
            raise ValueError(f"the {self.backend} group's rank {self.rank} of {self.size} "
                             f"differs from Horovod's rank {fallback.rank} of {fallback.size}; "
                             "the group must hold Horovod's ranks in Horovod's order")
        # Where the byte counts and host frames travel: NCCL only moves CUDA tensors.
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if self.backend == "nccl" else torch.device("cpu")

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
        if isinstance(op, SparseSum | FramesSum) and self.gathers_frames:
            bound = frames_bound(name, op)  # None: counts may differ, see the module's doc
            if bound is not None:
                return self._gather_bounded(name, op, bound)
        if self.fallback is not None:
            return self.fallback.start(name, op)
        if isinstance(op, SparseSum | FramesSum):
            frame = torch.frombuffer(bytearray(encode_frames(name, self.rank, op)),
                                     dtype=torch.uint8)
            return self._gather_counts(op, frame, torch.uint8)
        if isinstance(op, AllGather):
            tensor = op.tensor.contiguous().reshape(-1)
            return self._gather_counts(op, tensor.view(torch.uint8), tensor.dtype)
        raise TypeError(f"unknown collective request {op!r}")

    def wait(self, handle: Any) -> Any:
        if isinstance(handle, _Counted):
            return self._gather_bytes(handle)
        if isinstance(handle, _Bounded):
            return self._bounded_arrived(handle)
        if not isinstance(handle, _Started):
            assert self.fallback is not None
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

    def _gather_bounded(self, name: str, op: SparseSum | FramesSum, bound: int) -> _Bounded:
        """Start one all-gather of every rank's frames of ``op``: a slot of the length,
        then the frames, padded with zeros to ``bound``, the most any rank's take."""
        frames = encode_frames(name, self.rank, op)
        if len(frames) > bound:  # frame_bound is wrong: never send a slot others misread
            raise RuntimeError(f"sparse sum {name!r}: rank {self.rank}'s frames take "
                               f"{len(frames)} bytes, more than their bound of {bound}")
        slot = _LENGTH.itemsize + bound
        sent = torch.zeros(slot, dtype=torch.uint8)
        host = sent.numpy()
        host[:_LENGTH.itemsize] = np.array([len(frames)], _LENGTH).view(np.uint8)
        host[_LENGTH.itemsize:_LENGTH.itemsize + len(frames)] = np.frombuffer(frames, np.uint8)
        sent = sent.to(self.device)
        output = sent.new_empty(slot * self.size)
        work = dist.all_gather_into_tensor(output, sent, group=self.group, async_op=True)
        return _Bounded(op, work, output, slot)

    def _bounded_arrived(self, handle: _Bounded) -> Any:
        """The sums of a bounded all-gather: each rank's frames cut from its slot by their
        length, summed in rank order (:func:`~hvd_compress.comm.sparse_frames.
        sum_gathered`)."""
        handle.work.wait()
        slots = handle.output.cpu().numpy().reshape(self.size, handle.slot)
        lengths = slots[:, :_LENGTH.itemsize].copy().view(_LENGTH).reshape(-1)
        longest = handle.slot - _LENGTH.itemsize
        for rank, length in enumerate(lengths.tolist()):
            if length > longest:
                raise RuntimeError(f"sparse sum {handle.op.round!r}: rank {rank} says its "
                                   f"frames take {length} bytes, more than the "
                                   f"{longest} every rank reserved (ranks disagree on the "
                                   "pairs each sends)")
        return sum_gathered(handle.op, np.concatenate(
            [slot[_LENGTH.itemsize:_LENGTH.itemsize + n] for slot, n in zip(slots, lengths)]))

    def _gather_counts(self, op: AllGather | SparseSum | FramesSum, data: torch.Tensor,
                       dtype: torch.dtype) -> _Counted:
        """Start the first of a variable-size all-gather's two collectives: every rank's
        byte count."""
        sent = data.to(self.device)
        count = torch.tensor([sent.numel()], dtype=torch.int64, device=self.device)
        counts = torch.empty(self.size, dtype=torch.int64, device=self.device)
        work = dist.all_gather_into_tensor(counts, count, group=self.group, async_op=True)
        return _Counted(op, work, counts, sent, dtype)

    def _gather_bytes(self, handle: _Counted) -> torch.Tensor | list[torch.Tensor]:
        """The second collective: every rank's bytes, padded to the longest. A sparse sum's
        frames are then summed in rank order (:func:`~hvd_compress.comm.sparse_frames.
        sum_gathered`); an all-gather's bytes are concatenated in rank order."""
        handle.work.wait()
        counts = handle.counts.tolist()  # the sizes decide the buffer: one host read
        longest = max(counts)
        sent = handle.sent
        if sent.numel() < longest:
            sent = torch.cat([sent, sent.new_zeros(longest - sent.numel())])
        output = sent.new_empty(longest * self.size)
        dist.all_gather_into_tensor(output, sent, group=self.group)
        joined = torch.cat([output[r * longest:r * longest + n] for r, n in enumerate(counts)])
        op = handle.op
        if isinstance(op, SparseSum | FramesSum):
            return sum_gathered(op, joined.cpu().numpy())
        return [joined.view(handle.dtype).to(op.tensor.device)]


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
    """The interface the group's store (and Gloo) uses: ``$GLOO_SOCKET_IFNAME``, else the
    one ``horovodrun`` chose for Horovod's own Gloo (``$HOROVOD_GLOO_IFACE``)."""
    return os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("HOROVOD_GLOO_IFACE")


def check_nccl(devices: Iterable[torch.device]) -> None:
    """Refuse ``collectives="nccl"`` with a ``ValueError`` that says what to change, unless
    this torch has NCCL (``torch.distributed.is_nccl_available()``), CUDA is available, and
    every tensor to exchange (``devices``: the parameters') is on this process's current
    CUDA device (``torch.cuda.set_device(hvd.local_rank())`` before ``model.cuda()``)."""
    if not dist.is_available() or not dist.is_nccl_available():
        raise ValueError(f"collectives='nccl' needs a torch built with NCCL, and "
                         f"torch.distributed.is_nccl_available() is False for torch "
                         f"{torch.__version__} here (a CPU build, or one without NCCL); use "
                         "collectives='gloo' for CPU tensors or collectives='horovod'")
    if not torch.cuda.is_available():
        raise ValueError("collectives='nccl' sums CUDA tensors, and torch.cuda.is_available() "
                         "is False in this process (no GPU, no driver, or "
                         "CUDA_VISIBLE_DEVICES hides them); use collectives='gloo' for CPU "
                         "tensors or collectives='horovod'")
    current = torch.device("cuda", torch.cuda.current_device())
    elsewhere = sorted({str(d) for d in map(torch.device, devices) if d != current
                        and not (d.type == "cuda" and d.index is None)})
    if elsewhere:
        raise ValueError(f"collectives='nccl' exchanges on this process's CUDA device "
                         f"({current}), but parameters are on {', '.join(elsewhere)}: call "
                         "torch.cuda.set_device(hvd.local_rank()) and model.cuda() before "
                         "building the optimizer, or use collectives='gloo' for a model on "
                         "the CPU")


def horovod_group(hvd: Any, backend: str = "gloo",
                  timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """A ``torch.distributed`` group of ``backend`` over Horovod's global ranks, made once
    per process (``hvd``: ``horovod.torch``, started).

    If ``torch.distributed`` is already initialized (with Horovod's ranks), its default
    group is used when its backend is ``backend``, else a new group of ``backend`` over
    the same ranks. Otherwise rank 0 opens a ``TCPStore`` on a free port, Horovod
    broadcasts its address, and every rank joins ``torch.distributed``'s default group
    through it. The address is ``$MASTER_ADDR`` if set, else that of the interface in
    ``$GLOO_SOCKET_IFNAME`` or ``$HOROVOD_GLOO_IFACE`` (``horovodrun`` sets it), else the
    host name's; Gloo's own connections use that interface too (NCCL chooses its own, see
    ``NCCL_SOCKET_IFNAME``).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    what = f"collectives={backend!r}"
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (hvd.rank(), hvd.size()):
            raise ValueError(f"torch.distributed is initialized with rank "
                             f"{dist.get_rank()} of {dist.get_world_size()}, Horovod with "
                             f"{hvd.rank()} of {hvd.size()}; {what} needs the same ranks")
        if str(dist.get_backend()).lower() != backend:
            return dist.new_group(backend=backend, timeout=timeout)
        return dist.group.WORLD
    interface = _interface()
    if interface and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = interface
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
        label = {"gloo": "Gloo", "nccl": "NCCL"}[backend]
        raise ValueError(f"{what} could not set up its {label} group on rank 0: {found}")
    if store is None:
        store = dist.TCPStore(found[0], found[1], hvd.size(), is_master=False,
                              timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("hvd_compress", store),
                            rank=hvd.rank(), world_size=hvd.size(), timeout=timeout)
    return dist.group.WORLD
