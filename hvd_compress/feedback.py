"""Error-feedback memory: one residual per tensor.

Error feedback (Seide et al. 2014; Stich et al. 2018; Karimireddy et al. 2019) sends
``g + e`` instead of ``g`` and keeps what compression lost, ``e <- (g + e) - sent``, so
every gradient component is eventually applied: over ``T`` steps
``sum_t sent_t + e_T = sum_t g_t`` exactly.

Diagnostics: :meth:`ErrorFeedback.commit_sent` also measures (when :meth:`ErrorFeedback.due`
says so: each of a tensor's first ``window`` commits, then every ``report_every``-th), the
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

Schemes without this memory are reported too, so that every compressed tensor has its
figures (:meth:`ErrorFeedback.observe_sent`, :meth:`ErrorFeedback.observe_own`):

* A scheme that keeps a residual of its own (DGC's accumulated velocity ``v``, the
  :class:`KeepsResidual` protocol) reports ``||v_new||`` as the residual norm and
  ``||v_new|| / ||v||`` as the compression error (``v`` what it compressed, ``v_new =
  v - sent`` what it kept), and its residual is watched by the same growth warning.
* Any other scheme (float16/bfloat16, TernGrad and QSGD without ``error_feedback=True``,
  the majority vote) reports ``||decode(sent) - x|| / ||x||`` for the ``x`` it was given,
  with no residual (``residual_norm`` 0, never a warning). For a compressed all-reduce the
  decoded contribution comes from the payload this rank sent (:func:`watch_scatter`,
  :func:`payload_distance`: one decoding pass the scheme did not need otherwise), for the
  others from the outcome's ``sent``.

What healthy values look like depends on the family (docs/benchmarks.md has them per scheme).
float16 and bfloat16 show their relative rounding (at most ``2**-11`` and ``2**-8`` per
element). The unbiased stochastic quantisers are noisy by design: TernGrad's and QSGD's
error is of the order of the gradient itself (TernGrad's ``E ||T(v) - v||^2 = sum_i
|v_i| (s - |v_i|)``), and that is not a sign of trouble, since an unbiased estimate
averages out over ranks and steps; no warning is given for it. What is worth watching is a
change of level within a run. The sparsifiers send a small share of the largest entries
of what they were given (with the residual or the velocity, which hold far more than one
gradient), so their error stays close to 1 by construction; their residual's growth
(``growth``, against the warning's threshold) is the figure to watch. For the vote
``decode(sent)`` is the sign, ``+1`` or ``-1``, so its error measures the gradient's scale
(about ``sqrt(n) / ||x||``), not the vote's quality.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from hvd_compress import native
from hvd_compress.comm.ops import AllToAll
from hvd_compress.schemes.base import (
    Dense,
    Exchange,
    Outcome,
    Scattered,
    check_loco_beta,
    materialize,
    subtract,
)
from hvd_compress.schemes.packed import PackedScheme, chunk_sizes

FEEDBACK = "error feedback"
"""``FeedbackStats.residual`` of a tensor whose residual is the pipeline's memory."""
NO_RESIDUAL = "none"
"""``FeedbackStats.residual`` of a tensor whose scheme keeps no residual."""


def density_of(sent: Dense | None, numel: int) -> float:
    """The fraction of a tensor's ``numel`` entries a contribution ``sent`` carries: ``k /
    n`` for ``k`` pairs (:class:`Scattered`, sparse schemes), 1 for a dense or low-rank one
    or for a tensor sent exactly (``None``), and 0 for an empty tensor."""
    if not numel:
        return 0.0
    if isinstance(sent, Scattered):
        return sent.indices.numel() / numel
    return 1.0


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x))


