"""Triton kernels of the sparse schemes: top-k's compaction past a threshold, random-k's
gather, and the all-gather route's deterministic segment sum.

* :func:`candidates`: the indices of the entries at or above a threshold, in increasing
  order (``(magnitude >= threshold).nonzero()``): a counting pass per block, an exclusive
  prefix sum of the counts, then a pass that writes each block's indices at its offset.
  :func:`hvd_compress.schemes.topk.largest` places the threshold from a sample and takes
  the exact top-k among these candidates.
* :func:`gather`: ``x[indices]``, times a float32 factor if one is given (random-k's
  unbiased scaling, rounded as torch rounds ``values * (n / k)``).
* :func:`segment_sum`: the dense sum of several ranks' (index, value) pairs, each rank's
  indices unique: one launch per rank in rank order, each entry read, added to and written
  by one program (no atomics), so entry ``i`` is ``((0 + v_0i) + v_1i) + ...`` as
  :func:`hvd_compress.comm.ops.sum_pairs` adds them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def _count(m_ptr, thr_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = (tl.load(m_ptr + idx, mask=idx < n, other=0.0) >= tl.load(thr_ptr)) & (idx < n)
    tl.store(counts_ptr + tl.program_id(0), tl.sum(keep.to(tl.int32), axis=0).to(tl.int64))


@triton.jit(do_not_specialize=["n"])
def _compact(m_ptr, thr_ptr, offsets_ptr, out_ptr, n, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = (tl.load(m_ptr + idx, mask=idx < n, other=0.0) >= tl.load(thr_ptr)) & (idx < n)
    rank = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    position = tl.load(offsets_ptr + tl.program_id(0)) + rank.to(tl.int64)
    tl.store(out_ptr + position, idx.to(tl.int64), mask=keep)


def candidates(magnitude: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Indices (int64, increasing) of the entries of the flat float32 ``magnitude`` at or
    above the 0-d ``threshold`` (on the same device): ``(magnitude >= threshold).nonzero()``.
    Reads the count back to the host once, as ``nonzero`` does."""
    m = magnitude.reshape(-1).contiguous()
    n = m.numel()
    thr = threshold.reshape(1).to(device=m.device, dtype=m.dtype)
    blocks = triton.cdiv(n, BLOCK)
    if not blocks:
        return torch.empty(0, dtype=torch.int64, device=m.device)
    counts = torch.empty(blocks, dtype=torch.int64, device=m.device)
    _count[(blocks,)](m, thr, counts, n, BLOCK=BLOCK)
    ends = counts.cumsum(0)
    out = torch.empty(int(ends[-1]), dtype=torch.int64, device=m.device)
    _compact[(blocks,)](m, thr, ends - counts, out, n, BLOCK=BLOCK)
    return out


@triton.jit(do_not_specialize=["k"])
def _gather(x_ptr, i_ptr, out_ptr, k, factor, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < k
    v = tl.load(x_ptr + tl.load(i_ptr + j, mask=m, other=0), mask=m, other=0.0)
    if SCALE:
        v = v * factor
    tl.store(out_ptr + j, v, mask=m)


def gather(x: torch.Tensor, indices: torch.Tensor, factor: float | None = None) -> torch.Tensor:
    """``x.reshape(-1)[indices]`` (float32), times ``factor`` rounded to float32 if given
    (as torch multiplies a float32 tensor by a Python number)."""
    flat = x.reshape(-1).contiguous()
    idx = indices.reshape(-1).to(device=flat.device, dtype=torch.int64).contiguous()
    out = torch.empty(idx.numel(), dtype=torch.float32, device=flat.device)
    if idx.numel():
        _gather[(triton.cdiv(idx.numel(), BLOCK),)](
            flat, idx, out, idx.numel(), 1.0 if factor is None else float(factor),
            SCALE=factor is not None, BLOCK=BLOCK, enable_fp_fusion=False)
    return out


@triton.jit(do_not_specialize=["k"])
def _add_pairs(total_ptr, i_ptr, v_ptr, k, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < k
    i = tl.load(i_ptr + j, mask=m, other=0)
    v = tl.load(v_ptr + j, mask=m, other=0.0).to(tl.float32)
    tl.store(total_ptr + i, tl.load(total_ptr + i, mask=m, other=0.0) + v, mask=m)


def segment_sum(numel: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
                device: torch.device) -> torch.Tensor:
    """The dense float32 sum on ``device`` of the ranks' (index, value) pairs, one part
    per rank in rank order, each part's indices unique (see the module docstring)."""
    total = torch.zeros(numel, dtype=torch.float32, device=device)
    for indices, values in parts:
        idx = indices.reshape(-1).to(device=device, dtype=torch.int64).contiguous()
        val = values.reshape(-1).to(device=device).contiguous()
        if idx.numel():
            _add_pairs[(triton.cdiv(idx.numel(), BLOCK),)](total, idx, val, idx.numel(),
                                                           BLOCK=BLOCK)
    return total
