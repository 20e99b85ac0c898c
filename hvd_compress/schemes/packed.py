"""Schemes whose payloads cannot be summed as they are, and the all-reduce that carries them.

A :class:`PackedScheme` encodes a flat chunk into bit-packed codes plus scales (1-bit,
QSGD, TernGrad, the majority vote, float16 on the CPU). Such payloads do not add up in a
ring, so :func:`compressed_allreduce` runs the two-phase scheme of 1-bit Adam (Tang et al.
2021, "1-bit Adam", Alg. 2) as a generator the pipeline drives (rounds ``scatter`` and
``gather``):

1. Split the flat tensor into one chunk per rank at bucket boundaries
   (:func:`chunk_sizes`); encode each chunk; ``alltoall`` sends chunk ``r`` to rank ``r``.
2. Rank ``r`` reduces the ``size`` payloads of its chunk with
   :meth:`PackedScheme.reduce` (by default it decodes and sums them: exactly the sum of
   what every rank sent; majority vote takes the sign of the sum of signs), adds its
   rank-side residual (state :data:`CHUNK_RESIDUAL`) when the scheme uses error feedback,
   re-encodes the result and keeps ``result - decode(encoded)`` as the new rank-side
   residual.
3. ``allgather`` of the re-encoded chunks; every rank decodes all of them, so every rank
   ends with the same aggregate (passed through :meth:`PackedScheme.expand`, by default
   unchanged).

Per rank, traffic is ``2 (size-1)/size`` times the payload, as for a ring all-reduce of the
payload: the wire saving equals the codec's compression rate. Nothing is decoded to float32
before it crosses the wire.

On the CPU a codec with native kernels (:attr:`PackedScheme.kernel`: 1-bit, QSGD,
TernGrad) takes a fused path with the same results bit for bit: the chunks are encoded into
one payload buffer; this rank's contribution is kept as those payloads
(:class:`PackedContribution`), which error feedback subtracts from ``g + e`` in one pass
without writing the decoded tensor; step 2's decodings, sum and residual are one pass
with its re-encoding and the new rank-side residual (``hvdc_<kernel>_reduce``); step 3
keeps the gathered payloads as the aggregate (a :class:`PackedContribution` too), which the
pipeline's finiteness check sums from the payloads (``hvdc_<kernel>_total``) and its write
decodes straight into the gradient.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from hvd_compress.comm.ops import AllGather, AllToAll
from hvd_compress.native import buffers
from hvd_compress.native import tensors as kernels
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scheme, write_scaled

CHUNK_RESIDUAL = "chunk_residual"
"""The state key of the reducing rank's residual for its chunk (error feedback only)."""

FUSED = True
"""Whether :func:`compressed_allreduce` takes the fused native path where it can; ``False``
runs the unfused reference (tests/test_fused_feedback.py compares the two bit for bit)."""