def norms_of(tensors: Sequence[torch.Tensor]) -> list[float]:
    """The 2-norm of each tensor (float32), as :func:`torch.linalg.vector_norm` computes
    it, taken by one ``torch._foreach_norm`` and brought to the host in one transfer: no
    Python per tensor, which on a model of many small tensors costs more than the norms.
    Tensors on several devices are moved to the first one's for the call."""
    if not tensors:
        return []
    if len({t.device for t in tensors}) > 1:
        tensors = [t.to(tensors[0].device) for t in tensors]
    return torch.stack(torch._foreach_norm(list(tensors), 2, dtype=torch.float32)).tolist()


class Commit(NamedTuple):
    """The arguments of one :meth:`ErrorFeedback.commit_sent`, for
    :meth:`ErrorFeedback.commit_many`."""

    name: str
    compensated: torch.Tensor
    sent: Dense | None
    scheme: str = ""
    measure: bool = True


class Candidate(NamedTuple):
    """A residual update computed but not yet kept (:meth:`ErrorFeedback.prepare`):
    ``residual`` is the new residual (in the ``compensated`` buffer) or ``None`` (the
    tensor keeps none); ``norms`` ``(||g + e||, ||e_new||, ||(g + e) - sent||)`` when the
    commit is measured, else ``None``."""

    name: str
    compensated: torch.Tensor
    residual: torch.Tensor | None
    density: float
    scheme: str
    norms: tuple[float, float, float] | None


BLOCK = 1 << 17
"""Elements per block of :func:`block_norms` (512 kB of float32: a block stays in cache
between its two norms)."""


