"""Recycled memory for large CPU outputs (decoded chunks, float16/float32 casts).

A fresh large ``torch.empty`` is a fresh ``mmap``: writing it first costs a page fault and
the kernel zeroing every page, more than a decode or a cast itself. The same sizes recur
every training step, so :func:`empty` hands out tensors over pooled anonymous mappings
instead: a block is lent to one tensor (and its views) at a time and is free again once
torch has released that memory, which a weak reference to the lent ``memoryview`` shows.
New blocks ask for transparent huge pages (Linux ``madvise``); blocks left unused for
:data:`IDLE_LEASES` leases are unmapped, so the pool holds about the recent peak.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from dataclasses import dataclass, field

import torch

POOL_MIN_BYTES = 4 << 20
"""Smaller CPU tensors come from ``torch.empty`` (the C heap already recycles them)."""

BLOCK_ROUND = 2 << 20
"""Block sizes are rounded up to whole 2 MiB huge pages, so near sizes share blocks."""

IDLE_LEASES = 4096
"""A free block not lent for this many leases is unmapped."""


@dataclass
class _Block:
    memory: mmap.mmap
    user: weakref.ref | None = None
    last_lease: int = 0

    def free(self) -> bool:
        return self.user is None or self.user() is None


@dataclass
class _Pool:
    blocks: dict[int, list[_Block]] = field(default_factory=dict)
    leases: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lend(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        size = -(-numel * dtype.itemsize // BLOCK_ROUND) * BLOCK_ROUND
        with self.lock:
            self.leases += 1
            same = self.blocks.setdefault(size, [])
            block = next((b for b in same if b.free()), None)
            if block is None:
                block = _Block(mmap.mmap(-1, size))
                if hasattr(mmap, "MADV_HUGEPAGE"):
                    block.memory.madvise(mmap.MADV_HUGEPAGE)
                same.append(block)
            view = memoryview(block.memory)
            block.user, block.last_lease = weakref.ref(view), self.leases
            if self.leases % 256 == 0:
                self._unmap_idle()
            return torch.frombuffer(view, dtype=dtype, count=numel)

    def _unmap_idle(self) -> None:
        for size, same in list(self.blocks.items()):
            keep = [b for b in same if not b.free() or self.leases - b.last_lease < IDLE_LEASES]
            self.blocks[size] = keep
            if not keep:
                del self.blocks[size]

    def pooled_bytes(self) -> int:
        with self.lock:
            return sum(size * len(same) for size, same in self.blocks.items())


_POOL = _Pool()


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A flat uninitialised tensor; on the CPU from :data:`POOL_MIN_BYTES` on, over recycled
    memory (the module docstring). Not resizable, as any tensor over borrowed memory."""
    if torch.device(device).type != "cpu" or numel * dtype.itemsize < POOL_MIN_BYTES:
        return torch.empty(numel, dtype=dtype, device=device)
    return _POOL.lend(numel, dtype)


def pooled_bytes() -> int:
    """Bytes of memory the pool holds, lent or free."""
    return _POOL.pooled_bytes()


def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The flattened ``parts`` concatenated into :func:`empty` memory (a fresh tensor over
    recycled pages on the CPU, so a step's concatenations fault in no new pages)."""
    flat = [p.reshape(-1) for p in parts]
    out = empty(sum(p.numel() for p in flat), flat[0].dtype, flat[0].device)
    return torch.cat(flat, out=out)
