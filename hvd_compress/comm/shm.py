"""The in-host communicator of two-level compression over shared memory.

The ranks of one host reach each other through files in ``/dev/shm`` instead of
Horovod's collectives over loopback TCP (each of which costs a negotiation and a trip
through the kernel's network stack, on the cores that also compute the gradients). It is
the CPU host's analogue of NVLink: :func:`hvd_compress.hierarchy.horovod_host_communicators`
chooses it when every rank of a host can open its peers' segments
(``$HVD_COMPRESS_HOST_SHM``: ``auto``, the default; ``0`` keeps Horovod's route; ``1``
makes it required). See docs/user-guide.md#two-level-compression.

Each local rank owns one segment: a header (its sequence counter and pid) and two slots
of ``capacity`` bytes, each with its payload size. A collective moves every rank's payload
in rounds of ``capacity`` bytes: a rank writes its next window into the slot of the
round's parity, publishes its counter, waits until every peer's counter has reached it
(a spin, then sleeps), and copies what it needs from its peers' slots. Alternating slots
means a rank writes a slot again only after every peer has passed the next round, so one
barrier per round suffices. Counters are 8-byte aligned stores, ordered after the data by
x86-64's total store order: :func:`supported` is false on other machines (they keep the
Horovod route).

Results are those of the Horovod route bit for bit: all-gathers and all-to-alls move
bytes; an all-reduce sums in local rank order
(:func:`~hvd_compress.comm.two_level.sum_in_order`), as the dense host sum does.

Segments are unlinked once every rank of the host has attached (during
:func:`open_host`), so ``/dev/shm`` holds no name after setup even if a rank is killed;
the memory is freed when the last rank that maps it exits. A rank whose peer died raises
``RuntimeError`` naming it at its next collective instead of waiting forever.
"""

from __future__ import annotations

import errno
import mmap
import os
import platform
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hvd_compress.comm.ops import AllGather, AllReduce, AllToAll, Collective
from hvd_compress.comm.two_level import sum_in_order
from hvd_compress.native import buffers

SHM_ENV = "HVD_COMPRESS_HOST_SHM"
"""``auto`` (default): shared memory inside a host where its ranks share ``/dev/shm``;
``0``: Horovod's process sets (loopback TCP); ``1``: shared memory or an error."""
SHM_MB_ENV = "HVD_COMPRESS_HOST_SHM_MB"
"""Each slot's capacity in MiB (default 4: each rank's segment holds two slots)."""
SHM_TIMEOUT_ENV = "HVD_COMPRESS_HOST_SHM_TIMEOUT"
"""Seconds a rank waits for its host's peers at one collective before raising (default
600)."""
SHM_DIR = "/dev/shm"
HEADER = 64  # bytes: counter, pid, then each slot's payload size
_SEQ, _PID, _SIZES = 0, 1, 2  # int64 words of the header


def mode() -> str:
    """``$HVD_COMPRESS_HOST_SHM`` as ``"auto"``, ``"off"`` or ``"on"`` (``ValueError``
    otherwise)."""
    value = os.environ.get(SHM_ENV, "auto").strip().lower()
    modes = {"auto": "auto", "": "auto", "0": "off", "off": "off", "1": "on", "on": "on"}
    if value not in modes:
        raise ValueError(f"${SHM_ENV} must be auto, 0 or 1, got {value!r}")
    return modes[value]


