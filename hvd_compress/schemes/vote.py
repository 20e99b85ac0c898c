"""signSGD with majority vote, and Signum (its momentum variant)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hvd_compress import wire
from hvd_compress.schemes.base import Exchange, ExchangeContext, optimizer_momentum
from hvd_compress.schemes.packed import PackedScheme

MOMENTUM = "momentum"


class MajorityVote(PackedScheme):
    """signSGD with majority vote (Bernstein et al. 2018, "signSGD: Compressed Optimisation
    for Non-Convex Problems"; Bernstein et al. 2019, "signSGD with Majority Vote is
    Communication Efficient and Fault Tolerant").

    Every rank ``i`` sends the signs of its gradient ``g_i`` (1 bit per element); the
    aggregate is their majority vote, and the update the optimizer applies is ``lr * vote``::

        vote = sign(sum_i sign(g_i))

    Exactly that vote goes through the compressed all-reduce
    (:mod:`hvd_compress.schemes.packed`): the rank reducing a chunk counts the
    signs it received (:meth:`reduce`, an exact integer sum), takes the sign of the count
    and sends it back as 1 bit per element. Ties (an even number of ranks, half of them
    each way) count as ``+1``, as a sign bit of a non-negative number does: with 2 ranks
    that disagree the vote is ``+1``. There is no scale and no error feedback: the vote is
    the update direction, every element moves by the learning rate, and the learning rate
    must be chosen for that (about 1e-3 to 1e-2 with plain SGD; Adam-like step sizes).

    The pipeline averages what it receives, so :meth:`expand` hands it ``size * vote``
    and the gradient written for the optimizer is the vote itself, ``+1`` or ``-1``
    (``op=hvd.Sum`` gives ``size * vote``).

    ``momentum > 0`` is Signum (the same papers): each rank keeps
    ``m <- momentum * m + (1 - momentum) g`` and votes with ``sign(m)``; its ``m`` is part
    of the scheme's state (so of the optimizer's ``state_dict``). The wrapped optimizer
    must then run without momentum of its own (:meth:`check_optimizer` refuses one). Signum
    with ``momentum=0.9`` is the papers' recommended setting; the default, 0, is signSGD.

    Non-finite gradients are not voted away: each chunk carries one flag byte set when any
    of its inputs was NaN or infinite; the reduction propagates it, the chunk decodes to
    NaN, and the pipeline raises its non-finite error on every rank.

    Wire: ``ceil(n/8)`` bytes of sign bits (1 = non-negative; :func:`wire.pack_bits`) plus
    one flag byte per chunk, both ways: 32x smaller than float32 for large tensors.
    """

    name = "vote"
    sliceable = True
    error_feedback = False
    bucket_size = 8  # chunks split at byte boundaries of the sign bits

    def __init__(self, momentum: float = 0.0) -> None:
        if not 0 <= momentum < 1:
            raise ValueError(f"vote: momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum

    def chunk_bytes(self, numel: int) -> int:
        return wire.bits_nbytes(numel) + 1

    def encode(self, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        # The flag is computed on the tensor's device: no host synchronisation.
        flag = x.isfinite().logical_not_().any().to(torch.uint8).reshape(1)
        return torch.cat([wire.pack_bits(x >= 0), flag])

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        """``+1``/``-1`` per element; every element NaN when the payload's flag is set."""
        bits, flag = wire.split_sections(payload, [wire.bits_nbytes(numel), 1], "vote payload")
        # 2 b - 1, or 2 b - NaN for a flagged payload: one pass, no host synchronisation.
        offset = torch.where(flag.bool(), float("nan"), 1.0)
        return wire.unpack_bits(bits, numel).to(torch.float32).mul_(2).sub_(offset)

    def reduce(self, payloads: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """The vote on this chunk: ``sign(sum of signs)``, ties ``+1``; NaN if any rank
        flagged a non-finite input (its payload decodes to NaN, so the count is NaN and
        re-encoding sets the flag again)."""
        if not numel:
            return torch.zeros(0, dtype=torch.float32, device=payloads[0].device)
        count = super().reduce(payloads, numel)  # an integer count in float32, exact
        # clamp keeps NaN (and makes every other count 1): -1 below zero, else +1 or NaN.
        return torch.where(count < 0, -1.0, count.clamp(1.0, 1.0))

    def expand(self, aggregate: torch.Tensor, size: int) -> torch.Tensor:
        return aggregate.mul_(size)

    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        if not self.momentum:
            return (yield from super().exchange(x, state, ctx))
        m = state.get(MOMENTUM)
        m = x * (1 - self.momentum) if m is None else m * self.momentum + x * (1 - self.momentum)
        outcome = yield from super().exchange(m, state, ctx)
        outcome.state[MOMENTUM] = m
        return outcome

    def check_optimizer(self, optimizer: Any) -> None:
        """With ``momentum > 0`` (Signum), ``ValueError`` if the wrapped optimizer has
        momentum of its own: both would compound."""
        if not self.momentum:
            return
        found = optimizer_momentum(optimizer)
        if found is not None:
            raise ValueError(
                f"Compression.vote(momentum={self.momentum}) (Signum) applies momentum "
                f"before the vote, but the wrapped optimizer {type(optimizer).__name__} "
                f"has momentum={found[1]} in parameter group {found[0]}: construct it with "
                f"momentum=0")

    def options(self) -> dict[str, Any]:
        return {"momentum": self.momentum}
