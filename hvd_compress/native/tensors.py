"""The torch side of the codec kernels: which tensors they code, and encode/decode calls.

Each encode or decode of a CPU tensor is one fused pass over the data in C++ (OpenMP, with
torch's intra-op thread count), writing the layouts of :mod:`hvd_compress.wire` bit for
bit; tensors on other devices take the schemes' torch code. The call goes through
:mod:`ctypes` with the tensors' data pointers; ctypes releases the GIL for it, so ranks run
on threads encode in parallel. Payloads and decoded values are written into
:func:`~hvd_compress.native.buffers.empty` memory (recycled for large ones).
"""

from __future__ import annotations

import torch

from hvd_compress.native.buffers import empty
from hvd_compress.native.loader import is_disabled, library


def active(t: torch.Tensor) -> bool:
    """Whether ``t`` is coded by these kernels: a CPU tensor, kernels built, not disabled."""
    return t.device.type == "cpu" and not is_disabled() and library() is not None


def seed(generator: torch.Generator) -> int:
    """A 63-bit key for the kernels' random draws, taken from ``generator``."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator))


def encode(kernel: str, x: torch.Tensor, bucket_size: int, nbytes: int,
           *options: int | float) -> torch.Tensor:
    """Run ``hvdc_<kernel>_encode`` on the float32 CPU tensor ``x``: ``nbytes`` of payload
    (in :func:`~hvd_compress.native.buffers.empty` memory)."""
    x = x.reshape(-1).to(torch.float32).contiguous()
    out = empty(nbytes, torch.uint8)
    fn = getattr(library(), f"hvdc_{kernel}_encode")
    fn(x.data_ptr(), x.numel(), bucket_size, out.data_ptr(), torch.get_num_threads(), *options)
    return out


def decode(kernel: str, payload: torch.Tensor, numel: int, bucket_size: int,
           *options: int) -> torch.Tensor:
    """Run ``hvdc_<kernel>_decode`` on a checked CPU payload: ``numel`` float32 values
    (in :func:`~hvd_compress.native.buffers.empty` memory)."""
    payload = payload.contiguous()
    out = empty(numel, torch.float32)
    fn = getattr(library(), f"hvdc_{kernel}_decode")
    fn(payload.data_ptr(), numel, bucket_size, out.data_ptr(), torch.get_num_threads(),
       *options)
    return out
