"""The contract every compression scheme fulfils.

A scheme holds the math of one algorithm and nothing else. Its :meth:`Scheme.exchange` is a
generator that yields collective requests (:mod:`hvd_compress.comm.ops`) and receives their
results; it returns an :class:`Outcome` with the aggregate and the state to keep. The
pipeline (:mod:`hvd_compress.pipeline`) owns everything around it: the policy, error
feedback, naming, starting and waiting on collectives, byte counts, and committing state
only when the step succeeded. So a scheme can be run in one process, driven by hand or by
:class:`~hvd_compress.comm.threads.ThreadGroup`.

Schemes also present Horovod's ``Compressor`` interface (``compress``/``decompress``). Only
the stateless, summable ones (no compression, float16) can honour it; every other scheme
raises an error that says what to use instead. That error comes at the first backward pass
with two or more processes: with one, Horovod 0.28.1's ``hvd.DistributedOptimizer``
registers no gradient hooks and never calls the compressor (it only keeps a reference to
it), so nothing of the scheme runs and the run is plain local training.
"""

from __future__ import annotations

import hashlib
import importlib
import warnings
from abc import ABC, abstractmethod
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hvd_compress.comm.ops import Collective
from hvd_compress.native import tensors as native

if TYPE_CHECKING:
    from hvd_compress.schemes.packed import PackedScheme

State = dict[str, torch.Tensor]
Exchange = Generator[Collective, Any, "Outcome"]


@dataclass(frozen=True)
class ExchangeContext:
    """Where and when an exchange runs: the tensor's name, this rank, the step number."""

    name: str
    rank: int
    size: int
    step: int
    seed: int = 0

    def generator(self, stream: str, device: torch.device, shared: bool = False) -> torch.Generator:
        """A random generator determined by (seed, tensor, step, stream[, rank]).

        ``shared=True`` gives every rank the same numbers (PowerSGD's initial Q, random-k's
        indices); otherwise each rank draws its own (stochastic rounding). Deriving it from
        the step rather than carrying a generator makes a resumed run draw what an
        uninterrupted one would.
        """
        who = "shared" if shared else f"rank{self.rank}"
        key = f"{self.seed}/{self.name}/{self.step}/{stream}/{who}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
        return gen


@dataclass(frozen=True)
class LowRank:
    """The tensor ``(left @ right.T).view(shape)``, kept as its two factors.

    A low-rank scheme (PowerSGD) returns its aggregate and its own contribution this way,
    so the pipeline writes each where it goes in one matrix product (``addmm``) instead of
    first materialising an ``n x m`` matrix and then copying, scaling or subtracting it:
    the difference is two passes over every compressed gradient per step.
    """

    left: torch.Tensor
    right: torch.Tensor
    shape: torch.Size

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.left.dtype, device=self.left.device)
        return self.write(out, 1.0)

    def total(self) -> torch.Tensor:
        """The sum of all entries, from the factors: ``sum_k (sum_i L_ik)(sum_j R_jk)``.
        It is NaN or infinite when a factor holds a NaN or an infinity."""
        return (self.left.sum(0) * self.right.sum(0)).sum()

    def write(self, out: torch.Tensor, scale: float) -> torch.Tensor:
        """``out = scale * self``, in one pass when ``out`` is a contiguous tensor of the
        factors' dtype (whatever ``out`` held is ignored, NaN included): on the CPU by the
        native kernel (:func:`hvd_compress.native.tensors.lowrank_apply`, several times
        faster than MKL's rank-``r`` GEMM on large matrices), else one ``addmm``."""
        if out.dtype == self.left.dtype and out.is_contiguous() and out.device == self.left.device:
            if not native.lowrank_apply(out, self.left, self.right, scale, False):
                out.view(self.left.shape[0], -1).addmm_(self.left, self.right.t(), beta=0,
                                                        alpha=scale)
            return out
        return torch.mul(self.materialize(), scale, out=out)

    def subtract_from(self, x: torch.Tensor) -> torch.Tensor:
        """``x -= self`` in one pass (``x`` contiguous, the factors' dtype), by the same
        kernel as :meth:`write` where it runs."""
        if not native.lowrank_apply(x, self.left, self.right, 1.0, True):
            x.view(self.left.shape[0], -1).addmm_(self.left, self.right.t(), alpha=-1)
        return x