def block_norms(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """``(||x||, ||x - y||)`` of two flat tensors of equal length (``y`` of any float
    dtype), block by block through one cache-sized scratch buffer: both are read from
    memory once and nothing of their size is written (on a CPU a full-size difference's
    write pass costs more than the reads)."""
    if not x.numel():
        return 0.0, 0.0
    scratch = torch.empty(min(BLOCK, x.numel()), dtype=torch.float32, device=x.device)
    norms = []
    for start in range(0, x.numel(), BLOCK):
        xb, yb = x[start:start + BLOCK], y[start:start + BLOCK]
        norms.append(torch.linalg.vector_norm(xb))
        norms.append(torch.linalg.vector_norm(torch.sub(xb, yb, out=scratch[:xb.numel()])))
    x_norm, distance_ = torch.linalg.vector_norm(torch.stack(norms).view(-1, 2), dim=0)
    return float(x_norm), float(distance_)


def distance(x: torch.Tensor, sent: Dense | None) -> tuple[float, float]:
    """``(||x||, ||x - sent||)`` without changing either. A :class:`Scattered` ``sent``
    costs ``||x||`` and ``k`` entries: ``||x - sent||^2 = ||x||^2 - ||x[I]||^2 +
    ||x[I] - values||^2`` over its indices ``I``; a dense one :func:`block_norms`, a
    :class:`LowRank` one its product first; ``None`` (sent exactly) is ``||x||`` and 0."""
    flat = x.reshape(-1)
    if sent is None or isinstance(sent, Scattered):
        x_norm = _norm(flat)
        return x_norm, 0.0 if sent is None else scattered_norm(flat, x_norm, sent, -1.0)
    return block_norms(flat, materialize(sent).reshape(-1))


def scattered_norm(base: torch.Tensor, base_norm: float, pairs: Scattered,
                   sign: float) -> float:
    """``||base + sign * pairs||`` for a flat ``base`` of norm ``base_norm``, from the
    ``k`` entries the pairs touch: ``base_norm^2 - ||base[I]||^2 + ||base[I] + sign *
    values||^2`` over their indices ``I`` (clamped at 0 against rounding)."""
    picked = base[pairs.indices].float()
    squared = (base_norm ** 2 - float(picked.square().sum())
               + float((picked + sign * pairs.values.float()).square().sum()))
    return math.sqrt(max(squared, 0.0))


def payload_distance(codec: PackedScheme, scatter: AllToAll, x: torch.Tensor,
                     size: int) -> tuple[float, float]:
    """``(||x||, ||decode(sent) - x||)`` for the ``scatter`` request of ``codec``'s
    compressed all-reduce of ``x`` on ``size`` ranks
    (:mod:`hvd_compress.schemes.packed`): its tensor is this rank's payloads of
    the chunks of ``x`` (:func:`~hvd_compress.schemes.packed.chunk_sizes`) one
    after the other, ``splits`` their bytes. Each chunk is decoded (one write pass of its
    float32 values, the cost a scheme without error feedback does not otherwise pay) and
    compared with its slice of ``x`` by :func:`block_norms`."""
    flat = x.reshape(-1)
    counts = chunk_sizes(flat.numel(), size, codec.bucket_size)
    pieces = torch.split(scatter.tensor.reshape(-1), list(scatter.splits))
    x_squared = squared = 0.0
    offset = 0
    for piece, count in zip(pieces, counts, strict=True):
        if count:
            x_norm, error = block_norms(flat[offset:offset + count], codec.decode(piece, count))
            x_squared, squared = x_squared + x_norm ** 2, squared + error ** 2
        offset += count
    return math.sqrt(x_squared), math.sqrt(squared)


def watch_scatter(exchange: Exchange, keep: Callable[[AllToAll], None]) -> Exchange:
    """``exchange`` unchanged, handing its first ``scatter`` all-to-all request to
    ``keep`` as it passes (what :func:`payload_distance` measures a compressed
    all-reduce's error from, once the step has succeeded)."""
    result: Any = None
    kept = False
    try:
        while True:
            try:
                request = exchange.send(result)
            except StopIteration as done:
                outcome: Outcome = done.value
                return outcome
            if not kept and isinstance(request, AllToAll) and request.round == "scatter":
                keep(request)
                kept = True
            result = yield request
    finally:
        exchange.close()


@runtime_checkable
class KeepsResidual(Protocol):
    """A scheme that keeps what it did not send in state of its own instead of the
    pipeline's error-feedback memory (DGC's accumulated velocity).

    ``residual_name`` says what the residual is, for the report and the growth warning;
    :meth:`own_residual` finds it in the tensor's committed scheme state (``None`` if the
    state holds none yet)."""

    residual_name: str

    def own_residual(self, state: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The residual kept in ``state`` (any shape; its norm is what is reported)."""


class ResidualGrowthWarning(UserWarning):
    """A tensor's residual (error feedback's, or a scheme's own such as DGC's velocity)
    has grown far beyond its early size."""


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
    ||g + e||``, while ``residual_norm`` is the averaged residual's.

    ``scheme``: the name of the scheme that sent the tensor (``"terngrad"``, ...);
    ``residual``: what ``residual_norm`` is the norm of: :data:`FEEDBACK` (the pipeline's
    error-feedback residual), a scheme's own (``"velocity"`` for DGC: then ``input_norm``
    is ``||v||``, what DGC compressed), or :data:`NO_RESIDUAL` (the scheme keeps none:
    ``residual_norm`` and ``reference`` are 0, ``input_norm`` is ``||x||`` of the tensor
    the scheme was given and ``compression_error`` is ``||decode(sent) - x|| / ||x||``).
    The module docstring says what healthy values of each family look like."""

    steps: int
    input_norm: float
    residual_norm: float
    compression_error: float
    reference: float
    density: float = 1.0
    scheme: str = ""
    residual: str = FEEDBACK

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
            many times its reference (see the module docstring). Default 30, between the
            growth of runs that trained and that of runs that diverged (a sparse residual
            fills up over about ``1 / ratio`` steps; see docs/benchmarks.md).
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
        self._commits: dict[str, int] = {}  # every commit, measured or not
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

    def due(self, name: str, every: int) -> bool:
        """Whether the next :meth:`commit_sent` of ``name`` should measure: each of its
        first ``window`` non-zero commits (they set the growth warning's reference), then
        every ``every``-th commit (``0``: none after the window). A measurement costs two
        reads of the tensor and two device-to-host transfers."""
        if self._early.get(name, 0) < self.window:
            return True
        return every > 0 and self._commits.get(name, 0) % every == 0

    def commit_sent(self, name: str, compensated: torch.Tensor, sent: Dense | None,
                    scheme: str = "", measure: bool = True) -> None:
        """Keep ``compensated - sent`` as the residual (with LoCo, its moving average with
        the old residual), computed in place in ``compensated`` (the buffer
        :meth:`compensate` returned); ``sent=None``: nothing was lost, the tensor has no
        residual. ``scheme``: the sending scheme's name, for the report. ``measure``:
        record this commit's norms in the report and check the growth warning (see
        :meth:`due`); the residual is the same either way. :meth:`prepare` then
        :meth:`install` of this one commit."""
        self.install(self.prepare([Commit(name, compensated, sent, scheme, measure)]))

    def commit_many(self, commits: Sequence[Commit]) -> None:
        """:meth:`commit_sent` of each of ``commits`` (distinct names), with the same
        residuals and report, the norms the measured ones need taken together
        (:func:`norms_of`), so that a step of many small tensors pays no Python and no host
        transfer per tensor for them."""
        self.install(self.prepare(commits))

    def prepare(self, commits: Sequence[Commit]) -> list[Candidate]:
        """The first half of :meth:`commit_many`: each commit's new residual computed in
        place in its ``compensated`` buffer (``compensated - sent``; with LoCo, mixed with
        the current residual, which is only read) and, for the measured ones, its norms
        (:func:`norms_of`: the inputs' before the subtraction, the residuals' after).
        Nothing this object holds changes (residuals, spares, counters, report): a step
        that fails after this simply drops the candidates; :meth:`install` keeps them.
        ``compensated`` no longer holds ``g + e`` afterwards (the pipeline keeps a failed
        tensor's input intact by never preparing it). Distinct names; a name's
        :meth:`due` must have been read before its :meth:`install`."""
        measured = [c for c in commits if c.measure]
        inputs = dict(zip([c.name for c in measured],
                          norms_of([c.compensated for c in measured]), strict=True))
        residuals = {c.name: subtract(c.compensated, c.sent)
                     for c in commits if c.sent is not None}
        kept = [c.name for c in measured if c.sent is not None]
        errors = dict(zip(kept, norms_of([residuals[n] for n in kept]), strict=True))
        after = errors
        if self.beta:  # e_new = beta * e + (1 - beta) * ((g + e) - sent), in place
            for name, residual in residuals.items():
                residual.mul_(1 - self.beta)
                old = self._residuals.get(name)
                if old is not None:  # (no old residual: e = 0)
                    residual.add_(old.to(residual.device), alpha=self.beta)
            after = dict(zip(kept, norms_of([residuals[n] for n in kept]), strict=True))
        return [Candidate(c.name, c.compensated, residuals.get(c.name),
                          density_of(c.sent, c.compensated.numel()), c.scheme,
                          (inputs[c.name], after.get(c.name, 0.0), errors.get(c.name, 0.0))
                          if c.measure else None)
                for c in commits]

    def install(self, candidates: Sequence[Candidate]) -> None:
        """The second half of :meth:`commit_many`: each candidate's residual becomes the
        tensor's (none if it has none), the residual it replaces becomes the spare buffer
        (:meth:`compensate`'s next output), the commit is counted and, if measured, its
        norms recorded and the growth warning checked."""
        for c in candidates:
            old = self._residuals.pop(c.name, None)
            self._commits[c.name] = self._commits.get(c.name, 0) + 1
            if c.residual is None:
                self._spares[c.name] = c.compensated
            else:
                self._residuals[c.name] = c.residual
            if old is not None and old.shape == c.compensated.shape:
                self._spares.setdefault(c.name, old)
            if c.norms is not None:
                self._observe(c.name, *c.norms, c.density, c.scheme)

    def observe_sent(self, name: str, x: torch.Tensor, sent: Dense | None,
                     scheme: str = "") -> None:
        """Record the step of a tensor whose scheme keeps no residual: its compression
        error ``||sent - x|| / ||x||`` (``x`` the tensor the scheme was given, ``sent`` its
        contribution as decoded, ``None`` if exact; neither is changed; :func:`distance`).
        Never warns: there is no residual to grow."""
        input_norm, error_norm = distance(x, sent)
        self.observe_error(name, input_norm, error_norm, density_of(sent, x.numel()), scheme)

    def observe_error(self, name: str, input_norm: float, error_norm: float,
                      density: float = 1.0, scheme: str = "") -> None:
        """Record the step of a tensor whose scheme keeps no residual from the norms the
        caller measured: ``||x||`` and ``||decode(sent) - x||`` (:func:`payload_distance`
        for a compressed all-reduce)."""
        self._observe(name, input_norm, 0.0, error_norm, density, scheme, NO_RESIDUAL)

    def observe_own(self, name: str, residual: torch.Tensor, sent: Dense | None,
                    scheme: str = "", what: str = "residual") -> None:
        """Record the step of a tensor whose scheme keeps its own residual
        (:class:`KeepsResidual`): ``residual`` is what it kept after sending ``sent`` from
        ``residual + sent`` (DGC: its velocity after and before the step). Reports
        ``||residual||``, the error ``||residual|| / ||residual + sent||``, and warns as
        for error feedback when the residual grows without bound (``what`` names it in
        the warning). One pass over ``residual`` plus ``k`` entries for a sparse
        ``sent``."""
        residual_norm = _norm(residual)
        if sent is None:
            input_norm = residual_norm
        elif isinstance(sent, Scattered):  # ||r + s|| from r's norm and the k entries
            input_norm = scattered_norm(residual.reshape(-1), residual_norm, sent, 1.0)
        else:
            before = native.empty(residual.numel(), torch.float32, residual.device)
            torch.add(residual.reshape(-1), materialize(sent).reshape(-1), out=before)
            input_norm = _norm(before)
        self._observe(name, input_norm, residual_norm, residual_norm,
                      density_of(sent, residual.numel()), scheme, what)

    def _observe(self, name: str, input_norm: float, residual_norm: float,
                 error_norm: float, density: float = 1.0, scheme: str = "",
                 residual: str = FEEDBACK) -> None:
        previous = self._stats.get(name)
        reference = previous.reference if previous is not None else 0.0
        early = self._early.get(name, 0)
        if early < self.window and residual_norm > 0 and math.isfinite(residual_norm):
            reference = max(reference, residual_norm)
            self._early[name] = early + 1
        error = error_norm / input_norm if input_norm > 0 else 0.0
        stats = FeedbackStats((previous.steps if previous else 0) + 1, input_norm,
                              residual_norm, error, reference, density, scheme, residual)
        self._stats[name] = stats
        if (self.growth is not None and name not in self._warned
                and self._early.get(name, 0) >= self.window
                and stats.growth > self.growth):
            self._warned.add(name)
            if residual == FEEDBACK:
                what, sent = "error feedback: the residual", "||sent - (g+e)|| / ||g+e||"
                advice = "the optimizer's momentum"
            else:
                what = f"{scheme or 'the scheme'}: its {residual} (what it keeps unsent)"
                sent, advice = "||v_new|| / ||v||", "the scheme's momentum"
            warnings.warn(ResidualGrowthWarning(
                f"{what} of {name!r} has grown to {residual_norm:.3g}, {stats.growth:.0f}x "
                f"its early size {reference:.3g}, after {stats.steps} steps (compression "
                f"error {sent} = {error:.3g}): compression is not keeping up and "
                "training is likely diverging. Send more (a larger ratio, rank or bucket "
                f"count), lower the learning rate or {advice}."), stacklevel=4)

    def report(self) -> dict[str, FeedbackStats]:
        """Each compressed tensor's :class:`FeedbackStats` at its latest committed step, in
        name order: the tensors with error feedback, and those the pipeline recorded with
        :meth:`observe_sent` or :meth:`observe_own` (every compressed tensor; those sent
        dense are not reported)."""
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
        self._commits.clear()
        self._warned.clear()
