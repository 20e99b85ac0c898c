"""What the optimizers report about compression: a readable summary, a plain dict, and a
logger that sends it every N steps to TensorBoard or any callable.

:class:`CompressionStats` is a read-only copy of a :class:`~hvd_compress.pipeline.StepStats`
(the pipeline's counters of one step, or of all steps so far) with plain ``dict`` fields:
``str(stats)`` is a short summary, :meth:`CompressionStats.to_dict` a dict of numbers and
dicts of numbers, :meth:`CompressionStats.scalars` the same flattened to
``"prefix/name" -> number`` (the tags a TensorBoard writer takes). Both bindings return it
from ``optimizer.compression_stats`` / ``compression_totals``; :class:`StatsLogger` is the
hook behind ``optimizer.log_compression_stats``. :func:`feedback_scalars` and
:func:`feedback_summary` do the same for ``optimizer.compression_feedback`` (the per-tensor
compression errors and residual norms of :mod:`hvd_compress.feedback`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hvd_compress.feedback import NO_RESIDUAL, FeedbackStats
from hvd_compress.pipeline import StepStats


def _size(n: float) -> str:
    """Bytes as ``"1.5 MB"`` (decimal units)."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"  # unreachable: the loop returns at GB


@dataclass(frozen=True)
class CompressionStats:
    """Bytes and time of ``steps`` steps on this rank (1 for ``compression_stats``, all
    completed steps for ``compression_totals``); the fields are
    :class:`~hvd_compress.pipeline.StepStats`'s.

    ``payload_bytes``: this rank's encoded gradients; ``dense_bytes``: the same gradients
    as float32; ``ratio``: ``dense_bytes / payload_bytes``; ``collective_bytes``: bytes by
    round name; ``collectives``: collectives started; ``seconds``: time by part of the
    exchange; ``sparse_entries``: entries of the tensors sent as (index, value) pairs by a
    sparse scheme (top-k, random-k, threshold, DGC), ``sent_entries``: the pairs sent for
    them, ``density``: ``sent_entries / sparse_entries`` (over all ``steps``: the mean
    density weighted by tensor size), ``None`` when no tensor went sparse. A threshold's
    density follows the gradients, so this is where to watch it step by step.
    """

    steps: int
    payload_bytes: int = 0
    dense_bytes: int = 0
    compressed_tensors: int = 0
    dense_tensors: int = 0
    collectives: int = 0
    collective_bytes: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    sparse_entries: int = 0
    sent_entries: int = 0

    @classmethod
    def of(cls, stats: StepStats, steps: int) -> CompressionStats:
        """A copy of ``stats`` (its dicts copied as plain dicts, in sorted key order)."""
        return cls(steps, stats.payload_bytes, stats.dense_bytes, stats.compressed_tensors,
                   stats.dense_tensors, stats.collectives,
                   {k: int(v) for k, v in sorted(stats.collective_bytes.items())},
                   {k: float(v) for k, v in sorted(stats.seconds.items())},
                   stats.sparse_entries, stats.sent_entries)

    @property
    def ratio(self) -> float:
        """``dense_bytes / payload_bytes`` (``dense_bytes`` when nothing was sent)."""
        return self.dense_bytes / max(self.payload_bytes, 1)

    @property
    def density(self) -> float | None:
        """``sent_entries / sparse_entries``; ``None`` when no tensor was sent sparse."""
        return self.sent_entries / self.sparse_entries if self.sparse_entries else None

    def to_dict(self) -> dict[str, Any]:
        """Every field, ``ratio`` and ``density``, as plain ints, floats and dicts
        (JSON-serialisable; ``density`` is ``None`` when no tensor was sent sparse)."""
        return {"steps": self.steps, "payload_bytes": self.payload_bytes,
                "dense_bytes": self.dense_bytes, "ratio": self.ratio,
                "compressed_tensors": self.compressed_tensors,
                "dense_tensors": self.dense_tensors, "collectives": self.collectives,
                "collective_bytes": dict(self.collective_bytes),
                "seconds": dict(self.seconds), "sparse_entries": self.sparse_entries,
                "sent_entries": self.sent_entries, "density": self.density}

    def scalars(self, prefix: str = "hvd_compress") -> dict[str, float]:
        """:meth:`to_dict` flattened to ``{"<prefix>/<name>": number}``; the dicts become
        ``<prefix>/bytes/<round>`` and ``<prefix>/seconds/<part>``; ``density`` is left out
        when it is ``None`` (a scalar log takes numbers only)."""
        flat: dict[str, float] = {}
        for key, value in self.to_dict().items():
            if isinstance(value, dict):
                name = "bytes" if key == "collective_bytes" else key
                flat.update({f"{prefix}/{name}/{k}": v for k, v in value.items()})
            elif value is not None:
                flat[f"{prefix}/{key}"] = value
        return flat

    def __str__(self) -> str:
        what = "1 step" if self.steps == 1 else f"{self.steps} steps"
        per_step = self.steps > 1
        lines = [f"{what}: sent {_size(self.payload_bytes)} for {_size(self.dense_bytes)} "
                 f"of float32 gradients ({self.ratio:.1f}x smaller)"
                 + (f", {_size(self.payload_bytes / self.steps)} per step" if per_step
                    else ""),
                 f"  tensors: {self.compressed_tensors} compressed, {self.dense_tensors} "
                 f"dense; {self.collectives} collectives"]
        if self.density is not None:
            lines.append(f"  sparse: {self.sent_entries:,} of {self.sparse_entries:,} "
                         f"entries sent (density {100 * self.density:.3g}%)")
        if self.collective_bytes:
            lines.append("  by round: " + ", ".join(f"{k} {_size(v)}"
                                                    for k, v in self.collective_bytes.items()))
        if self.seconds:
            total = sum(self.seconds.values())
            lines.append(f"  exchange time {total * 1e3:.1f} ms: " + ", ".join(
                f"{k} {v * 1e3:.1f}" for k, v in
                sorted(self.seconds.items(), key=lambda item: -item[1])))
        return "\n".join(lines)


