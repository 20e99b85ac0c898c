"""Errors hvd_compress raises for conditions a user can act on."""

from __future__ import annotations


class NonFiniteGradientError(FloatingPointError):
    """A gradient or its aggregate held NaN or Inf; raised on every rank, state unchanged.

    Attributes:
        names: tensors whose aggregate was non-finite (identical on every rank).
        local: those among them whose input on this rank was already non-finite.
        step: the pipeline step (count of completed exchanges) at which it happened.
    """

    def __init__(self, names: list[str], local: list[str], step: int, rank: int) -> None:
        self.names, self.local, self.step, self.rank = names, local, step, rank
        where = (f"this rank ({rank}) produced non-finite values for {local}" if local
                 else f"this rank ({rank}) sent finite values, so another rank did not")
        super().__init__(
            f"non-finite aggregated gradient for {names} at step {step}: {where}. No "
            "compression state was changed; skip this step (as torch.amp.GradScaler does) "
            "or lower the learning rate. With Compression.fp16, values above 65504 overflow: "
            "use bf16 or gradient_predivide_factor.")
