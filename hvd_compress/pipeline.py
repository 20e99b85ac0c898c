"""The one path every tensor takes, whatever the scheme.

Per tensor and step::

    gradient -> policy (compress or send dense) -> add residual -> scheme.exchange
             -> [collective rounds, started asynchronously, named hvdc.<tensor>.<round>]
             -> aggregate -> check finite on every rank -> commit residual and state
             -> average -> gradient for the optimizer

:meth:`Pipeline.submit` runs a tensor up to its first collective and returns at once (the
optimizer calls it from backward hooks, so communication overlaps the rest of the backward
pass). :meth:`Pipeline.wait` drives every submitted exchange to the end, round by round:
all first rounds are waited on before any second round is awaited, and each round is
started as soon as its input is known.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hvd_compress.comm.base import Communicator
from hvd_compress.comm.ops import Collective, nbytes
from hvd_compress.errors import NonFiniteGradientError
from hvd_compress.feedback import ErrorFeedback
from hvd_compress.policy import Policy
from hvd_compress.schemes.base import Exchange, ExchangeContext, Outcome, Scheme
from hvd_compress.schemes.dense import NoCompression

STATE_VERSION = 1
_DENSE = NoCompression()


@dataclass
class StepStats:
    """Bytes of one step on this rank, all measured from the tensors actually handed over.

    ``payload_bytes``: encoded size of this rank's gradients (what a ring all-reduce would
    circulate; the wire-saving ratio is ``dense_bytes / payload_bytes``). ``dense_bytes``:
    the same gradients as float32. ``collective_bytes``: bytes handed to each round's
    collective, by round name (``dense``, ``fp16``, ``scatter``, ``gather``, ``P``, ``Q``...).
    """

    payload_bytes: int = 0
    dense_bytes: int = 0
    collective_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    compressed_tensors: int = 0
    dense_tensors: int = 0

    @property
    def ratio(self) -> float:
        return self.dense_bytes / max(self.payload_bytes, 1)

    def add(self, other: StepStats) -> None:
        self.payload_bytes += other.payload_bytes
        self.dense_bytes += other.dense_bytes
        self.compressed_tensors += other.compressed_tensors
        self.dense_tensors += other.dense_tensors
        for key, value in other.collective_bytes.items():
            self.collective_bytes[key] += value


@dataclass
class _InFlight:
    name: str
    grad: torch.Tensor
    x: torch.Tensor
    scheme: Scheme
    exchange: Exchange
    handle: Any = None
    outcome: Outcome | None = None


class Pipeline:
    """Compress, communicate and aggregate named tensors with one scheme.

    Args:
        scheme: the compression scheme (see :class:`hvd_compress.Compression`).
        comm: the communicator (Horovod's, or a :class:`~hvd_compress.comm.threads.ThreadGroup`
            rank in tests).
        policy: which tensors are compressed; the rest go as a plain all-reduce.
        average: divide the sum by the number of ranks.
        prescale: divide inputs by this before communicating and multiply results by it
            after (Horovod's ``gradient_predivide_factor``: keeps float16 sums in range).
        seed: base of every random stream (stochastic rounding, PowerSGD's first ``Q``).
    """

    def __init__(self, scheme: Scheme, comm: Communicator, policy: Policy | None = None,
                 average: bool = True, prescale: float = 1.0, seed: int = 0) -> None:
        if prescale <= 0:
            raise ValueError(f"prescale must be positive, got {prescale}")
        self.scheme = scheme
        self.comm = comm
        self.policy = policy if policy is not None else Policy()
        self.average = average
        self.prescale = prescale
        self.seed = seed
        self.feedback = ErrorFeedback()
        self._scheme_state: dict[str, dict[str, torch.Tensor]] = {}
        self._steps: dict[str, int] = defaultdict(int)
        self._routes: dict[tuple[str, torch.Size], Scheme] = {}
        self._inflight: dict[str, _InFlight] = {}
        self._current = StepStats()
        self.last_step = StepStats()
        self.total = StepStats()

    # Routing -------------------------------------------------------------------------------
    def route(self, name: str, shape: torch.Size) -> Scheme:
        """The scheme a tensor of this name and shape travels with (cached)."""
        key = (name, shape)
        scheme = self._routes.get(key)
        if scheme is None:
            compress = self.policy.compresses(self.scheme, shape)
            scheme = self.scheme if compress else _DENSE
            self._routes[key] = scheme
        return scheme

    # Submitting and waiting ----------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return bool(self._inflight)

    def submit(self, name: str, grad: torch.Tensor) -> None:
        """Start ``grad``'s exchange; it runs up to its first collective and returns."""
        if name in self._inflight:
            raise RuntimeError(f"tensor {name!r} was submitted twice in one step; call wait() "
                               "between steps (is the same name used for two tensors?)")
        if grad.is_sparse:
            raise TypeError(f"tensor {name!r} is a sparse tensor; hvd_compress compresses dense "
                            "gradients (pass sparse_as_dense=True to the optimizer)")
        if not grad.dtype.is_floating_point:
            raise TypeError(f"tensor {name!r} has dtype {grad.dtype}; only floating-point "
                            "gradients can be compressed or averaged")
        scheme = self.route(name, grad.shape)
        x = grad / self.prescale if self.prescale != 1.0 else grad
        if scheme is not _DENSE:
            x = self.feedback.compensate(name, x) if scheme.error_feedback else x.float()
        ctx = ExchangeContext(name, self.comm.rank, self.comm.size, self._steps[name],
                              self.seed)
        exchange = scheme.exchange(x, self._scheme_state.get(name, {}), ctx)
        flight = _InFlight(name, grad, x, scheme, exchange)
        self._inflight[name] = flight
        if grad.numel() == 0:  # nothing to send; every rank agrees since shapes agree
            exchange.close()
            flight.outcome = Outcome(torch.zeros_like(x), None, 0)
            return
        self._advance(flight, None)

    def wait(self) -> dict[str, torch.Tensor]:
        """Finish every submitted exchange; return each tensor's aggregate.

        Aggregates have the gradient's shape and dtype and are averaged when ``average``.
        If any aggregate is non-finite, raises :class:`NonFiniteGradientError` on every rank
        and keeps all residuals and scheme state as they were before the step.
        """
        flights = list(self._inflight.values())
        try:
            while any(f.outcome is None for f in flights):
                for flight in flights:
                    if flight.outcome is None:
                        self._advance(flight, self.comm.wait(flight.handle))
        finally:
            self._inflight.clear()
        try:
            self._check_finite(flights)
        except NonFiniteGradientError:
            self._current = StepStats()
            raise
        return self._commit(flights)

    def reduce(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Submit every tensor, then wait: one step's exchange outside an optimizer."""
        for name, tensor in tensors.items():
            self.submit(name, tensor)
        return self.wait()

    def _advance(self, flight: _InFlight, result: Any) -> None:
        try:
            op: Collective = flight.exchange.send(result)
        except StopIteration as done:
            flight.outcome = done.value
            return
        self._current.collective_bytes[op.round] += nbytes(op)
        flight.handle = self.comm.start(f"hvdc.{flight.name}.{op.round}", op)

    def _check_finite(self, flights: list[_InFlight]) -> None:
        if not flights:
            return
        # One device-to-host transfer for the whole step, not one per tensor.
        finite = torch.stack([f.outcome.aggregate.isfinite().all() for f in flights]).cpu()
        if bool(finite.all()):
            return
        bad = [f for f, ok in zip(flights, finite.tolist()) if not ok]
        local = [f.name for f in bad if not bool(f.x.isfinite().all())]
        step = max(self._steps[f.name] for f in bad)
        raise NonFiniteGradientError([f.name for f in bad], local, step, self.comm.rank)

    def _commit(self, flights: list[_InFlight]) -> dict[str, torch.Tensor]:
        results: dict[str, torch.Tensor] = {}
        stats = self._current
        for flight in flights:
            outcome = flight.outcome
            assert outcome is not None
            name, scheme = flight.name, flight.scheme
            if scheme.error_feedback:
                self.feedback.commit(name, ErrorFeedback.residual(flight.x, outcome.sent))
            if outcome.state:
                self._scheme_state[name] = outcome.state
            self._steps[name] += 1
            scale = self.prescale / (self.comm.size if self.average else 1)
            aggregate = outcome.aggregate.view(flight.grad.shape)
            if scale != 1.0:
                aggregate = aggregate * scale
            results[name] = aggregate.to(flight.grad.dtype)
            stats.payload_bytes += outcome.payload_bytes
            stats.dense_bytes += 4 * flight.grad.numel()
            if isinstance(scheme, NoCompression):
                stats.dense_tensors += 1
            else:
                stats.compressed_tensors += 1
        self.total.add(stats)
        self.last_step, self._current = stats, StepStats()
        return results

    # State ---------------------------------------------------------------------------------
    def scheme_state(self, name: str) -> dict[str, torch.Tensor]:
        """The scheme's committed state for one tensor (PowerSGD's ``q``, a rank's
        ``chunk_residual`` in the compressed all-reduce); empty if it has none."""
        return dict(self._scheme_state.get(name, {}))

    def state_dict(self) -> dict[str, Any]:
        """Residuals, scheme state and step counters: everything needed to resume exactly."""
        return {
            "version": STATE_VERSION,
            "scheme": self.scheme.describe(),
            "steps": dict(self._steps),
            "residuals": self.feedback.state_dict(),
            "scheme_state": {name: {k: v.detach().clone() for k, v in st.items()}
                             for name, st in self._scheme_state.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self._inflight:
            raise RuntimeError("cannot load state while exchanges are in flight; call wait()")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"compression state has version {state.get('version')!r}; this "
                             f"hvd_compress reads version {STATE_VERSION}")
        if state["scheme"] != self.scheme.describe():
            raise ValueError(f"compression state was saved with {state['scheme']} but this "
                             f"optimizer uses {self.scheme.describe()}; construct the "
                             "optimizer with the same compression= to resume")
        self._steps = defaultdict(int, state["steps"])
        self.feedback.load_state_dict(state["residuals"])
        self._scheme_state = {name: {k: torch.as_tensor(v).clone() for k, v in st.items()}
                              for name, st in state["scheme_state"].items()}