def capacity_from_env() -> int:
    """Each slot's bytes from ``$HVD_COMPRESS_HOST_SHM_MB`` (default 4 MiB)."""
    raw = os.environ.get(SHM_MB_ENV, "4")
    try:
        mib = float(raw)
        if mib <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"${SHM_MB_ENV} must be a positive number of MiB, got {raw!r}") \
            from None
    return max(4096, int(mib * 2**20) // 64 * 64)


def supported() -> bool:
    """Whether this machine orders the segment's stores as the protocol needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def segment_bytes(capacity: int) -> int:
    """The size of one rank's segment with slots of ``capacity`` bytes."""
    return HEADER + 2 * capacity


class Segment:
    """One rank's mapped segment (its own or a peer's): the header's int64 words and the
    two slots as uint8 tensors."""

    def __init__(self, fd: int, capacity: int) -> None:
        self.map = mmap.mmap(fd, segment_bytes(capacity))
        self.header = np.frombuffer(self.map, dtype=np.int64, count=HEADER // 8)
        data = torch.frombuffer(self.map, dtype=torch.uint8, offset=HEADER,
                                count=2 * capacity)
        self.slots = (data[:capacity], data[capacity:])

    def close(self) -> None:
        self.header = None  # type: ignore[assignment]
        self.slots = ()  # type: ignore[assignment]
        try:
            self.map.close()
        except BufferError:  # a tensor still viewing it: freed with the process
            pass


def create(name: str, capacity: int) -> Segment:
    """Create and map ``/dev/shm/<name>``, its memory reserved now (so that a full
    ``/dev/shm`` fails here, with the size needed and the opt-out, not as a SIGBUS later)."""
    path = os.path.join(SHM_DIR, name)
    size = segment_bytes(capacity)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.unlink(path)
            need = "no space" if exc.errno == errno.ENOSPC else exc.strerror
            raise OSError(exc.errno, (
                f"cannot reserve {size / 2**20:.1f} MiB in {SHM_DIR} for hierarchy='host''s "
                f"in-host segment ({need}): enlarge {SHM_DIR} (docker run --shm-size), "
                f"lower ${SHM_MB_ENV} (now {capacity / 2**20:g}), or set {SHM_ENV}=0 for "
                "Horovod's route")) from exc
        segment = Segment(fd, capacity)
    finally:
        os.close(fd)
    segment.header[:] = 0
    segment.header[_PID] = os.getpid()
    return segment


def attach(name: str, capacity: int) -> Segment:
    """Map a peer's ``/dev/shm/<name>`` (``OSError`` if this rank cannot see it)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        if os.fstat(fd).st_size < segment_bytes(capacity):
            raise OSError(errno.EINVAL, f"{name} is smaller than {segment_bytes(capacity)}")
        return Segment(fd, capacity)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    """Remove the name (the mappings stay valid); nothing if it is gone already."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


@dataclass
class _Handle:
    name: str
    op: Collective
    result: Any = None
    done: bool = False
    owned: list[Any] = field(default_factory=list)


class ShmHostCommunicator:
    """All-gathers, all-to-alls and all-reduces among the ranks of one host, over their
    shared-memory segments (module docstring).

    Args:
        rank, size: this local rank and the host's ranks.
        segments: every local rank's mapped segment, in local rank order (this rank's own
            at ``rank``).
        capacity: each slot's bytes.
        timeout: seconds to wait for the peers at one collective before ``RuntimeError``.

    ``start`` records the request; ``wait`` runs it, so every rank must wait its requests
    in one order: ``ordered`` is true and the pipelines then start and wait them in an
    order every rank reproduces. Tensors on a device are staged through the host.
    """

    def __init__(self, rank: int, size: int, segments: Sequence[Segment], capacity: int,
                 timeout: float = 600.0) -> None:
        if len(segments) != size:
            raise ValueError(f"{size} ranks but {len(segments)} segments")
        self.rank, self.size = rank, size
        self.segments = list(segments)
        self.capacity = capacity
        self.timeout = timeout
        self.ordered = True
        self.seq = int(self.segments[rank].header[_SEQ])
        self.pids = [int(s.header[_PID]) for s in self.segments]
        self.barrier_seconds = 0.0  # time spent waiting for peers (a diagnostic)

    def close(self) -> None:
        """Unmap the segments (their names are gone already)."""
        for segment in self.segments:
            segment.close()
        self.segments = []

    # The protocol ------------------------------------------------------------------------
    def _barrier(self, what: str) -> None:
        """Publish this rank's next counter and wait until every peer has reached it."""
        self.seq += 1
        seq = self.seq
        self.segments[self.rank].header[_SEQ] = seq
        headers = [s.header for s in self.segments]
        if all(h[_SEQ] >= seq for h in headers):
            return
        started = time.perf_counter()
        spins, pause, checked = 0, 2e-5, started
        while True:
            late = [r for r, h in enumerate(headers) if h[_SEQ] < seq]
            if not late:
                break
            spins += 1
            if spins < 20:
                os.sched_yield()
                continue
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
            now = time.perf_counter()
            if now - checked > 1.0:
                checked = now
                self._check_alive(late, what, now - started)
        self.barrier_seconds += time.perf_counter() - started

    def _check_alive(self, late: list[int], what: str, waited: float) -> None:
        for r in late:
            try:
                os.kill(self.pids[r], 0)
            except ProcessLookupError:
                raise RuntimeError(
                    f"local rank {r} of this host (pid {self.pids[r]}) exited during {what!r}: "
                    "the job cannot continue") from None
            except PermissionError:
                pass
        if waited > self.timeout:
            raise RuntimeError(
                f"local ranks {late} of this host did not reach {what!r} within "
                f"{self.timeout:g} s (${SHM_TIMEOUT_ENV})")

    def _exchange(self, what: str, mine: torch.Tensor,
                  take: Callable[[int, int, torch.Tensor], None],
                  begin: Callable[[list[int]], None] | None = None) -> None:
        """Move every rank's bytes (``mine``: this rank's, flat uint8) in windows of
        ``capacity``: ``begin(sizes)`` once every rank's byte count is known, then
        ``take(source, offset, window)`` for each rank's window (this rank's own too), in
        local rank order."""
        total = mine.numel()
        offset, sizes, rounds, k = 0, None, 1, 0
        while k < rounds:
            segment = self.segments[self.rank]
            parity = self.seq % 2
            window = mine[offset:offset + self.capacity]
            segment.slots[parity][:window.numel()].copy_(window)
            segment.header[_SIZES + parity] = total
            self._barrier(what)
            if sizes is None:
                sizes = [int(s.header[_SIZES + parity]) for s in self.segments]
                rounds = max(1, -(-max(sizes) // self.capacity))
                if begin is not None:
                    begin(sizes)
            for r, peer in enumerate(self.segments):
                n = min(self.capacity, sizes[r] - offset)
                if n > 0:
                    take(r, offset, peer.slots[parity][:n])
            offset += self.capacity
            k += 1
        # The last round's slot is written again two barriers later, which every peer
        # passes only once it has read it.

    # Communicator ------------------------------------------------------------------------
    def start(self, name: str, op: Collective) -> _Handle:
        if not isinstance(op, AllGather | AllToAll | AllReduce):
            raise TypeError(f"{type(self).__name__} runs all-gathers, all-to-alls and "
                            f"all-reduces inside a host, got {type(op).__name__} for {name!r}")
        return _Handle(name, op)

    def wait(self, handle: _Handle) -> torch.Tensor | list[torch.Tensor]:
        if handle.done:
            return handle.result
        op = handle.op
        tensor = _flat(op.tensor)
        device = op.tensor.device
        if isinstance(op, AllToAll):
            lo, hi = self._split(handle.name, op, tensor)
            parts = [buffers.empty(hi - lo, tensor.dtype) for _ in range(self.size)]
            into = [_bytes(p) for p in parts]
            item = tensor.element_size()

            def take(source: int, offset: int, window: torch.Tensor) -> None:
                a, b = max(lo * item, offset), min(hi * item, offset + window.numel())
                if a < b:
                    into[source][a - lo * item:b - lo * item].copy_(
                        window[a - offset:b - offset])

            self._exchange(handle.name, _bytes(tensor), take)
            result: Any = [p.to(device) for p in parts]
        else:
            parts = self._gather(handle.name, tensor)
            if isinstance(op, AllGather):
                if op.sizes is not None:
                    got = [p.numel() for p in parts]
                    if got != list(op.sizes):
                        raise RuntimeError(f"{handle.name}: all-gather got {got} elements "
                                           f"per rank, expected {list(op.sizes)}")
                    result = [p.to(device) for p in parts]
                else:
                    result = [torch.cat(parts).to(device)]
            else:
                summed = sum_in_order(parts).view(op.tensor.shape)
                if op.inplace:
                    op.tensor.copy_(summed)
                    summed = op.tensor
                result = summed.to(device)
        handle.result, handle.done = result, True
        return result

    def wait_sum(self, handle: _Handle) -> torch.Tensor:
        """The sum in local rank order of what an :class:`AllToAll` brings this rank
        (:func:`~hvd_compress.comm.two_level.sum_in_order` of :meth:`wait`'s parts, bit for
        bit), added up window by window as the peers' slots fill, with no copy of the
        parts: the dense host sum's reduce-scatter."""
        op = handle.op
        if not isinstance(op, AllToAll):
            raise TypeError(f"{handle.name}: wait_sum needs an all-to-all")
        tensor = _flat(op.tensor)
        lo, hi = self._split(handle.name, op, tensor)
        dtype = tensor.dtype
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        summed = buffers.empty(hi - lo, wide)
        item = tensor.element_size()

        def take(source: int, offset: int, window: torch.Tensor) -> None:
            a, b = max(lo * item, offset), min(hi * item, offset + window.numel())
            if a >= b:
                return
            part = window[a - offset:b - offset].view(dtype)
            out = summed[(a - lo * item) // item:(b - lo * item) // item]
            if source == 0:
                out.copy_(part)
            else:
                out += part

        self._exchange(handle.name, _bytes(tensor), take)
        handle.result, handle.done = None, True
        return summed.to(dtype).to(op.tensor.device)

    def wait_into(self, handle: _Handle,
                  places: Sequence[Sequence[tuple[int, torch.Tensor]]]) -> None:
        """Run an :class:`AllGather` whose every rank's payload goes straight to where it
        belongs, without a copy of the parts: ``places[r]`` lists ``(element offset in rank
        r's payload, flat destination)``, destinations contiguous tensors of the payload's
        dtype on the CPU. ``RuntimeError`` if a rank's payload does not have the elements
        its places cover."""
        op = handle.op
        if not isinstance(op, AllGather):
            raise TypeError(f"{handle.name}: wait_into needs an all-gather")
        tensor = _flat(op.tensor)
        item = tensor.element_size()
        spans = [[(at * item, target.view(torch.uint8)) for at, target in placed if
                  target.numel()] for placed in places]

        def begin(sizes: list[int]) -> None:
            want = [max((a + t.numel() for a, t in span), default=0) for span in spans]
            if any(w > n for w, n in zip(want, sizes, strict=True)):
                raise RuntimeError(f"{handle.name}: all-gather got {sizes} bytes per rank, "
                                   f"its places cover {want}")

        def take(source: int, offset: int, window: torch.Tensor) -> None:
            end = offset + window.numel()
            for at, target in spans[source]:
                a, b = max(at, offset), min(at + target.numel(), end)
                if a < b:
                    target[a - at:b - at].copy_(window[a - offset:b - offset])

        self._exchange(handle.name, _bytes(tensor), take, begin)
        handle.result, handle.done = None, True

    def _split(self, name: str, op: AllToAll, tensor: torch.Tensor) -> tuple[int, int]:
        """The elements ``[lo, hi)`` of every sender's tensor that come to this rank."""
        if len(op.splits) != self.size or sum(op.splits) != tensor.numel():
            raise ValueError(f"{name}: splits {list(op.splits)} do not cut "
                             f"{tensor.numel()} elements among {self.size} ranks")
        lo = sum(op.splits[:self.rank])
        return lo, lo + op.splits[self.rank]

    def _gather(self, name: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's flat tensor (of this one's dtype), in local rank order."""
        received: list[torch.Tensor] = []

        def begin(sizes: list[int]) -> None:  # recycled pages: no faults on the first write
            received.extend(buffers.empty(n, torch.uint8) for n in sizes)

        def take(source: int, offset: int, window: torch.Tensor) -> None:
            received[source][offset:offset + window.numel()].copy_(window)

        self._exchange(name, _bytes(tensor), take, begin)
        return [b.view(tensor.dtype) if b.numel() else torch.empty(0, dtype=tensor.dtype)
                for b in received]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous flat host copy or view of a request's tensor."""
    return tensor.detach().reshape(-1).contiguous().cpu()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous flat tensor (an empty uint8 tensor for no elements)."""
    return tensor.view(torch.uint8) if tensor.numel() else torch.empty(0, dtype=torch.uint8)


def open_host(local_rank: int, local_size: int, host: int,
              exchange: Callable[[Any], list[Any]], required: bool = False,
              capacity: int | None = None) -> ShmHostCommunicator | None:
    """The host's :class:`ShmHostCommunicator`, or ``None`` where its ranks do not share
    ``/dev/shm`` (and not ``required``). Collective over the whole job: ``exchange(obj)``
    returns every rank's ``obj`` in rank order (``hvd.allgather_object``), called twice
    by every rank. Every rank creates its segment, attaches its host's peers',
    agrees, then unlinks its own, so no name outlives this call. ``OSError`` on every rank
    if any rank cannot create its segment (the message names the size needed and the
    opt-out); ``RuntimeError`` if ``required`` and a host cannot share memory."""
    capacity = capacity or capacity_from_env()
    name = f"hvdc-{uuid.uuid4().hex[:12]}-h{host}-l{local_rank}"
    segment: Segment | None = None
    error = None
    try:
        segment = create(name, capacity)
    except OSError as exc:
        error = str(exc)
    everyone = exchange((host, local_rank, name, error))
    try:
        failed = [(i, e) for i, (_, _, _, e) in enumerate(everyone) if e]
        if failed:
            raise OSError(errno.ENOSPC, f"rank {failed[0][0]}: {failed[0][1]}")
        peers = {lr: n for h, lr, n, _ in everyone if h == host}
        segments: list[Segment] = []
        problem = None
        try:
            for lr in range(local_size):
                segments.append(segment if lr == local_rank else attach(peers[lr], capacity))
        except (OSError, KeyError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        agreed = exchange((host, problem))
    finally:
        unlink(name)
    problems = [p for h, p in agreed if h == host and p]
    if problems:
        for s in segments:
            s.close()
        if segment is not None and segment not in segments:
            segment.close()
        if required:
            raise RuntimeError(f"${SHM_ENV}=1 but this host's ranks cannot share "
                               f"{SHM_DIR}: {problems[0]}")
        return None
    # Every peer attached before the second exchange, so the first collective's writes
    # reach them all.
    return ShmHostCommunicator(local_rank, local_size, segments, capacity,
                               timeout=float(os.environ.get(SHM_TIMEOUT_ENV, 600)))
