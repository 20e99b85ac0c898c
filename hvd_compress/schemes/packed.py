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
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence

import torch

from hvd_compress.comm.ops import AllGather, AllToAll
from hvd_compress.native import buffers
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scheme

CHUNK_RESIDUAL = "chunk_residual"
"""The state key of the reducing rank's residual for its chunk (error feedback only)."""


class PackedScheme(Scheme):
    """A scheme whose payloads cannot be summed as they are (bit-packed codes plus scales).

    Subclasses give ``encode``/``decode`` of a flat chunk; the exchange is
    :func:`compressed_allreduce`, which splits the tensor into one chunk per rank at bucket
    boundaries. ``bucket_size`` elements share one scale.
    """

    bucket_size: int = 512

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
    (:class:`~hvd_compress.comm.ops.AllGather`)."""
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
