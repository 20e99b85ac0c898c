"""Triton kernels of the float16/bfloat16 payloads, the residual fused.

One pass: ``x = g (+ e)``, the 16-bit value ``h`` rounded to nearest even (float16 through
the hardware conversion; bfloat16 by integer rounding of the float32 bits, so the compiled
kernel and Triton's interpreter, whose bfloat16 conversion truncates, agree), and with
error feedback the new residual ``x - float(h)``. Finite values and infinities give torch's
bytes exactly; a NaN stays a NaN (its bit pattern may differ, as between any two devices).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
DTYPES = {torch.float16: 0, torch.bfloat16: 1}


@triton.jit(do_not_specialize=["n"])
def _cast(g_ptr, e_ptr, h_ptr, r_ptr, n, BF16: tl.constexpr, HAS_RES: tl.constexpr,
          BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    x = tl.load(g_ptr + idx, mask=m, other=0.0)
    if HAS_RES:
        x = x + tl.load(e_ptr + idx, mask=m, other=0.0)
    if BF16:
        u = x.to(tl.uint32, bitcast=True)
        rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        quiet = (u >> 16) | 0x40  # a NaN stays a (quiet) NaN
        bits = tl.where(x != x, quiet, rounded).to(tl.uint16)
        tl.store(h_ptr + idx, bits.to(tl.int16, bitcast=True), mask=m)
        back = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        h = x.to(tl.float16)
        tl.store(h_ptr + idx, h.to(tl.int16, bitcast=True), mask=m)
        back = h.to(tl.float32)
    if HAS_RES:
        tl.store(r_ptr + idx, x - back, mask=m)


def encode(x: torch.Tensor, dtype: torch.dtype, residual: torch.Tensor | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``dtype`` (float16 or bfloat16) payload of the float32 ``x`` as bytes
    (``x.to(dtype).view(uint8)``); with ``residual``, of ``x + residual``, and the new
    residual ``(x + residual) - payload.to(float32)`` beside it (else ``None``)."""
    if dtype not in DTYPES:
        raise ValueError(f"a half payload is float16 or bfloat16, not {dtype}")
    g = x.reshape(-1).to(torch.float32).contiguous()
    n = g.numel()
    bits = torch.empty(n, dtype=torch.int16, device=g.device)
    e = residual.reshape(-1).to(torch.float32).contiguous() if residual is not None else g
    new = torch.empty_like(g) if residual is not None else g
    if n:
        _cast[(triton.cdiv(n, BLOCK),)](g, e, bits, new, n, BF16=dtype == torch.bfloat16,
                                        HAS_RES=residual is not None, BLOCK=BLOCK,
                                        enable_fp_fusion=False)
    return bits.view(torch.uint8), (new if residual is not None else None)
