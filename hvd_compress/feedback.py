"""Error-feedback memory: one residual per tensor.

Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019) sends
``g + e`` instead of ``g`` and keeps what compression lost, ``e <- (g + e) - sent``, so
every gradient component is eventually applied: over ``T`` steps
``sum_t sent_t + e_T = sum_t g_t`` exactly.

Diagnostics: every :meth:`ErrorFeedback.commit_sent` also measures, per tensor, the
compression error ``||sent - (g + e)|| / ||g + e||`` (the relative size of what this step
did not send; it equals ``||e_new|| / ||g + e||`` since ``e_new = (g + e) - sent``) and the
new residual's norm ``||e_new||``; :meth:`ErrorFeedback.report` returns the latest of both
per tensor. Healthy error feedback keeps the residual bounded (for a contractive
compressor, ``||e|| <= sqrt(1 - delta) / (1 - sqrt(1 - delta)) max ||g||``; Karimireddy et
al. 2019). A residual that keeps growing means the compressor is not keeping up (too little
is sent for the learning rate, or the optimizer amplifies the delayed components): when a
tensor's residual norm exceeds ``growth`` times the largest it had during its first
``window`` non-zero commits, :class:`ResidualGrowthWarning` names the tensor (once per
tensor). ``warnings.simplefilter("error", ResidualGrowthWarning)`` turns it into an
exception that stops the run.

LoCo's compensator (Xie et al. 2024, "LoCo: Low-Bit Communication Adaptor for Large-scale
Model Training", arXiv 2407.04480) is an option of the same memory, ``beta`` (the
schemes' ``loco_beta=``). The rank still sends ``x = g + e`` and the compression error of
this step is still ``x - sent``, but the residual becomes a moving average of those
errors instead of the latest one::

    e_new = beta * e + (1 - beta) * ((g + e) - sent)

``beta = 0`` is the plain residual (the default, computed by the same code as before, bit
for bit). With ``beta > 0`` the residual is a smoothed estimate of the error the compressor
keeps making, which the paper finds steadier than the plain residual for low-bit
compressors under Adam; the price is the exact accounting: ``sum_t sent_t + e_T`` no longer
equals ``sum_t g_t`` (a fraction ``beta`` of each step's error is carried and
``1 - beta`` of it replaced, so each error is applied with weight ``1 - beta`` until the
next errors overwrite it). DeepSpeed's implementation uses ``beta = 0.8`` (its
``err_beta``); the paper also stores the residual in 8 bits and resets it periodically,
neither of which is done here (it is kept in float32 and never reset).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from hvd_compress.schemes.base import Dense, Scattered, subtract


def check_loco_beta(scheme: str, beta: float) -> float:
    """``beta`` as a float if it is a valid LoCo weight, ``0 <= beta < 1``; otherwise a
    ``ValueError`` naming ``scheme``."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        raise ValueError(f"{scheme}: loco_beta must be a number in [0, 1) (0: the plain "
                         f"residual; LoCo's moving average otherwise, e.g. 0.8), got "
                         f"{beta!r}")
    return float(beta)


def density_of(sent: Dense | None, numel: int) -> float:
    """The fraction of a tensor's ``numel`` entries a contribution ``sent`` carries: ``k /
    n`` for ``k`` pairs (:class:`Scattered`, sparse schemes), 1 for a dense or low-rank one
    or for a tensor sent exactly (``None``), and 0 for an empty tensor."""
    if not numel:
        return 0.0
    if isinstance(sent, Scattered):
        return sent.indices.numel() / numel
    return 1.0


class ResidualGrowthWarning(UserWarning):
    """A tensor's error-feedback residual has grown far beyond its early size."""


@dataclass(frozen=True)
class FeedbackStats:
    """One tensor's error feedback at its latest committed step.

    ``steps``: residual updates so far; ``input_norm``: ``||g + e||`` (what was to be
    sent); ``residual_norm``: ``||e_new||``; ``compression_error``: ``residual_norm /
    input_norm``, i.e. ``||sent - (g + e)|| / ||g + e||`` (0 when the input was 0);
    ``reference``: the largest residual norm of the first ``window`` non-zero commits (the
    yardstick of the growth warning); ``growth``: ``residual_norm / reference``;
    ``density``: the fraction of the tensor's entries this rank sent at that step
    (:func:`density_of`: the pairs' share for sparse schemes, whose density a threshold
    makes vary from step to step; 1 for the dense and low-rank ones). With LoCo
    (``beta > 0``) ``compression_error`` is still that of the step, ``||(g + e) - sent|| /
    ||g + e||``, while ``residual_norm`` is the averaged residual's."""

    steps: int
    input_norm: float
    residual_norm: float
    compression_error: float
    reference: float
    density: float = 1.0

    @property
    def growth(self) -> float:
        return self.residual_norm / self.reference if self.reference > 0 else 0.0


