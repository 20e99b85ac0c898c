"""A dense warm-up for schemes with error feedback: their first exchanges of each tensor are
plain all-reduces.

PowerSGD starts this way because early gradients change fast; under Adam's family it also
lets the optimizer's second moment start from the exact gradients. A scheme offering the
option stores ``self.start_iter = check_start_iter(self.name, start_iter)`` and begins its
``exchange`` with::

    if ctx.step < self.start_iter:
        return (yield from dense_warmup(x, state))

The exchange counter ``ctx.step`` is per tensor and restored with the optimizer's state, so a
resumed run ends its warm-up at the same step as an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hvd_compress.comm.ops import AllReduce
from hvd_compress.schemes.base import Exchange, Outcome


def check_start_iter(scheme: str, start_iter: int) -> int:
    """``start_iter``, checked: a whole number of exchanges, 0 or more (0: no warm-up).
    ``ValueError`` naming ``scheme`` otherwise."""
    if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
        raise ValueError(f"{scheme}: start_iter (the number of uncompressed exchanges of each "
                         f"tensor before compression starts) must be an integer >= 0, got "
                         f"{start_iter!r}")
    return start_iter


def dense_warmup(x: torch.Tensor, state: Mapping[str, torch.Tensor]) -> Exchange:
    """One uncompressed exchange: the float32 all-reduce of ``x`` (round ``dense``), sent
    exactly (``sent=None``: error feedback keeps no residual), the scheme's state kept as
    it is and ``4 n`` bytes counted."""
    total = yield AllReduce("dense", x)
    return Outcome(total, None, 4 * x.numel(), dict(state))