FEEDBACK_FIELDS = ("compression_error", "residual_norm", "growth", "density")
"""The per-tensor figures :func:`feedback_scalars` writes."""


def feedback_scalars(report: Mapping[str, FeedbackStats],
                     prefix: str = "hvd_compress") -> dict[str, float]:
    """A ``compression_feedback`` report flattened to ``{"<prefix>/feedback/<tensor>/
    <figure>": number}`` for each tensor and each of :data:`FEEDBACK_FIELDS` (the tags a
    TensorBoard writer takes: ``for tag, value in feedback_scalars(optimizer.
    compression_feedback).items(): writer.add_scalar(tag, value, step)``). A tensor name's
    dots stay (``0.weight``): TensorBoard groups tags by their first ``/`` only."""
    return {f"{prefix}/feedback/{name}/{figure}": float(getattr(stats, figure))
            for name, stats in report.items() for figure in FEEDBACK_FIELDS}


def feedback_summary(report: Mapping[str, FeedbackStats]) -> str:
    """One line per tensor of a ``compression_feedback`` report: its scheme, compression
    error, residual norm and what that residual is, its growth against its early size,
    and the share of entries sent; ``"no compressed tensor"`` for an empty report."""
    if not report:
        return "no compressed tensor"
    width = max(len(name) for name in report)
    lines = []
    for name, s in report.items():
        residual = ("no residual" if s.residual == NO_RESIDUAL
                    else f"{s.residual} {s.residual_norm:.3g} ({s.growth:.1f}x early)")
        lines.append(f"{name:<{width}}  {s.scheme or '?'}: error {s.compression_error:.3g}, "
                     f"{residual}, density {100 * s.density:.3g}%, step {s.steps}")
    return "\n".join(lines)


Sink = Callable[[int, CompressionStats], Any]
"""A callable logging sink: ``sink(step, stats)`` (``stats`` of the step just finished)."""


class StatsLogger:
    """Sends a step's :class:`CompressionStats` to ``to`` after every ``every``-th step.

    ``to`` is either a writer with TensorBoard's ``add_scalar(tag, value, global_step)``
    (``torch.utils.tensorboard.SummaryWriter``, ``tensorboardX``'s): every entry of
    :meth:`CompressionStats.scalars` (tags under ``prefix``) plus ``<prefix>/total_ratio``
    of all steps so far is written at ``global_step=step``; or any callable, called as
    ``to(step, stats)``. ``step`` counts completed exchanges from 1. ``every`` must be a
    positive int.
    """

    def __init__(self, to: Any, every: int = 100, prefix: str = "hvd_compress") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        self.add_scalar = getattr(to, "add_scalar", None)
        if self.add_scalar is None and not callable(to):
            raise TypeError("to must be a TensorBoard writer (an object with "
                            "add_scalar(tag, value, global_step), e.g. torch.utils."
                            "tensorboard.SummaryWriter) or a callable(step, stats); got "
                            f"{type(to).__name__}")
        self.to, self.every, self.prefix = to, every, prefix

    def __call__(self, step: int, last: StepStats, total: StepStats) -> None:
        """After completed exchange number ``step``: log ``last`` if ``step`` is a multiple
        of ``every`` (``total``: the counters of all steps so far)."""
        if step % self.every:
            return
        stats = CompressionStats.of(last, 1)
        if self.add_scalar is None:
            self.to(step, stats)
            return
        scalars = stats.scalars(self.prefix)
        scalars[f"{self.prefix}/total_ratio"] = CompressionStats.of(total, step).ratio
        for tag, value in scalars.items():
            self.add_scalar(tag, value, step)