class ErrorFeedback:
    """Residuals keyed by tensor name.

    Each tensor has two float32 buffers that trade places every step, so a step allocates
    nothing: :meth:`compensate` writes ``g + e`` into the spare one, and :meth:`commit_sent`
    turns that buffer into the new residual in place (``(g + e) - sent``), handing the old
    residual's buffer back as the spare. Until :meth:`commit_sent` the residual is
    untouched, so a step that fails leaves it as it was.

    Args:
        growth: warn (:class:`ResidualGrowthWarning`) when a residual's norm exceeds this
            many times its reference (see the module docstring). Default 30. Measured on
            digits (2 ranks, SGD lr 0.1, 600 steps, the largest ratio per tensor): runs
            that trained stayed below 14x (1-bit with momentum 0.5: 3.9x; random-k 0.01
            and top-k 0.001 with momentum 0 to 0.9: up to 13.8x, a sparse residual fills
            up over about ``1 / ratio`` steps), while the runs that failed under momentum
            0.9 reached 75x (1-bit, 61.7% test accuracy) and 64x (random-k, 19.4%).
            ``None``: never warn (the statistics are still kept).
        window: commits with a non-zero residual that set the reference. Default 20, long
            enough for the residual to fill up (it starts at zero) and short enough to be
            over before a divergence takes hold.
        beta: LoCo's moving-average weight on the old residual (module docstring), in
            ``[0, 1)``. Default 0: the plain residual ``e <- (g + e) - sent``.
    """

    def __init__(self, growth: float | None = 30.0, window: int = 20,
                 beta: float = 0.0) -> None:
        if growth is not None and not growth > 1:
            raise ValueError(f"error feedback: growth must be > 1 or None, got {growth}")
        if window < 1:
            raise ValueError(f"error feedback: window must be >= 1, got {window}")
        self.growth = growth
        self.window = window
        self.beta = check_loco_beta("error feedback", beta)
        self._residuals: dict[str, torch.Tensor] = {}
        self._spares: dict[str, torch.Tensor] = {}
        self._stats: dict[str, FeedbackStats] = {}
        self._early: dict[str, int] = {}  # non-zero commits counted into the reference
        self._warned: set[str] = set()

    def compensate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``g + e`` in float32, in a buffer of this object's (never ``grad`` itself)."""
        residual = self._residuals.get(name)
        if residual is not None and residual.shape != grad.shape:
            raise ValueError(f"error feedback: residual of {name!r} has shape "
                             f"{tuple(residual.shape)} but its gradient has {tuple(grad.shape)}")
        out = self._spares.pop(name, None)
        if out is None or out.shape != grad.shape or out.device != grad.device:
            out = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
        if residual is None:
            return out.copy_(grad)
        return torch.add(grad, residual.to(grad.device), out=out)

    @classmethod
    def for_scheme(cls, scheme: object) -> ErrorFeedback:
        """The memory a scheme asks for: LoCo's moving average with the scheme's
        ``loco_beta`` if it has a non-zero one, the plain residual otherwise. A scheme that
        routes tensors to another one (``Compression.auto(scheme)``, its ``scheme``) asks
        for what that one asks for."""
        beta = getattr(scheme, "loco_beta", None)
        if beta is None:
            beta = getattr(getattr(scheme, "scheme", None), "loco_beta", None)
        return cls(beta=beta or 0.0)

    def commit_sent(self, name: str, compensated: torch.Tensor, sent: Dense | None) -> None:
        """Keep ``compensated - sent`` as the residual (with LoCo, its moving average with
        the old residual), computed in place in ``compensated`` (the buffer
        :meth:`compensate` returned); ``sent=None``: nothing was lost, the tensor has no
        residual."""
        old = self._residuals.pop(name, None)
        input_norm = float(torch.linalg.vector_norm(compensated))
        density = density_of(sent, compensated.numel())
        if sent is None:
            self._spares[name] = compensated
            residual_norm = error_norm = 0.0
        else:
            residual = subtract(compensated, sent)
            residual_norm = error_norm = float(torch.linalg.vector_norm(residual))
            if self.beta:  # e_new = beta * e + (1 - beta) * ((g + e) - sent), in place
                residual.mul_(1 - self.beta)
                if old is not None:  # (no old residual: e = 0)
                    residual.add_(old.to(residual.device), alpha=self.beta)
                residual_norm = float(torch.linalg.vector_norm(residual))
            self._residuals[name] = residual
        if old is not None and old.shape == compensated.shape:
            self._spares.setdefault(name, old)
        self._observe(name, input_norm, residual_norm, error_norm, density)

    def _observe(self, name: str, input_norm: float, residual_norm: float,
                 error_norm: float, density: float = 1.0) -> None:
        previous = self._stats.get(name)
        reference = previous.reference if previous is not None else 0.0
        early = self._early.get(name, 0)
        if early < self.window and residual_norm > 0 and math.isfinite(residual_norm):
            reference = max(reference, residual_norm)
            self._early[name] = early + 1
        error = error_norm / input_norm if input_norm > 0 else 0.0
        stats = FeedbackStats((previous.steps if previous else 0) + 1, input_norm,
                              residual_norm, error, reference, density)
        self._stats[name] = stats
        if (self.growth is not None and name not in self._warned
                and self._early.get(name, 0) >= self.window
                and stats.growth > self.growth):
            self._warned.add(name)
            warnings.warn(ResidualGrowthWarning(
                f"error feedback: the residual of {name!r} has grown to {residual_norm:.3g}, "
                f"{stats.growth:.0f}x its early size {reference:.3g}, after {stats.steps} "
                f"steps (compression error ||sent - (g+e)|| / ||g+e|| = {error:.3g}): "
                "compression is not keeping up and training is likely diverging. Send more "
                "(a larger ratio, rank or bucket count), lower the learning rate or the "
                "optimizer's momentum."), stacklevel=4)

    def report(self) -> dict[str, FeedbackStats]:
        """Each tensor's :class:`FeedbackStats` at its latest committed step (tensors whose
        scheme uses error feedback; the others have no residual), in name order."""
        return dict(sorted(self._stats.items()))

    def get(self, name: str) -> torch.Tensor | None:
        return self._residuals.get(name)

    def state_dict(self) -> dict[str, Any]:
        return {name: r.detach().clone() for name, r in self._residuals.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the residuals; the statistics and the growth references start afresh."""
        self._residuals = {name: torch.as_tensor(r).clone() for name, r in state.items()}
        self._spares.clear()
        self._stats.clear()
        self._early.clear()
        self._warned.clear()
