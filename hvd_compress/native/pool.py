"""Recycled memory for large arrays that recur at the same sizes (a step's decoded chunks
and casts, a server round's sums and decoded indices).

A fresh large allocation is a fresh anonymous ``mmap``: writing it first costs a page fault
and the kernel zeroing every page, which can cost as much as the work that fills it. A
:class:`BlockPool` lends blocks of pooled anonymous mappings instead, as uint8 numpy arrays:
a block is lent to one array (and whatever views or tensors are made over it) at a time,
and is free again once a weak reference to that array is dead. Block sizes are rounded up
to whole 2 MiB huge pages (requested with ``madvise`` where Linux offers it), so near sizes
share blocks; blocks not lent for ``idle_leases`` leases are unmapped, so a pool holds about
the recent peak. Imports no torch: the parameter server uses it too.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass

import numpy as np

BLOCK_ROUND = 2 << 20
"""Block sizes are rounded up to whole 2 MiB huge pages, so near sizes share blocks."""


@dataclass
class _Block:
    memory: mmap.mmap
    user: weakref.ref | None = None
    last_lease: int = 0

    def free(self) -> bool:
        return self.user is None or self.user() is None


class BlockPool:
    """Lends uninitialised memory over recycled blocks (the module docstring).

    Args:
        idle_leases: a free block not lent for this many leases is unmapped.
        free_per_size: free blocks kept per block size beyond which the rest are unmapped
            (``None``: no limit but ``idle_leases``).
    """

    def __init__(self, idle_leases: int, free_per_size: int | None = None) -> None:
        self.idle_leases = idle_leases
        self.free_per_size = free_per_size
        self._blocks: dict[int, list[_Block]] = {}
        self._leases = 0
        self._lock = threading.Lock()

    def lend(self, nbytes: int) -> np.ndarray:
        """``nbytes`` uninitialised bytes as a uint8 array, whose block is lent until it and
        every view of it (or tensor over it) are gone."""
        size = -(-nbytes // BLOCK_ROUND) * BLOCK_ROUND
        with self._lock:
            self._leases += 1
            if self._leases % 256 == 0:
                self._unmap_idle()
            same = self._blocks.setdefault(size, [])
            free = [b for b in same if b.free()]
            if self.free_per_size is not None:
                for block in free[self.free_per_size:]:
                    same.remove(block)  # unmapped with its last reference
            if free:
                block = free[0]
            else:
                block = _Block(mmap.mmap(-1, size))
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    block.memory.madvise(mmap.MADV_HUGEPAGE)
                same.append(block)
            lent = np.frombuffer(block.memory, np.uint8, nbytes)
            block.user, block.last_lease = weakref.ref(lent), self._leases
        return lent

    def _unmap_idle(self) -> None:
        for size, same in list(self._blocks.items()):
            same[:] = [b for b in same
                       if not b.free() or self._leases - b.last_lease < self.idle_leases]
            if not same:
                del self._blocks[size]

    def pooled_bytes(self) -> int:
        """Bytes of memory the pool holds, lent or free."""
        with self._lock:
            return sum(size * len(same) for size, same in self._blocks.items())


ARRAY_MIN_BYTES = 1 << 20
"""Arrays of the server's rounds smaller than this come from ``np.empty`` (the C heap
recycles them)."""

POOL = BlockPool(idle_leases=256, free_per_size=4)
"""The pool of the parameter server's rounds: union sums and the pushes' decoded indices."""


def indices_array(count: int) -> np.ndarray:
    """An uninitialised int64 array of ``count`` elements (a push's decoded indices), from
    :data:`POOL` from :data:`ARRAY_MIN_BYTES` on."""
    if 8 * count < ARRAY_MIN_BYTES:
        return np.empty(count, np.int64)
    return POOL.lend(8 * count).view(np.int64)
