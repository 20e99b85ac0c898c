"""What every parameter-server transport shares: the interface a transport implements
(:class:`Transport`), the sharded client it returns (:class:`ShardedClient`) and the
errors both raise (:class:`PSError`, :class:`SpecError`).

A sparse tensor of ``numel`` elements is split into contiguous shards: with ``S`` servers,
shard ``s`` owns flat indices ``[b_s, b_{s+1})``, ``b_s = floor(s * numel / S)``
(:func:`shard_bounds`), and the ``s``-th server serves it. :meth:`ShardedClient.push_pull`
sends each shard its pairs (indices made local, ``i - b_s``; an empty push still counts),
then pulls each shard's aggregate for the same round and returns the pairs of the whole
tensor. See :mod:`hvd_compress.sparse_wire` for the frames and :mod:`ps_server.store` for
the round semantics.

With a server quorum (``--quorum``), a round may close without this worker: its push is
then refused as late (status :data:`LATE`) and :meth:`ShardedClient.finish` still pulls
the closed round's aggregate; the round's :class:`PendingRound` says which shards refused
the push (``late``) and how many workers each shard's aggregate misses (``missing``);
a late refusal names the server's open round (:meth:`PendingRound.closed_before`), so a
worker that fell behind skips the rounds that closed without it.
A transport only moves the frames (:meth:`ShardedClient._send_pushes`
and :meth:`ShardedClient._pull`); how to add one is in docs/contributing.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hvd_compress.comm.ops import sorted_pairs, wire_dtype
from hvd_compress.ps_protocol import LATE_STATUS, TOKEN_ENV, missing_of, open_round_of
from hvd_compress.sparse_wire import Kind, ValueDType, decode_frame, encode_frame

LATE = LATE_STATUS
"""The status of a push for a round that closed without it (the server's ``LateRound``):
not an error for the client, which keeps those pairs for a later round."""

_HINTS = {
    "ABORTED": "the round failed on the server, so no worker applied it; every worker of "
               "the job gets this error for this round",
    "ALREADY_EXISTS": "another process pushed as this worker: give each rank its own "
                      "worker id",
    "FAILED_PRECONDITION": "the workers and the server disagree on the round or the job",
    "PERMISSION_DENIED": "another process holds this worker id in this session: give each "
                         "rank its own worker id",
    "UNAUTHENTICATED": f"pass the server's token (token= or ${TOKEN_ENV})",
    "RESOURCE_EXHAUSTED": "the message exceeds the server's --max-message-mb or the "
                          "client's max_message_bytes",
    LATE: "the round closed by the server's --quorum without this worker",
}


class PSError(RuntimeError):
    """The parameter server refused a request or could not be reached.

    Attributes: ``tensor``, ``round``, ``shard``, ``address`` and ``code`` (a gRPC status
    name such as ``ABORTED`` for a round that failed at its deadline; every transport
    reports in these names).
    """

    def __init__(self, tensor: str, round: int, shard: int, address: str, code: str,
                 detail: str) -> None:
        self.tensor, self.round, self.shard = tensor, round, shard
        self.address, self.code, self.detail = address, code, detail
        hint = _HINTS.get(code)
        super().__init__(f"parameter server shard {shard} ({address}) failed tensor "
                         f"{tensor!r} round {round}: {code}: {detail}"
                         + (f" ({hint})" if hint else ""))


class SpecError(ValueError):
    """A ``ps=`` spec that cannot be used: ``problem`` says why, and the message ends
    with the accepted forms (``forms``); :func:`~hvd_compress.comm.ps_transport.check_spec`
    re-raises it with the forms of every registered transport."""

    def __init__(self, problem: str, forms: str) -> None:
        self.problem, self.forms = problem, forms
        super().__init__(f"{problem}; accepted forms: {forms}")

    def with_forms(self, forms: str) -> SpecError:
        """The same problem, listing ``forms`` instead."""
        return SpecError(self.problem, forms)


def join_forms(forms: list[str]) -> str:
    """``"a, b or c"``: accepted forms as one phrase for error messages."""
    return forms[0] if len(forms) == 1 else f"{', '.join(forms[:-1])} or {forms[-1]}"


def check_timeout(value: Any, name: str) -> float | None:
    """An optimizer's optional timeout argument (``connect_timeout=``), checked where it is
    given rather than at the first step: ``None`` (the transport's default then applies)
    or seconds > 0, returned as a float. Anything else raises ``ValueError`` naming
    ``name``. Both bindings' optimizers call it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{name} must be > 0 seconds or None, got {value!r}")
    return float(value)


def shard_bounds(numel: int, shards: int) -> list[int]:
    """``[b_0 = 0, ..., b_S = numel]``: shard ``s`` owns ``[b_s, b_{s+1})``."""
    return [s * numel // shards for s in range(shards + 1)]


@dataclass
class PendingRound:
    """One tensor's round between :meth:`ShardedClient.start` (pushes sent) and
    :meth:`ShardedClient.finish`.

    ``late[s]``: the server's message when shard ``s`` refused the push as late (its pairs
    are in no aggregate), else None. ``missing[s]``: after :meth:`~ShardedClient.finish`,
    how many workers shard ``s``'s aggregate does not sum (0 for none); ``selected[s]``:
    whether shard ``s`` answered a :attr:`~hvd_compress.sparse_wire.Kind.SELECTED`
    aggregate (``--mode gtopk``), which leaves this worker the pairs it pushed elsewhere
    (:meth:`unselected`)."""

    tensor: str
    round: int
    bounds: list[int]
    pushes: list[bytes]
    pulls: list[bytes]
    pushed: list[Future[Any]] = field(default_factory=list)
    pulled: list[Future[bytes]] = field(default_factory=list)
    late: list[str | None] = field(default_factory=list)
    missing: list[int] = field(default_factory=list)
    selected: list[bool] = field(default_factory=list)
    pull_only: bool = False  # skipped: no push was sent (``pushes`` holds none)

    def closed_before(self) -> int:
        """The first round that may still be open on every shard, as this round's replies
        tell: a shard that refused the push as late names its open round
        (:func:`~hvd_compress.ps_protocol.open_round_of`), one that took it is at most at
        ``round + 1``. Every round below the result closed without this worker."""
        opens = [self.round + 1 if detail is None else
                 max(self.round + 1, open_round_of(detail) or 0) for detail in self.late]
        return min(opens, default=self.round + 1)

    def refused(self, indices: torch.Tensor) -> torch.Tensor | None:
        """A mask of ``indices`` (flat, on any device) that fall in shards which refused
        the push as late; None when none did."""
        mask = None
        for s, detail in enumerate(self.late):
            if detail is not None:
                inside = (indices >= self.bounds[s]) & (indices < self.bounds[s + 1])
                mask = inside if mask is None else mask | inside
        return mask

    def unselected(self, indices: torch.Tensor, aggregate: torch.Tensor
                   ) -> torch.Tensor | None:
        """A mask of this worker's pushed ``indices`` (flat, on any device) that fall in
        shards which answered a selected aggregate and are not among its ``aggregate``
        indices (flat, as :meth:`ShardedClient.finish` returns them): pairs no aggregate
        holds, which the worker keeps in its residual. None when no shard selected."""
        if not any(self.selected):
            return None
        mask = ~torch.isin(indices, aggregate.to(indices.device))
        if all(self.selected):
            return mask
        for s, chosen in enumerate(self.selected):
            if not chosen:  # a union shard sums every pushed pair
                mask &= (indices < self.bounds[s]) | (indices >= self.bounds[s + 1])
        return mask


@dataclass(frozen=True)
class PartialSum:
    """A :class:`~hvd_compress.comm.ops.SparseSum`'s result when a server quorum closed
    the round without every worker, or without this one.

    ``total``: the flat float32 sum, as every worker of the round gets it (but for
    ``ParameterServerCommunicator(partial="unscaled")``, shard ``s``'s slice multiplied
    by ``W / contributors[s]``, so averaging over ``W`` gives the mean over the workers
    that contributed). ``refused``: a mask over this rank's pairs (in the order of the request)
    that no aggregate holds (its push was late, or a ``--mode gtopk`` server left them out),
    None when every pair was summed;
    ``contributors``: the workers summed, per shard; ``owed``: flat, what ``total``'s
    scaling stood in for this rank (``partial="owed"`` or ``"refund"``), which its
    residual gives up, or None. A scheme passes it through :func:`counted_pairs` and
    keeps the refused pairs in its residual.
    """

    total: torch.Tensor
    refused: torch.Tensor | None
    contributors: tuple[int, ...]
    owed: torch.Tensor | None = None


def counted_pairs(result: torch.Tensor | PartialSum, indices: torch.Tensor,
                  values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(total, indices, values)``: a sparse sum's dense result and the pairs of this
    rank that it holds, from the ``result`` a communicator returned for the request of
    ``indices`` and ``values``. Every pair unless ``result`` is a :class:`PartialSum`
    with refused pairs: error feedback subtracts only the counted pairs, so the refused
    ones stay in the residual whole and travel in a later round (no mass is lost). With
    ``owed``, the pairs returned are the counted ones plus what this rank owes, so error
    feedback takes that from the residual too."""
    if not isinstance(result, PartialSum):
        return result, indices, values
    if result.refused is not None:
        keep = ~result.refused
        indices, values = indices[keep], values[keep]
    if result.owed is None:
        return result.total, indices, values
    counted = result.owed.to(device=values.device, dtype=torch.float32, copy=True)
    counted.index_add_(0, indices, values.float())
    indices = counted.nonzero().reshape(-1)
    return result.total, indices, counted[indices].to(values.dtype)


class ShardedClient(ABC):
    """Splitting pairs into shard frames and joining the aggregates; transports subclass.

    ``value_dtype`` (``"fp32"``/``"fp16"``) forces the wire dtype of the values both ways.
    By default float16 values are pushed as fp16 and any other as fp32, and aggregates come
    back as fp32, so they are the exact sums of what was pushed. A subclass sets
    ``addresses`` (one name per shard, in shard order, for messages) and moves the frames.
    """

    addresses: list[str]

    def __init__(self, worker: int, value_dtype: str | None) -> None:
        self.worker = worker
        self.dtype = None if value_dtype is None else ValueDType.parse(value_dtype)

    def expect_workers(self, workers: int) -> None:
        """Tell the servers the job's number of workers, where the transport carries it
        (the communicator calls this with its size). Does nothing by default."""
        return None  # a transport whose servers know the job's size has nothing to tell

    def push_pull(self, tensor_id: str, round: int, numel: int,
                  indices: torch.Tensor | np.ndarray, values: torch.Tensor | np.ndarray
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Push this worker's pairs for ``round`` and return the aggregate's pairs.

        ``indices`` are flat positions in ``[0, numel)``, unique, in any order; tensors on
        any device or host arrays (a device's pairs are copied to the host once, through a
        reused pinned buffer: :func:`~hvd_compress.comm.ops.sorted_pairs`). Returns int64
        indices (increasing) and float32 values, on the CPU.
        """
        return self.finish(self.start(tensor_id, round, numel, indices, values))

    def start(self, tensor_id: str, round: int, numel: int,
              indices: torch.Tensor | np.ndarray, values: torch.Tensor | np.ndarray,
              push: bool = True) -> PendingRound:
        """Send this worker's pushes for ``round`` to every shard; :meth:`finish` pulls.

        Pushes never wait for other workers, so a worker may start any number of tensors
        before finishing any, in any order. ``push=False`` sends no push (a round this
        worker skips, which the others close by quorum): :meth:`finish` only pulls.
        """
        dtype = self.dtype if self.dtype is not None else wire_dtype(values)
        pull_dtype = self.dtype if self.dtype is not None else ValueDType.FP32
        idx, val = sorted_pairs(numel, indices, values, f"tensor {tensor_id!r}")
        shards = len(self.addresses)
        bounds = shard_bounds(numel, shards)
        cuts = np.searchsorted(idx, bounds)
        pending = PendingRound(tensor_id, round, bounds, [], [], late=[None] * shards,
                               pull_only=not push)
        for s in range(shards):
            lo, hi = cuts[s], cuts[s + 1]
            size = bounds[s + 1] - bounds[s]
            if push:
                pending.pushes.append(encode_frame(Kind.PUSH, tensor_id, s, shards, round,
                                                   self.worker, size, idx[lo:hi] - bounds[s],
                                                   val[lo:hi], dtype))
            pending.pulls.append(encode_frame(Kind.PULL, tensor_id, s, shards, round,
                                              self.worker, size, dtype=pull_dtype))
        self._send_pushes(pending)
        return pending

    def finish(self, pending: PendingRound) -> tuple[torch.Tensor, torch.Tensor]:
        """Pull the aggregate of a started round from every shard; returns its pairs."""
        replies = self._pull(pending)
        all_idx, all_val = [], []
        tensor, round, bounds = pending.tensor, pending.round, pending.bounds
        for s, reply in enumerate(replies):
            try:
                frame = decode_frame(reply)
            except ValueError as err:
                raise self._error(tensor, round, s, "DATA_LOSS", f"bad aggregate: {err}"
                                  ) from err
            got = (frame.kind, frame.tensor, frame.round, frame.shard, frame.numel)
            kind = Kind.SELECTED if frame.kind is Kind.SELECTED else Kind.AGGREGATE
            want = (kind, tensor, round, s, bounds[s + 1] - bounds[s])
            if got != want:
                raise self._error(tensor, round, s, "DATA_LOSS",
                                  f"aggregate frame is for {got}, expected {want}")
            pending.selected.append(kind is Kind.SELECTED)
            all_idx.append(frame.indices + bounds[s])
            all_val.append(frame.values.astype(np.float32))
            pending.missing.append(missing_of(frame.worker))
        return (torch.from_numpy(np.concatenate(all_idx)),
                torch.from_numpy(np.concatenate(all_val)))

    def _error(self, tensor: str, round: int, shard: int, code: str, detail: str) -> PSError:
        return PSError(tensor, round, shard, self.addresses[shard], code, detail)

    @abstractmethod
    def _send_pushes(self, pending: PendingRound) -> None:
        """Send each shard its push frame (or queue it; :meth:`_pull` joins); none when
        ``pending.pull_only``."""

    @abstractmethod
    def _pull(self, pending: PendingRound) -> list[bytes]:
        """Each shard's reply to its pull request, once its push is in."""

    @abstractmethod
    def close(self) -> None:
        """Release the connections (and tell the servers, where the transport does)."""


class Transport(ABC):
    """One way for workers to reach parameter servers, chosen by a ``ps=`` spec's scheme.

    Class attributes a transport sets:

    - ``schemes``: the schemes it serves, the part before ``://`` of a spec
      (``("grpc", "grpcs")``), or a spec that is one bare word (``("mpi",)``);
    - ``forms``: each accepted form of its specs, quoted, for error messages;
    - ``in_launch``: true when its servers are ranks of the workers' own launch (MPMD
      ``mpirun``): the workers then join them with :meth:`start_workers` before Horovod
      starts, on the communicator it returns.
    """

    schemes: tuple[str, ...] = ()
    forms: tuple[str, ...] = ()
    in_launch: bool = False

    @abstractmethod
    def check(self, spec: str, origin: str) -> str:
        """``spec`` checked for syntax only (nothing is contacted), returned normalised.
        Raises :class:`SpecError` naming the bad part and ``origin`` (where ``spec`` came
        from, such as ``"ps"``)."""

    @abstractmethod
    def connect(self, spec: str, worker: int, *, workers: int | None = None,
                connect_timeout: float | None = None, retry_timeout: float | None = None
                ) -> ShardedClient:
        """The client of the servers of ``spec`` for worker ``worker`` of a job of
        ``workers``; a transport without connections to wait for ignores the timeouts."""

    def start_workers(self) -> Any:
        """For an ``in_launch`` transport: join the servers (collective over the launch)
        and return the workers' communicator, to pass to ``hvd.init(comm=...)``."""
        raise NotImplementedError(f"{type(self).__name__} servers are not ranks of the "
                                  "workers' launch")
