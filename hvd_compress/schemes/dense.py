"""Dense exchanges: the uncompressed all-reduce and the float16/bfloat16 casts.

The casts write fresh tensors, which on the CPU come from :func:`hvd_compress.native.empty`
(recycled memory for large ones): filling a fresh mapping otherwise costs more in page
faults and zeroing than the conversion itself.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from hvd_compress import native, wire
from hvd_compress import triton as gpu
from hvd_compress.comm.ops import AllReduce
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scheme
from hvd_compress.schemes.packed import PackedScheme


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, converting into a contiguous :func:`~hvd_compress.native.empty`."""
    if t.dtype == dtype:
        return t
    return native.empty(t.numel(), dtype, t.device).view(t.shape).copy_(t)


_Same = TypeVar("_Same", bound="ReadyMade")


class ReadyMade:
    """A scheme without options, used as a ready-made object (``Compression.fp16``).

    Calling it returns the object itself, so ``Compression.fp16()`` is ``Compression.fp16``
    (the other schemes are classes, called with their options).
    """

    def __call__(self: _Same, *args: Any, **kwargs: Any) -> _Same:
        if args or kwargs:
            given = [*map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())]
            raise TypeError(f"{self!r} takes no options, got {', '.join(given)}")
        return self


BATCH_UP_TO = 1 << 16
"""The most elements of a tensor that :class:`NoCompression` sends in its bucket's batch
(:meth:`NoCompression.exchange_many`); larger ones keep a request of their own."""


class NoCompression(ReadyMade, Scheme):
    """Plain all-reduce in the tensor's own dtype; also the route for tensors sent dense.

    A bucket's small tensors (at most :data:`BATCH_UP_TO` elements: biases, layer norms,
    the tensors a policy sends dense) go through :meth:`exchange_many` at once
    (:mod:`hvd_compress.schemes.batched`): one flat buffer, one request, and each result a
    view of the sum, instead of a generator, a request and a fused slice per tensor. The
    sums are those of the per-tensor path element for element (an all-reduce sums each
    element over the same ranks wherever it lies in the buffer;
    ``tests/test_dense_batched.py``). ``batch_tensors = False`` on an instance keeps the
    per-tensor path (a performance switch, not an option).
    """

    name = "none"
    sliceable = True
    batch_tensors = True

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        total = yield AllReduce("dense", x)
        return Outcome(total, None, x.numel() * x.element_size())

    def batches(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                ctx: ExchangeContext) -> bool:
        """Whether ``x`` travels in its bucket's batch: a small tensor (the class notes),
        unless ``batch_tensors`` is off. Decided from the shape, alike on every rank."""
        return self.batch_tensors and x.numel() <= BATCH_UP_TO

    def exchange_many(self, xs: Sequence[torch.Tensor],
                      states: Sequence[Mapping[str, torch.Tensor]],
                      ctxs: Sequence[ExchangeContext]
                      ) -> Generator[AllReduce, Any, list[Outcome]]:
        """:meth:`exchange` of every tensor of ``xs`` (one dtype and device) at once: their
        elements one after the other in one buffer, summed in place by one request; each
        outcome's aggregate is a view of the sum in its tensor's shape."""
        numels = [x.numel() for x in xs]
        flat = torch.cat([x.reshape(-1) for x in xs])
        total = yield AllReduce("dense", flat, inplace=True)
        size = flat.element_size()
        return [Outcome(piece.view(x.shape), None, n * size)
                for piece, x, n in zip(torch.split(total.reshape(-1), numels), xs, numels,
                                       strict=True)]

    def payload_bytes(self, shape: torch.Size) -> int:
        return 4 * shape.numel()

    def __repr__(self) -> str:
        return "Compression.none"

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class HalfPayload(PackedScheme):
    """Values as a 16-bit float type (``float16`` or ``bfloat16``), summed by the compressed
    all-reduce (:mod:`hvd_compress.schemes.packed`): each rank sums its chunk of
    the payloads in float32 and rounds the sum once, which is more accurate than a ring
    summing in 16 bits and moves the same bytes.

    Wire: the values, 2 bytes each, little-endian.
    """

    bucket_size = 1

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"a half payload is float16 or bfloat16, not {dtype}")
        self.dtype = dtype
        self.name = {torch.float16: "fp16", torch.bfloat16: "bf16"}[dtype]

    def chunk_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if gpu.active(x) and (out := gpu.encode_half(x, self.dtype)) is not None:
            return out
        return cast(x.reshape(-1), self.dtype).view(torch.uint8)

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        (payload,) = wire.split_sections(payload, [2 * numel], f"{self.name} payload")
        if payload.storage_offset() % 2:
            payload = payload.clone()
        return cast(payload.view(self.dtype), torch.float32)