class PackedScheme(Scheme):
    """A scheme whose payloads cannot be summed as they are (bit-packed codes plus scales).

    Subclasses give ``encode``/``decode`` of a flat chunk; the exchange is
    :func:`compressed_allreduce`, which splits the tensor into one chunk per rank at bucket
    boundaries. ``bucket_size`` elements share one scale.
    """

    bucket_size: int = 512
    kernel: str | None = None
    """The name of the codec's native kernels (``hvdc_<kernel>_encode`` and the rest in
    ``native/codecs.cpp``), whose CPU encode and decode are this codec's bit for bit; with
    it, :func:`compressed_allreduce` takes its fused path on the CPU. ``None``: no kernels."""

    def encode_options(self, generator: torch.Generator) -> tuple[int | float, ...]:
        """The options :attr:`kernel`'s encode takes after the common arguments, drawing
        from ``generator`` exactly as :meth:`encode` does on the CPU. Default: none."""
        del generator
        return ()

    def decode_options(self) -> tuple[int, ...]:
        """The options :attr:`kernel`'s decode takes after the common arguments."""
        return ()

    @abstractmethod
    def encode(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Flat float32 chunk -> flat uint8 payload of :meth:`chunk_bytes` bytes."""

    @abstractmethod
    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """Payload of a ``numel``-element chunk -> flat float32 values."""

    @abstractmethod
    def chunk_bytes(self, numel: int) -> int:
        """Exact payload size of a ``numel``-element chunk."""

    def payload_bytes(self, shape: torch.Size) -> int:
        return self.chunk_bytes(shape.numel())

    def reduce(self, payloads: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """The reducing rank's step of the compressed all-reduce: its ``numel``-element
        chunk of the aggregate from the payloads every rank sent it (in rank order), before
        it is re-encoded. Default: the sum of their decodings (what every summable scheme
        needs). A scheme with another reduction overrides it (majority vote: the sign of
        the sum of signs)."""
        if not numel:
            return torch.zeros(0, dtype=torch.float32, device=payloads[0].device)
        total = self.decode(payloads[0], numel)
        for payload in payloads[1:]:
            total += self.decode(payload, numel)
        return total

    def expand(self, aggregate: torch.Tensor, size: int) -> torch.Tensor:
        """The aggregate as the pipeline takes it, a sum over ``size`` ranks, from the
        decoded re-encoded chunks. Default: as decoded. Majority vote multiplies its vote by
        ``size``, so the averaged gradient is the vote itself."""
        del size
        return aggregate

    def packed(self, device: torch.device) -> PackedScheme | None:
        """The codec whose payload this scheme sends through :func:`compressed_allreduce`
        on ``device``: itself."""
        del device
        return self

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        return compressed_allreduce(self, x, state, ctx)


def bucket_view(x: torch.Tensor, bucket_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat tensor zero-padded into rows of ``bucket_size``, and each row's true length."""
    n = x.numel()
    rows = max((n + bucket_size - 1) // bucket_size, 0)
    padded = x.new_zeros(rows * bucket_size)
    padded[:n] = x
    counts = torch.full((rows,), bucket_size, dtype=x.dtype, device=x.device)
    if rows and n % bucket_size:
        counts[-1] = n % bucket_size
    return padded.view(rows, bucket_size), counts


def chunk_sizes(numel: int, size: int, bucket_size: int) -> list[int]:
    """Element counts of the ``size`` chunks: whole buckets spread evenly, remainder last."""
    buckets = (numel + bucket_size - 1) // bucket_size
    base, extra = divmod(buckets, size)
    counts = [(base + (1 if r < extra else 0)) * bucket_size for r in range(size)]
    # The final chunk holding elements absorbs the short last bucket.
    overshoot = sum(counts) - numel
    for r in reversed(range(size)):
        if counts[r]:
            counts[r] -= overshoot
            break
    return counts


def compressed_allreduce(codec: PackedScheme, x: torch.Tensor,
                         state: Mapping[str, torch.Tensor], ctx: ExchangeContext) -> Exchange:
    """The exchange of a :class:`PackedScheme` (module docstring): rounds ``scatter``
    (:class:`~hvd_compress.comm.ops.AllToAll`) and ``gather``
    (:class:`~hvd_compress.comm.ops.AllGather`). On the CPU, a codec with native kernels
    takes the fused path (:func:`fused_allreduce`), with the same results bit for bit."""
    if FUSED and codec.kernel is not None and kernels.active(x):
        return (yield from fused_allreduce(codec, codec.kernel, x, state, ctx))
    flat = x.reshape(-1)
    sizes = chunk_sizes(flat.numel(), ctx.size, codec.bucket_size)
    gen = ctx.generator("encode", x.device)
    payloads = [codec.encode(chunk, gen) for chunk in torch.split(flat, sizes)]
    payload_sizes = tuple(p.numel() for p in payloads)
    sent = None
    if codec.error_feedback:
        sent = buffers.cat([codec.decode(p, n) for p, n in zip(payloads, sizes)]).view_as(x)

    received = yield AllToAll("scatter", buffers.cat(payloads), payload_sizes)
    mine = sizes[ctx.rank]
    chunk_sum = codec.reduce(received, mine)

    new_state: dict[str, torch.Tensor] = {}
    if codec.error_feedback:
        residual = state.get(CHUNK_RESIDUAL)
        if residual is not None and residual.numel() == mine:
            chunk_sum += residual
    reencoded = codec.encode(chunk_sum, ctx.generator("reencode", x.device))
    if codec.error_feedback:
        new_state[CHUNK_RESIDUAL] = chunk_sum.sub_(codec.decode(reencoded, mine))

    gather_sizes = tuple(codec.chunk_bytes(n) for n in sizes)
    gathered = yield AllGather("gather", reencoded, gather_sizes)
    aggregate = buffers.cat([codec.decode(p, n) for p, n in zip(gathered, sizes)])
    aggregate = codec.expand(aggregate, ctx.size)
    return Outcome(aggregate.view_as(x), sent, sum(payload_sizes), new_state)


@dataclass
class PackedContribution:
    """This rank's contribution to a compressed all-reduce kept as the payloads it sent
    (chunk ``i`` of ``sizes[i]`` elements, in order), not decoded: error feedback subtracts
    it from ``g + e`` in one native pass per chunk (:meth:`subtract_from`), without writing
    the decoded tensor. Equal bit for bit to the decoded tensor the reference path returns
    (:func:`compressed_allreduce`)."""

    codec: PackedScheme
    kernel: str
    payloads: Sequence[torch.Tensor]
    sizes: Sequence[int]
    shape: torch.Size

    def materialize(self) -> torch.Tensor:
        out = buffers.empty(self.shape.numel(), torch.float32)
        for p, part in zip(self.payloads, _parts(out, self.sizes)):
            if part.numel():
                kernels.decode(self.kernel, p, part.numel(), self.codec.bucket_size,
                               *self.codec.decode_options(), out=part)
        return out.view(self.shape)

    def total(self) -> torch.Tensor:
        """The sum of the decoded values as a float32 scalar, from the payloads alone
        (:func:`~hvd_compress.native.tensors.total`: summed in float64, then rounded); NaN
        or infinite exactly when a decoded value is, or when the sum overflows float32."""
        options = self.codec.decode_options()
        return torch.tensor(sum(kernels.total(self.kernel, p, n, self.codec.bucket_size,
                                              *options)
                                for p, n in zip(self.payloads, self.sizes) if n),
                            dtype=torch.float32)

    def write(self, out: torch.Tensor, scale: float) -> torch.Tensor:
        """``out = scale * self``, bit for bit as :func:`write_scaled` of the decoded
        tensor; a contiguous float32 CPU ``out`` (of :attr:`shape`) is decoded into
        directly, without a decoded tensor of its own."""
        if not (out.dtype == torch.float32 and out.is_contiguous() and kernels.active(out)):
            return write_scaled(self.materialize(), out, scale)
        options = self.codec.decode_options()
        for p, part in zip(self.payloads, _parts(out.view(-1), self.sizes)):
            if not part.numel():
                continue
            if scale == 1.0:
                kernels.decode(self.kernel, p, part.numel(), self.codec.bucket_size,
                               *options, out=part)
            else:  # the product in the decoding pass (one pass over out, not two)
                kernels.scaled(self.kernel, p, part.numel(), self.codec.bucket_size, scale,
                               *options, out=part)
        return out

    def subtract_from(self, x: torch.Tensor) -> torch.Tensor:
        """``x -= self`` in place (``x`` of :attr:`shape`); returns ``x``."""
        if not (x.dtype == torch.float32 and x.is_contiguous() and kernels.active(x)):
            return x.sub_(self.materialize().view_as(x))
        for p, part in zip(self.payloads, _parts(x.view(-1), self.sizes)):
            if part.numel():
                kernels.subtract(self.kernel, p, part, self.codec.bucket_size,
                                 *self.codec.decode_options())
        return x


def _checked(codec: PackedScheme, payloads: Sequence[torch.Tensor], numel: int) -> bool:
    """Whether every payload has the size of a ``numel``-element chunk (else the caller
    takes the codec's own decode, whose check raises the error a user can act on)."""
    nbytes = codec.chunk_bytes(numel)
    return all(p.numel() == nbytes and p.dtype == torch.uint8 for p in payloads)


def _parts(t: torch.Tensor, sizes: Sequence[int]) -> Sequence[torch.Tensor]:
    """``t`` split into consecutive parts of ``sizes`` (itself when there is one part)."""
    return (t,) if len(sizes) == 1 else t.split_with_sizes(list(sizes))


def fused_allreduce(codec: PackedScheme, kernel: str, x: torch.Tensor,
                    state: Mapping[str, torch.Tensor], ctx: ExchangeContext) -> Exchange:
    """:func:`compressed_allreduce` on the CPU through ``kernel``'s native passes (module
    docstring): the same rounds, payloads, aggregate, contribution and residual, bit for
    bit, and the same draws from the same generators (none for a codec whose
    :meth:`~PackedScheme.encode_options` draws none)."""
    flat = x.reshape(-1).to(torch.float32).contiguous()
    bucket = codec.bucket_size
    sizes = chunk_sizes(flat.numel(), ctx.size, bucket)
    payload_sizes = tuple(codec.chunk_bytes(n) for n in sizes)
    draws = type(codec).encode_options is not PackedScheme.encode_options
    gen = ctx.generator("encode", x.device) if draws else None
    payload = buffers.empty(sum(payload_sizes), torch.uint8)
    parts = _parts(payload, payload_sizes)
    for chunk, part in zip(_parts(flat, sizes), parts):
        options = codec.encode_options(gen)  # drawn for every chunk, as encode does
        if chunk.numel():
            kernels.encode(kernel, chunk, bucket, part.numel(), *options, out=part)
    sent = PackedContribution(codec, kernel, parts, sizes, x.shape) \
        if codec.error_feedback else None

    received = yield AllToAll("scatter", payload, payload_sizes)
    mine = sizes[ctx.rank]
    residual = state.get(CHUNK_RESIDUAL) if codec.error_feedback else None
    if residual is not None and residual.numel() != mine:
        residual = None
    reencoded = buffers.empty(payload_sizes[ctx.rank], torch.uint8)
    options = codec.encode_options(ctx.generator("reencode", x.device) if draws else None)
    if mine and type(codec).reduce is PackedScheme.reduce and _checked(codec, received, mine):
        if residual is not None:
            residual = residual.reshape(-1).to(torch.float32).contiguous()
        # The sum, the residual, the re-encoding and the new residual in one pass.
        chunk_sum = kernels.reduce(kernel, received, mine, bucket, residual, reencoded,
                                   *options)
    else:
        chunk_sum = codec.reduce(received, mine)
        if residual is not None:
            chunk_sum += residual
        if mine:
            kernels.encode(kernel, chunk_sum, bucket, reencoded.numel(), *options,
                           out=reencoded)
            chunk_sum -= codec.decode(reencoded, mine)
    new_state = {CHUNK_RESIDUAL: chunk_sum} if codec.error_feedback else {}

    gathered = yield AllGather("gather", reencoded, payload_sizes)
    if type(codec).expand is PackedScheme.expand and \
            all(_checked(codec, [p], n) for p, n in zip(gathered, sizes) if n):
        # Kept as the payloads: the pipeline's check sums them without decoding, and its
        # write decodes them straight into the gradient.
        aggregate = PackedContribution(codec, kernel, gathered, sizes, x.shape)
        return Outcome(aggregate, sent, sum(payload_sizes), new_state)
    aggregate = buffers.empty(flat.numel(), torch.float32,
                              pool_min_bytes=kernels.STEP_POOL_MIN_BYTES)
    for p, part in zip(gathered, _parts(aggregate, sizes)):
        n = part.numel()
        if not n:
            continue
        if _checked(codec, [p], n):
            kernels.decode(kernel, p, n, bucket, *codec.decode_options(), out=part)
        else:
            part.copy_(codec.decode(p, n))
    aggregate = codec.expand(aggregate, ctx.size)
    return Outcome(aggregate.view_as(x), sent, sum(payload_sizes), new_state)
