"""Copies of sparse (index, value) pairs between a device and the host.

Frames (:mod:`hvd_compress.sparse_wire`) are coded on the host, so a rank whose pairs live
on a GPU copies them to the host once per frame, and the pairs of the aggregate go back
once. Each direction is one copy through a page-locked (pinned) buffer that this thread
reuses from call to call (it grows to the largest transfer seen): a fresh pinned
allocation costs more than the copy itself, and pageable memory makes CUDA stage the
copy through a pinned buffer of its own. Pinned memory is only asked for where CUDA is
available. CPU tensors are not copied at all.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

_INDEX = torch.int64
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32}


class _Staging(threading.local):
    buffer: torch.Tensor | None = None


_staging = _Staging()


def staging_buffer(nbytes: int) -> torch.Tensor:
    """This thread's reused host buffer, at least ``nbytes`` long (uint8), pinned when
    CUDA is available. Valid until this thread's next call."""
    buffer = _staging.buffer
    if buffer is None or buffer.numel() < nbytes:
        size = max(nbytes, 1 << 16, int(1.5 * (buffer.numel() if buffer is not None else 0)))
        buffer = torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        _staging.buffer = buffer
    return buffer[:nbytes]


def pairs_to_host(indices: torch.Tensor, values: torch.Tensor, value_dtype: torch.dtype
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Flat int64 indices and values cast to ``value_dtype`` (float16 or float32), as
    numpy arrays.

    From a CPU tensor the arrays may share its memory (no copy); from another device, both
    arrive by one device-to-host copy into :func:`staging_buffer` and are then copied out
    of it, so the arrays are the caller's own.
    """
    idx = indices.detach().reshape(-1).to(_INDEX)
    val = values.detach().reshape(-1).to(value_dtype)
    if idx.device.type == "cpu" and val.device.type == "cpu":
        return idx.numpy(), val.numpy()
    val = val.to(idx.device)
    index_bytes = idx.numel() * idx.element_size()
    packed = torch.cat([idx.contiguous().view(torch.uint8), val.contiguous().view(torch.uint8)])
    host = staging_buffer(packed.numel())
    host.copy_(packed)  # synchronous: the buffer is reused by the next call
    raw = host.numpy()
    return (raw[:index_bytes].view(np.int64).copy(),
            raw[index_bytes:].view(_NUMPY[value_dtype]).copy())


def pairs_to_device(parts: Sequence[tuple[np.ndarray, np.ndarray]], device: torch.device
                    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each part's (int64 indices, float32 values) as tensors on ``device``, in order.

    On the CPU the tensors share the arrays' memory. On another device every part travels
    in one host-to-device copy from :func:`staging_buffer` (all indices, then all values),
    and the parts are views of what arrived.
    """
    idx = [np.ascontiguousarray(i, dtype=np.int64).reshape(-1) for i, _ in parts]
    val = [np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for _, v in parts]
    if device.type == "cpu":
        return [(torch.from_numpy(i), torch.from_numpy(v)) for i, v in zip(idx, val)]
    index_bytes = 8 * sum(i.size for i in idx)
    total = index_bytes + 4 * sum(v.size for v in val)
    host = staging_buffer(total)
    raw = host.numpy()
    offset = 0
    for array in [*idx, *val]:
        raw[offset:offset + array.nbytes] = array.view(np.uint8)
        offset += array.nbytes
    arrived = host.to(device)  # synchronous from the caller's view: the buffer is reused
    indices = arrived[:index_bytes].view(_INDEX).split([i.size for i in idx])
    values = arrived[index_bytes:].view(torch.float32).split([v.size for v in val])
    return list(zip(indices, values))
