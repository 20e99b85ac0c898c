"""All-reduce of payloads that cannot be summed as they are (bit-packed codes with scales).

The two-phase scheme of 1-bit Adam (Tang et al. 2021, "1-bit Adam", Alg. 2), as a generator
the pipeline drives (rounds ``scatter`` and ``gather``):

1. Split the flat tensor into one chunk per rank at bucket boundaries; encode each chunk;
   ``alltoall`` sends chunk ``r`` to rank ``r``.
2. Rank ``r`` reduces the ``size`` payloads of its chunk with the scheme's
   :meth:`~hvd_compress.schemes.base.PackedScheme.reduce` (by default it decodes and sums
   them: exactly the sum of what every rank sent; majority vote takes the sign of the sum
   of signs), adds its rank-side residual when the scheme uses error feedback, re-encodes
   the result and keeps ``result - decode(encoded)`` as the new rank-side residual.
3. ``allgather`` of the re-encoded chunks; every rank decodes all of them, so every rank
   ends with the same aggregate (passed through the scheme's
   :meth:`~hvd_compress.schemes.base.PackedScheme.expand`, by default unchanged).

Per rank, traffic is ``2 (size-1)/size`` times the payload, as for a ring all-reduce of the
payload: the wire saving equals the codec's compression rate. Nothing is decoded to float32
before it crosses the wire.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hvd_compress.comm.ops import AllGather, AllToAll
from hvd_compress.native import buffers
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, PackedScheme

CHUNK_RESIDUAL = "chunk_residual"


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

