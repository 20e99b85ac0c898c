"""Recycled memory for large CPU outputs (decoded chunks, float16/float32 casts).

A fresh large ``torch.empty`` is a fresh ``mmap``: writing it first costs a page fault and
the kernel zeroing every page, more than a decode or a cast itself. The same sizes recur
every training step, so :func:`empty` hands out tensors over pooled anonymous mappings
instead (:mod:`hvd_compress.native.pool`, shared with the parameter server's rounds): a
block is lent to one tensor (and its views) at a time and is free again once torch has
released that memory.
"""

from __future__ import annotations

import torch

from hvd_compress.native.pool import BLOCK_ROUND, BlockPool

POOL_MIN_BYTES = 4 << 20
"""Smaller CPU tensors come from ``torch.empty`` (the C heap already recycles them)."""

IDLE_LEASES = 4096
"""A free block not lent for this many leases is unmapped."""

__all__ = ["BLOCK_ROUND", "IDLE_LEASES", "POOL_MIN_BYTES", "cat", "empty", "pooled_bytes"]

_POOL = BlockPool(IDLE_LEASES)


def empty(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu",
          pool_min_bytes: int = POOL_MIN_BYTES) -> torch.Tensor:
    """A flat uninitialised tensor; on the CPU from ``pool_min_bytes`` (default
    :data:`POOL_MIN_BYTES`) on, over recycled memory (the module docstring). Not resizable,
    as any tensor over borrowed memory."""
    if numel * dtype.itemsize < pool_min_bytes or \
            (device != "cpu" and torch.device(device).type != "cpu"):
        return torch.empty(numel, dtype=dtype, device=device)
    return torch.frombuffer(_POOL.lend(numel * dtype.itemsize), dtype=dtype, count=numel)


def pooled_bytes() -> int:
    """Bytes of memory the pool holds, lent or free."""
    return _POOL.pooled_bytes()


def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The flattened ``parts`` concatenated into :func:`empty` memory (a fresh tensor over
    recycled pages on the CPU, so a step's concatenations fault in no new pages)."""
    flat = [p.reshape(-1) for p in parts]
    out = empty(sum(p.numel() for p in flat), flat[0].dtype, flat[0].device)
    return torch.cat(flat, out=out)