@dataclass(frozen=True)
class Scattered:
    """A tensor of ``shape`` that is zero but for ``values`` at the flat ``indices``
    (distinct), kept as those pairs: a sparse scheme's own contribution, which error
    feedback subtracts from the residual by touching ``k`` entries, not ``n``."""

    indices: torch.Tensor
    values: torch.Tensor
    shape: torch.Size

    def materialize(self) -> torch.Tensor:
        out = torch.zeros(self.shape.numel(), dtype=torch.float32, device=self.values.device)
        return out.index_copy_(0, self.indices, self.values.float()).view(self.shape)

    def total(self) -> torch.Tensor:
        return self.values.float().sum()

    def write(self, out: torch.Tensor, scale: float) -> torch.Tensor:
        if not out.is_contiguous():  # no flat view to write the pairs through
            return out.copy_(self.materialize().mul_(scale))
        out.zero_().view(-1).index_copy_(0, self.indices, (self.values.float() * scale)
                                         .to(out.dtype))
        return out

    def subtract_from(self, x: torch.Tensor) -> torch.Tensor:
        x.view(-1).index_add_(0, self.indices, self.values.to(x.dtype), alpha=-1)
        return x


class Kept(Protocol):
    """A tensor kept in another form than its entries, which error feedback and the
    aggregate's write use without materializing it where they can."""

    def materialize(self) -> torch.Tensor: ...
    def total(self) -> torch.Tensor: ...
    def write(self, out: torch.Tensor, scale: float) -> torch.Tensor: ...
    def subtract_from(self, x: torch.Tensor) -> torch.Tensor: ...


Dense = torch.Tensor | Kept
"""A dense tensor, or one kept as low-rank factors (:class:`LowRank`), as the pairs of its
non-zero entries (:class:`Scattered`) or as the payloads a packed scheme sent
(:class:`~hvd_compress.schemes.packed.PackedContribution`): any :class:`Kept`."""


def materialize(value: Dense) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else value.materialize()


def total(value: Dense) -> torch.Tensor:
    """The sum of all entries (NaN or infinite when an entry is, or when it overflows)."""
    return value.sum() if isinstance(value, torch.Tensor) else value.total()


def subtract(x: torch.Tensor, value: Dense) -> torch.Tensor:
    """``x -= value`` in place; returns ``x``."""
    return x.sub_(value) if isinstance(value, torch.Tensor) else value.subtract_from(x)


def write_scaled(value: Dense, out: torch.Tensor, scale: float) -> torch.Tensor:
    """``out = scale * value`` (cast to ``out``'s dtype) in one pass; returns ``out``."""
    if not isinstance(value, torch.Tensor):
        return value.write(out, scale)
    value = value.view(out.shape)
    return torch.mul(value, scale, out=out) if scale != 1.0 else out.copy_(value)


@dataclass
class Outcome:
    """The result of one tensor's exchange.

    ``aggregate`` is the **sum** over ranks (the pipeline divides for an average).
    ``sent`` is this rank's own contribution as the others decode it, which error feedback
    subtracts from the input; ``None`` means it was sent exactly. Either may be kept as
    low-rank factors (:class:`LowRank`) or as pairs (:class:`Scattered`); a sparse scheme
    returns its pairs as ``sent`` (the step's density is counted from them) even when it
    keeps its residual itself (DGC, whose ``error_feedback`` is off: the pipeline then
    subtracts nothing). ``state`` replaces the scheme's per-tensor state
    once the step is known to be good. ``payload_bytes`` is the exact encoded size of this
    rank's contribution.
    """

    aggregate: Dense
    sent: Dense | None
    payload_bytes: int
    state: State = field(default_factory=dict)


def check_loco_beta(scheme: str, beta: float) -> float:
    """``beta`` as a float if it is a valid LoCo weight, ``0 <= beta < 1``; otherwise a
    ``ValueError`` naming ``scheme``."""
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        raise ValueError(f"{scheme}: loco_beta must be a number in [0, 1) (0: the plain "
                         f"residual; LoCo's moving average otherwise, e.g. 0.8), got "
                         f"{beta!r}")
    return float(beta)


