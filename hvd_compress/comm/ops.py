"""What a scheme asks to have communicated.

A scheme's :meth:`~hvd_compress.schemes.base.Scheme.exchange` is a generator: it yields one
of these requests per communication round and receives the result. The pipeline
(:mod:`hvd_compress.pipeline`) names, starts, counts and waits on them, so codecs never call
a collective themselves and run unchanged in one process. It also fuses the requests of one
round of several tensors of a bucket into one collective (concatenated, then cut back): what
makes that possible is stated, per request type, as its *fusion contract* below. Names are
deterministic and identical on every rank, which is how Horovod matches collectives:
``hvdc.<tensor>.<round>`` for a request travelling alone,
``hvdc.b<bucket>.<phase>.<kind>.<digest>`` for a fused one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from hvd_compress.comm.staging import pairs_to_host
from hvd_compress.native import buffers
from hvd_compress.sparse_wire import ValueDType, pairs_nbytes


@dataclass(frozen=True)
class AllReduce:
    """Element-wise **sum** over ranks of a dense tensor. Result: a tensor of the same shape.

    Fusion contract: none beyond a shape known to every rank. Requests of one dtype and
    device share one all-reduce, whatever their round names (a bias's ``dense`` and
    PowerSGD's ``P``, as in DDP's ``powerSGD_hook``); each gets its slice back, in its shape.

    ``inplace``: the tensor belongs to the pipeline and the communicator may sum into it
    and return it (Horovod's ``allreduce_async_``), so that no result buffer is allocated;
    a communicator may also ignore it and return a new tensor.
    """

    round: str
    tensor: torch.Tensor
    inplace: bool = False


@dataclass(frozen=True)
class AllGather:
    """Concatenate every rank's flat tensor in rank order.

    Result: a list with one tensor per rank. ``sizes`` gives each rank's element count when
    the scheme knows it (fixed-rate codecs); otherwise every rank's payload must be
    self-delimiting and the result is a one-element list holding the concatenation.

    Fusion contract: ``sizes`` is the same on every rank and this rank's tensor has
    ``sizes[rank]`` elements; rank ``r``'s part of a fused all-gather is then cut per tensor
    by each one's ``sizes[r]``. A request with ``sizes=None`` is never fused.
    """

    round: str
    tensor: torch.Tensor
    sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class AllToAll:
    """Send ``splits[r]`` consecutive elements of a flat tensor to rank ``r``.

    Result: a list with the tensor received from each rank, in rank order.

    Fusion contract: ``splits`` is the same on every sender, a function of what every rank
    knows (the compressed all-reduce sends chunk ``r``'s payload to rank ``r``, and payload
    sizes follow from the shape), so what rank ``r`` receives from any source has
    ``splits[r]`` elements. A fused all-to-all sends, to each rank ``r``, every tensor's
    split ``r`` in turn, and cuts what arrives from each source by the tensors'
    ``splits[rank]``; a source whose total differs raises a ``RuntimeError`` naming the
    bucket and tensors rather than cutting wrongly. A request alone in its group is sent as
    it is, for which any splits work.
    """

    round: str
    tensor: torch.Tensor
    splits: tuple[int, ...]


@dataclass(frozen=True)
class SparseSum:
    """Sum over ranks of sparse vectors of length ``numel`` given as (index, value) pairs,
    each rank with its own unique indices. Result: the dense sum, a flat float32 tensor.

    The values' dtype is the one they travel in: float16 values go as fp16, any other as
    fp32. A ring cannot sum these; the communicator sends the pairs as frames of
    :mod:`hvd_compress.sparse_wire`, either gathered by every rank (Horovod ``allgather``)
    or to a parameter server.

    The sum is defined in rank order (:func:`sum_pairs`): entry ``i`` is
    ``((0 + v_0) + v_1) + ...`` over the ranks that sent ``i``, in float32, the order the
    parameter server adds pushes in too; every communicator returns those bits on every
    rank and device, so replicas never drift apart.

    Fusion contract: none; every sparse sum is its own collective, named after its tensor
    (the parameter server keeps rounds per tensor and shards by the tensor's index range).
    The one exception is top-k's :class:`~hvd_compress.comm.sparse_frames.PairsSum` on a
    communicator that all-gathers frames (``gathers_frames``): a bucket's travel as one
    :class:`~hvd_compress.comm.sparse_frames.FramesSum`, each summed as it would be alone.
    """

    round: str
    numel: int
    indices: torch.Tensor
    values: torch.Tensor

    @property
    def value_dtype(self) -> ValueDType:
        return wire_dtype(self.values)

    @cached_property
    def host(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's pairs on the host as they come (int64 indices, values in their wire
        dtype), copied from the device once (:func:`~hvd_compress.comm.staging.
        pairs_to_host`) and shared by the byte count, the frame and the push."""
        return pairs_to_host(self.indices, self.values, TORCH_VALUES[self.value_dtype])

    @cached_property
    def wire_nbytes(self) -> int:
        """The coded index and value sections of this rank's frame; computed once (the
        pipeline counts it and the scheme reports it)."""
        return pairs_nbytes(self.host[0], self.numel, self.value_dtype)


Collective = AllReduce | AllGather | AllToAll | SparseSum


def nbytes(op: Collective) -> int:
    """Bytes this rank hands to the collective. For :class:`SparseSum`, the coded index
    and value sections of its frame (:func:`hvd_compress.sparse_wire.pairs_nbytes`)."""
    if isinstance(op, SparseSum):
        return op.wire_nbytes
    return op.tensor.numel() * op.tensor.element_size()


TORCH_VALUES = {ValueDType.FP32: torch.float32, ValueDType.FP16: torch.float16}
"""The torch dtype of each frame value dtype."""


def wire_dtype(values: torch.Tensor | np.ndarray) -> ValueDType:
    """The frame value dtype of values (a tensor or an array): fp16 for float16, fp32
    otherwise."""
    half = values.dtype == (torch.float16 if isinstance(values, torch.Tensor) else np.float16)
    return ValueDType.FP16 if half else ValueDType.FP32


def sorted_pairs(numel: int, indices: torch.Tensor | np.ndarray,
                 values: torch.Tensor | np.ndarray, where: str) -> tuple[np.ndarray, np.ndarray]:
    """Host copies of (index, value) pairs in increasing index order, as frames hold them,
    values in their wire dtype (:func:`wire_dtype`). Tensors on a device are copied to the
    host once (:func:`~hvd_compress.comm.staging.pairs_to_host`); arrays (such as
    :attr:`SparseSum.host`) are used as they are. Raises :class:`ValueError` naming
    ``where`` for mismatched lengths, indices out of ``[0, numel)`` or repeated."""
    dtype = wire_dtype(values)
    if isinstance(indices, torch.Tensor) or isinstance(values, torch.Tensor):
        idx, val = pairs_to_host(torch.as_tensor(indices), torch.as_tensor(values),
                                 TORCH_VALUES[dtype])
    else:
        idx = np.asarray(indices).reshape(-1).astype(np.int64, copy=False)
        val = np.asarray(values).reshape(-1).astype(dtype.numpy, copy=False)
    if idx.size != val.size:
        raise ValueError(f"{where}: {idx.size} indices but {val.size} values")
    order = np.argsort(idx, kind="stable")
    idx, val = idx[order], val[order]
    if idx.size and (idx[0] < 0 or idx[-1] >= numel):
        raise ValueError(f"{where}: indices must lie in [0, {numel}), got {idx[0]}..{idx[-1]}")
    if np.any(idx[1:] == idx[:-1]):
        raise ValueError(f"{where}: duplicate indices (sum them first)")
    return idx, val


def sum_pairs(numel: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
              device: torch.device) -> torch.Tensor:
    """The dense float32 sum, on ``device``, of several ranks' (index, value) pairs, each
    part's indices unique (one part per rank, in rank order).

    Deterministic on every device and at any number of parts: entry ``i`` is
    ``((0 + v_0i) + v_1i) + ...`` over the parts that hold ``i``, in the order given, each
    addition rounded to float32. Each part is added by its own ``index_add_``; within one,
    no two additions meet at an entry, so the atomic adds of CUDA's ``index_add_`` (whose
    order is unspecified when indices repeat) each add one value to an entry and the
    result does not depend on their timing. Adding every part's pairs at once, as one
    concatenation, would leave the order of the additions at a shared index to the device
    on a GPU.

    The result is a fresh tensor (on the CPU over recycled memory,
    :func:`hvd_compress.native.buffers.empty`, which spares the page faults of a fresh
    mapping of the dense size).
    """
    from hvd_compress import triton as gpu  # the Triton kernels' one pass per part
    if gpu.active(torch.device(device)) and \
            (summed := gpu.call("sparse.segment_sum", numel, parts, device)) is not None:
        return summed
    total = buffers.empty(numel, torch.float32, device).zero_()
    for indices, values in parts:
        total.index_add_(0, indices.to(device=device, dtype=torch.long),
                         values.to(device=device, dtype=torch.float32))
    return total