class FP16(ReadyMade, Scheme):
    """Send gradients as IEEE float16: 2 bytes per element, a 2x saving.

    On a GPU the float16 payloads go through Horovod's ring all-reduce (NCCL sums float16
    fast). On a CPU they go through the compressed all-reduce (:class:`HalfPayload`): Horovod
    sums float16 on a CPU element by element through float conversions, slower than it sends
    float32 on a fast link (see docs/benchmarks.md). Either way
    float16 keeps 10 mantissa bits and overflows above 65504: on the ring a partial sum may
    overflow (``gradient_predivide_factor`` helps), on the CPU path only a chunk's final sum,
    which is summed in float32.

    Stateless, so it also works as ``compression=`` of Horovod's own
    ``hvd.DistributedOptimizer`` (Horovod's Compressor interface).

    The pipeline reports each tensor's rounding error ``||fp16(x) - x|| / ||x||`` (at
    most ``2**-11``, float16's relative rounding, for values in its normal range): on the
    CPU from the payload (:meth:`packed`), on the ring from the outcome's ``sent``, this
    rank's float16 values.
    """

    name = "fp16"
    sliceable = True
    _packed = HalfPayload(torch.float16)

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        packed = self.packed(x.device)
        if packed is not None:
            return (yield from packed.exchange(x, state, ctx))
        half, dtype = self.compress(x)
        total = yield AllReduce(self.name, half)  # not in place: half is what was sent
        return Outcome(self.decompress(total, dtype), half, x.numel() * 2)

    def packed(self, device: torch.device) -> HalfPayload | None:
        """The packed codec whose compressed all-reduce carries the tensors on ``device``
        (float16 :class:`HalfPayload` on the CPU); ``None`` where they go through the ring
        all-reduce (other devices)."""
        return self._packed if device.type == "cpu" else None

    def payload_bytes(self, shape: torch.Size) -> int:
        return 2 * shape.numel()

    def __repr__(self) -> str:
        return "Compression.fp16"

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not isinstance(tensor, torch.Tensor):  # TensorFlow, from hvd.DistributedGradientTape
            from hvd_compress.tensorflow.compressor import fp16_compress

            return fp16_compress(tensor)
        if tensor.dtype.is_floating_point:
            return cast(tensor, torch.float16), tensor.dtype
        return tensor, None

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            from hvd_compress.tensorflow.compressor import fp16_decompress

            return fp16_decompress(tensor, ctx)
        return tensor if ctx is None else cast(tensor, ctx)


class BF16(ReadyMade, HalfPayload):
    """Send gradients as bfloat16: float32's exponent range, 7 mantissa bits, 2x saving.

    Horovod 0.28.1's PyTorch collectives have no bfloat16 reduction, so the payloads go
    through the compressed all-reduce (:class:`HalfPayload`) on every device. For the same
    reason it cannot serve as ``compression=`` of Horovod's own optimizer (use
    :class:`FP16` there).
    """

    sliceable = True

    def __init__(self) -> None:
        super().__init__(torch.bfloat16)

    def __repr__(self) -> str:
        return "Compression.bf16"

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not isinstance(tensor, torch.Tensor):  # TensorFlow, from hvd.DistributedGradientTape
            from hvd_compress.tensorflow.compressor import BF16_REFUSED

            raise TypeError(BF16_REFUSED)
        raise TypeError(
            "Compression.bf16 cannot be used with Horovod's own hvd.DistributedOptimizer: "
            "Horovod 0.28.1's PyTorch all-reduce rejects bfloat16 tensors. Use "
            "hvd_compress.torch.DistributedOptimizer(..., compression=Compression.bf16), "
            "which sums bfloat16 payloads in float32, or Compression.fp16 with the stock "
            "optimizer.")