class Scheme(ABC):
    """A gradient compression algorithm.

    Attributes:
        name: short identifier used in logs, benchmarks and state dicts.
        error_feedback: whether the pipeline keeps a residual ``e`` per tensor and sends
            ``g + e`` (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback Fixes
            SignSGD"): ``e <- (g + e) - sent``. Biased schemes need it to converge.
        min_compression_rate: the policy sends a tensor dense when this scheme would shrink
            it by less (unless the policy sets its own threshold).
        loco_beta: set by the schemes with error feedback that offer LoCo's moving-average
            residual (:meth:`loco_option`); the pipeline's memory uses it
            (:meth:`~hvd_compress.feedback.ErrorFeedback.for_scheme`). Schemes without the
            option have no such attribute.
        sliceable: whether row blocks of a tensor can be compressed independently and
            their aggregates stacked back (two-level compression then gives each local rank
            of a host one block; otherwise whole tensors, :mod:`hvd_compress.hierarchy`).
        linear_rounds: whether every round is an :class:`~hvd_compress.comm.ops.AllReduce`
            of something linear in the gradient (PowerSGD's ``P = M Q``), so summing it in
            two levels is the flat algorithm: two-level compression then runs the flat
            pipeline with each all-reduce done hierarchically
            (:class:`~hvd_compress.comm.two_level.HostTwoLevelCommunicator`).
    """

    name: str = "scheme"
    error_feedback: bool = False
    sliceable: bool = False
    linear_rounds: bool = False
    min_compression_rate: float = 1.0

    @abstractmethod
    def exchange(self, x: torch.Tensor, state: Mapping[str, torch.Tensor],
                 ctx: ExchangeContext) -> Exchange:
        """Communicate ``x`` (float32, the tensor's shape) and return the aggregate."""

    @abstractmethod
    def payload_bytes(self, shape: torch.Size) -> int:
        """Bytes one rank's contribution takes on the wire for a tensor of ``shape``.

        Exact for one rank; the compressed all-reduce encodes one chunk per rank, each
        padded to whole bytes, so with ``n`` ranks it may be up to ``n - 1`` bytes more
        (the exact count is in each step's :class:`~hvd_compress.pipeline.StepStats`).
        """

    def compression_rate(self, shape: torch.Size) -> float:
        """fp32 bytes over :meth:`payload_bytes`."""
        numel = shape.numel()
        return 4 * numel / max(self.payload_bytes(shape), 1)

    def applies_to(self, shape: torch.Size) -> bool:
        """Whether the scheme can encode a tensor of this shape at all."""
        return shape.numel() > 0

    def packed(self, device: torch.device) -> PackedScheme | None:
        """The :class:`~hvd_compress.schemes.packed.PackedScheme` whose payload this scheme
        sends through the compressed all-reduce for tensors on ``device``, or ``None`` when
        it does not (the default)."""
        del device
        return None

    def options(self) -> dict[str, Any]:
        """The constructor options that define this scheme, by name (``loco_beta`` aside:
        :meth:`describe` adds it). Default: none."""
        return {}

    def describe(self) -> dict[str, Any]:
        """The configuration, recorded in state dicts so a mismatched restore is caught: the
        name, :meth:`options`, and ``loco_beta`` if the scheme has a non-zero one. At 0 the
        key is left out, so a checkpoint written before a scheme had the option (and one
        written with it at 0) describes the same scheme and still loads."""
        loco_beta = getattr(self, "loco_beta", 0.0)
        return {"name": self.name, **self.options(),
                **({"loco_beta": loco_beta} if loco_beta else {})}

    def loco_option(self, loco_beta: float) -> float:
        """A scheme's ``loco_beta=`` option, checked: the weight of LoCo's moving-average
        residual (:mod:`hvd_compress.feedback`, ``e <- beta e + (1 - beta)((g + e) -
        sent)``), which the pipeline's error-feedback memory applies to every scheme that
        stores ``self.loco_beta = self.loco_option(loco_beta)`` in its constructor (and
        which :meth:`describe` then records). ``ValueError`` naming the scheme if it is not
        in ``[0, 1)``, or if it is non-zero while this scheme keeps no residual (its
        ``error_feedback`` is off: there is nothing to average)."""
        beta = check_loco_beta(self.name, loco_beta)
        if beta and not self.error_feedback:
            raise ValueError(f"{self.name}: loco_beta={beta:g} averages the error-feedback "
                             f"residual, but this {self.name} keeps none; pass "
                             "error_feedback=True as well, or leave loco_beta at 0")
        return beta

    def check_optimizer(self, optimizer: Any) -> None:
        """Refuse, with an error that says what to change, a wrapped optimizer this scheme
        cannot train with (called by the optimizer wrapper at construction, before any
        step). The default accepts every optimizer; DGC, which applies momentum itself,
        refuses one with momentum of its own."""
        del optimizer  # accepted

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.describe().items() if k != "name")
        return f"{type(self).__name__}({args})"

    # Horovod's Compressor interface -------------------------------------------------------
    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise TypeError(
            f"{self!r} cannot run inside Horovod's stateless Compressor interface "
            "(hvd.DistributedOptimizer's compression=): it needs its own collectives and "
            "per-tensor state. Use hvd_compress.torch.DistributedOptimizer(optimizer, "
            "named_parameters=..., compression=...) instead (for TensorFlow, "
            "hvd_compress.tensorflow.DistributedGradientTape or "
            "hvd_compress.tensorflow.keras.DistributedOptimizer). Only Compression.none and "
            "Compression.fp16 work with the stock optimizer or tape.")

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.compress(tensor)[0]


