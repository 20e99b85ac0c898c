"""Recycled memory for the pushes a round holds, so a round does not fault pages in.

A push of ``n`` pairs decodes into ``8 n`` bytes of int64 indices, and its values are
copied out of the request (so the transport frees the request at once, and the C heap
reuses it for the next one); both are held until the round closes. Above glibc's ``mmap``
threshold (or at the top of its heap, which it trims) each such array is memory the
kernel maps and zeroes afresh: at 8 workers of 42,000 pairs, about 940 page faults a
round, a quarter to a third of the server's CPU for the round in-process (``docs/results/
ps-grpc-5ae705f``). :class:`PushBuffers` lends arrays over anonymous mappings it keeps: a
block is lent to one array (and any views of it) at a time and is free again once that
array is gone (a weak reference tells), so a block is never written while a held push
still reads it. Sizes are rounded up to :data:`GRANULE`, so pushes of
nearby sizes share blocks. What the pool keeps free is bounded: at most ``max_free_bytes``
of free blocks (the least recently lent go first), and a block not lent for
``idle_lends`` lends is unmapped, and every free block when idle tensors expire
(:meth:`PushBuffers.release`); lent blocks count against the server's push budget like
any decoded push.
"""

from __future__ import annotations

import mmap
import threading
import weakref

import numpy as np

GRANULE = 64 << 10
"""Block sizes are multiples of this many bytes."""
MIN_BYTES = 64 << 10
"""Arrays smaller than this come from ``np.empty``: the C heap recycles them."""
TRIM_EVERY = 64
"""Free blocks are checked against the bounds when a block is mapped and every this many
lends (the pool grows only by mapping, so the bounds hold then)."""


class _Block:
    __slots__ = ("lent_at", "memory", "size", "user")

    def __init__(self, size: int) -> None:
        self.memory = mmap.mmap(-1, size)
        self.size = size
        self.user: weakref.ref | None = None
        self.lent_at = 0

    def free(self) -> bool:
        return self.user is None or self.user() is None


class PushBuffers:
    """Lends uninitialised arrays over recycled blocks (see the module docstring).
    Safe to call from any thread."""

    def __init__(self, max_free_bytes: int = 64 << 20, idle_lends: int = 1024) -> None:
        self.max_free_bytes = max_free_bytes
        self.idle_lends = idle_lends
        self._blocks: list[_Block] = []
        self._lends = 0
        self._lock = threading.Lock()

    def lend(self, count: int, dtype: np.dtype | type = np.int64) -> np.ndarray:
        """``count`` uninitialised values of ``dtype``; the memory is lent until the array
        and every view of it are gone."""
        dtype = np.dtype(dtype)
        nbytes = dtype.itemsize * count
        if nbytes < MIN_BYTES:
            return np.empty(count, dtype)
        size = -(-nbytes // GRANULE) * GRANULE
        with self._lock:
            self._lends += 1
            block = None
            for candidate in self._blocks:
                if candidate.size == size and candidate.free():
                    block = candidate
                    break
            mapped = block is None
            if mapped:
                block = _Block(size)
                self._blocks.append(block)
            lent = np.frombuffer(block.memory, dtype, count)
            block.user, block.lent_at = weakref.ref(lent), self._lends
            if mapped or self._lends % TRIM_EVERY == 0:
                self._trim()
        return lent

    def _trim(self) -> None:
        """Unmap free blocks idle for ``idle_lends`` lends, then the least recently lent
        free ones beyond ``max_free_bytes`` (lock held)."""
        kept, free_bytes = [], 0
        for block in sorted(self._blocks, key=lambda b: -b.lent_at):
            if block.free():
                if self._lends - block.lent_at >= self.idle_lends or \
                        free_bytes + block.size > self.max_free_bytes:
                    continue  # unmapped once its mmap has no reference left
                free_bytes += block.size
            kept.append(block)
        self._blocks = kept

    def release(self) -> None:
        """Unmap every free block (the server calls it when idle tensors expire)."""
        with self._lock:
            self._blocks = [block for block in self._blocks if not block.free()]

    def held_bytes(self) -> int:
        """Bytes of the blocks the pool holds, lent or free."""
        with self._lock:
            return sum(block.size for block in self._blocks)