HEAVY_MOMENTUM = 0.9
"""The optimizer momentum from which :func:`warn_heavy_momentum` warns."""


def optimizer_momentum(optimizer: Any, at_least: float = 0.0) -> tuple[int, float] | None:
    """The first parameter group of ``optimizer`` whose ``momentum`` (SGD, RMSprop) is
    non-zero and at least ``at_least``, as (index, momentum); ``None`` if there is none."""
    for index, group in enumerate(getattr(optimizer, "param_groups", [])):
        momentum = group.get("momentum", 0) or 0
        if momentum and momentum >= at_least:
            return index, momentum
    return None


def warn_heavy_momentum(scheme: Scheme, optimizer: Any, measured: str) -> None:
    """Warn (``UserWarning``) when a parameter group of ``optimizer`` has ``momentum`` of at
    least :data:`HEAVY_MOMENTUM`: error feedback hands every element's delayed residual to
    the optimizer in bursts, and heavy momentum multiplies each burst by up to
    ``1 / (1 - momentum)``. Whether that diverges depends on the learning rate, so it is a
    warning (with ``measured``, the scheme's figures) rather than an error."""
    found = optimizer_momentum(optimizer, HEAVY_MOMENTUM)
    if found is not None:
        index, momentum = found
        warnings.warn(
            f"{scheme!r} sends its error-feedback residuals in delayed bursts, and the "
            f"wrapped optimizer {type(optimizer).__name__} has momentum={momentum} in "
            f"parameter group {index}, which amplifies them: {measured} Lower the "
            f"momentum (0.8 or less) or the learning rate, and watch "
            f"optimizer.compression_feedback (ErrorFeedback.report()) for a growing "
            f"residual.", UserWarning, stacklevel=3)


def warn_adaptive(scheme: Scheme, optimizer: Any, measured: str, advice: str) -> None:
    """Warn (``UserWarning``) when a parameter group of ``optimizer`` has ``betas`` (torch's
    Adam, AdamW and the rest of Adam's family; a Keras optimizer's ``beta_1`` and ``beta_2``
    reach the check as ``betas`` through :func:`hvd_compress.tensorflow.keras.torch_view`):
    a scheme that hands Adam gradients whose error feedback arrives in bursts, or whose
    values are drawn at random, has them taken into Adam's second moment as noise, which
    shrinks its steps (the reason 1-bit Adam compresses the momentum, after freezing the
    variance, rather than the gradient). A scheme calls it for its settings not measured to
    train under Adam: ``measured`` is its figures, ``advice`` (a sentence) the settings that
    trained; the message also names what else trains with Adam."""
    for index, group in enumerate(getattr(optimizer, "param_groups", [])):
        if group.get("betas") is not None:
            warnings.warn(
                f"{scheme!r} compresses the gradients that the wrapped optimizer "
                f"{type(optimizer).__name__} (betas in parameter group {index}) divides by "
                f"their running second moment, which takes the compression's bursts as "
                f"noise: {measured} {advice} Or use hvd_compress.torch.OneBitAdam for 1-bit "
                f"communication with Adam, or top-k, DGC, TernGrad or PowerSGD with this "
                f"optimizer.", UserWarning, stacklevel=3)
            return


_MOVED = {"PackedScheme": "hvd_compress.schemes.packed",
          "bucket_view": "hvd_compress.schemes.packed"}


def __getattr__(name: str) -> Any:
    """The names that moved to :mod:`hvd_compress.schemes.packed`, with a
    ``DeprecationWarning`` (kept for one release)."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"hvd_compress.schemes.base.{name} moved to {_MOVED[name]}.{name}; import "
                  "it from there", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
