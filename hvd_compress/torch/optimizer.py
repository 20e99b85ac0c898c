"""``DistributedOptimizer``: Horovod's PyTorch optimizer wrapper, with any scheme."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import horovod.torch as hvd
import torch

from hvd_compress import mpmd
from hvd_compress.binding import (
    check_horovod_arguments,
    check_wrappable,
    resolve_compression,
    resolve_ps,
)
from hvd_compress.comm.base import Communicator
from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
from hvd_compress.comm.parameter_server import ParameterServerCommunicator, connect
from hvd_compress.comm.ps_client import check_timeout
from hvd_compress.comm.torch_dist import TorchDistCommunicator, check_nccl, horovod_group
from hvd_compress.hierarchy import HierarchicalPipeline, check_hierarchy, horovod_pipeline
from hvd_compress.pipeline import DEFAULT_REPORT_EVERY, Pipeline
from hvd_compress.policy import DEFAULT_BUCKET_MB, Policy, default_bucket_mb
from hvd_compress.schemes.base import Scheme
from hvd_compress.stats import CompressionStats, StatsLogger
from hvd_compress.torch.broadcast import any_dtype_broadcasts

STATE_KEY = "hvd_compress"
COLLECTIVES = ("horovod", "gloo", "nccl")
"""What can carry the dense rounds (``collectives=`` of :func:`DistributedOptimizer`)."""


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods mixed into the user's optimizer class (see :func:`DistributedOptimizer`)."""

    def __init__(self, params: Any, named_parameters: list[tuple[str, torch.Tensor]] | None,
                 compression: Scheme, backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float, sparse_as_dense: bool, policy: Policy | None,
                 seed: int, process_set: Any, ps: str | None,
                 bucket_mb: float | None, connect_timeout: float | None = None,
                 report_every: int = DEFAULT_REPORT_EVERY,
                 collectives: str = "horovod", hierarchy: str | None = None) -> None:
        super(self.__class__, self).__init__(params)
        if named_parameters is None:
            named_parameters = [(f"allreduce.noname.{i}.{j}", p)
                                for i, group in enumerate(self.param_groups)
                                for j, p in enumerate(group["params"])]
        named_parameters = list(named_parameters)
        if any(not isinstance(item, tuple) for item in named_parameters):
            raise ValueError("named_parameters should be a sequence of (name, parameter) "
                             "tuples, usually model.named_parameters()")
        names = [name for name, _ in named_parameters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"parameter names must be unique; duplicated: {duplicates}")
        named_ids = {id(p) for _, p in named_parameters}
        unnamed = [tuple(p.shape) for group in self.param_groups for p in group["params"]
                   if id(p) not in named_ids]
        if unnamed:
            raise ValueError(f"named_parameters was given but {len(unnamed)} optimised "
                             f"parameter(s) are not in it (shapes {unnamed})")

        self._parameter_names = {p: name for name, p in sorted(named_parameters,
                                                                key=lambda item: item[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._delay = {p: backward_passes_per_step for p in self._parameter_names}
        self.sparse_as_dense = sparse_as_dense
        self._wiring = (process_set, collectives, ps, connect_timeout)
        session = os.urandom(4).hex() if ps else None
        # Under horovodrun's elastic mode a rank that joins later builds its optimizer
        # alone: no collective here; hvd_compress.torch.elastic.TorchState's first sync
        # gives every rank rank 0's session.
        if ps and os.environ.get("HOROVOD_ELASTIC") != "1":
            session = hvd.broadcast_object(session, root_rank=0,
                                           process_set=process_set or hvd.global_process_set)
        options = dict(average=(op == hvd.Average), prescale=gradient_predivide_factor,
                       seed=seed, report_every=report_every,
                       bucket_bytes=max(1, int(bucket_mb * 2**20)) if bucket_mb else None)
        self._pipeline: Pipeline | HierarchicalPipeline
        if hierarchy is None:
            self._pipeline = Pipeline(compression, self._communicator(session), policy,
                                      **options)
        else:
            self._pipeline = horovod_pipeline(hvd, compression, policy, ps, session,
                                              connect_timeout, **options)
        self._submitted: set[torch.Tensor] = set()
        self._requires_update: list[torch.Tensor] = []
        self._synchronized = False
        self._should_synchronize = True
        self._completed_steps = 0
        self._stats_logger: StatsLogger | None = None
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self._requires_update.append(p)
                    p.register_post_accumulate_grad_hook(self._on_grad)
        # Backward produces gradients roughly in reverse registration order (DDP's
        # assumption too): the last layers' bucket is complete, and starts, first.
        backward_order = self._requires_update[::-1]
        # Shapes let Compression.auto measure and decide its routes here, on every rank;
        # under horovodrun elastic, element counts only: a joining rank runs no collective
        # here, and the elastic state's sync() decides on every rank.
        elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        self._pipeline.plan([self._parameter_names[p] for p in backward_order],
                            [p.numel() if elastic else p.shape for p in backward_order],
                            backward_order[0].device if backward_order else "cpu")

    def _communicator(self, session: str | None, ps_workers: int | None = None
                      ) -> Communicator:
        """The communicator of Horovod's current ranks (parameter-server rounds under
        ``session`` when a ``ps=`` was given, as one of ``ps_workers`` workers: default
        Horovod's size)."""
        process_set, collectives, ps, connect_timeout = self._wiring
        horovod = HorovodTorchCommunicator(process_set)
        comm: Communicator = horovod
        if collectives != "horovod":  # a torch.distributed group of that backend
            comm = TorchDistCommunicator(horovod_group(hvd, collectives), horovod)
        if ps:
            comm = ParameterServerCommunicator(
                comm, connect(ps, comm.rank, workers=ps_workers,
                              connect_timeout=connect_timeout), session)
        return comm

    def _rewire(self, session: str | None, ps_workers: int | None = None) -> Communicator:
        """Exchange over Horovod's ranks as they are now (after an elastic reset changed
        them), with parameter-server rounds under the new ``session``; the compression
        state is kept. Returns the new communicator. Used by
        :mod:`hvd_compress.torch.elastic`."""
        old = self._pipeline.comm
        close = getattr(old, "close", None) or getattr(getattr(old, "client", None),
                                                       "close", None)
        if close is not None:
            close()
        comm = self._communicator(session, ps_workers)
        self._use(comm)
        self._submitted.clear()
        self._synchronized = False
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        return comm

    def _use(self, comm: Communicator) -> None:
        """Exchange through ``comm`` from the next step on."""
        self._pipeline.comm = comm
        self._pipeline.routes.comm = comm

    # Backward hook: start communication as soon as a gradient is complete ---------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "optimizer.step(). Increase backward_passes_per_step to accumulate "
                "gradients locally.")
        self._delay[p] -= 1
        if self._delay[p] == 0:
            self._submit(p)

    def _submit(self, p: torch.Tensor) -> None:
        if p.grad is None:
            # Another rank may have a gradient for it (dynamic graphs): send zeros.
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse and self.sparse_as_dense:
            grad = grad.to_dense()
        self._pipeline.submit(self._parameter_names[p], grad)
        self._submitted.add(p)

    def synchronize(self) -> None:
        """Finish every gradient's exchange and write the aggregates into ``p.grad``."""
        for p in self._requires_update:
            if p not in self._submitted:
                self._submit(p)
        # Dense gradients receive their aggregates in place (scaled and cast in one pass).
        into = {self._parameter_names[p]: p.grad for p in self._requires_update
                if not p.grad.is_sparse}
        try:
            results = self._pipeline.wait(into)
        finally:
            self._submitted.clear()
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step
        for p in self._requires_update:
            if p.grad.is_sparse:
                p.grad = results[self._parameter_names[p]].to_sparse()
        self._synchronized = True
        self._completed_steps += 1
        if self._stats_logger is not None:
            self._stats_logger(self._completed_steps, self._pipeline.last_step,
                               self._pipeline.total)

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this context does not synchronise (after an explicit
        ``synchronize()``, e.g. to clip the aggregated gradients)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): gradients are exchanged twice",
                              stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pipeline.pending:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize(); this "
                                 "would race with gradients in flight")
        return super(self.__class__, self).zero_grad(set_to_none)

    # Statistics and state -------------------------------------------------------------------
    @property
    def compression_stats(self) -> CompressionStats:
        """Bytes and time of the last completed step on this rank: ``print()`` it for a
        summary, ``.to_dict()`` for a plain dict (see :class:`CompressionStats`)."""
        return CompressionStats.of(self._pipeline.last_step, min(self._completed_steps, 1))

    @property
    def compression_totals(self) -> CompressionStats:
        """The same, summed over all steps completed so far on this rank."""
        return CompressionStats.of(self._pipeline.total, self._completed_steps)

    @property
    def compression_feedback(self) -> dict[str, Any]:
        """Per compressed tensor, its last measured step on this rank
        (:class:`~hvd_compress.feedback.FeedbackStats`, from
        :meth:`hvd_compress.feedback.ErrorFeedback.report`): the compression error
        ``||decode(sent) - x|| / ||x||`` of what the scheme sent against what it was given
        (``x = g + e`` with error feedback), the residual's norm (error feedback's, DGC's
        velocity, or 0 for a scheme that keeps none; ``residual`` says which) and its growth
        against its early size, the scheme and the share of entries sent. Tensors sent
        dense are not in it. docs/benchmarks.md#convergence lists healthy values per scheme;
        a residual that grows without bound raises
        :class:`~hvd_compress.feedback.ResidualGrowthWarning` naming the tensor."""
        return self._pipeline.feedback.report()

    def log_compression_stats(self, to: Any, every: int = 100,
                              prefix: str = "hvd_compress") -> None:
        """After every ``every``-th step, send that step's :attr:`compression_stats` to
        ``to``: a ``torch.utils.tensorboard.SummaryWriter`` (or any object with
        ``add_scalar(tag, value, global_step)``; tags under ``prefix``, e.g.
        ``hvd_compress/ratio``, ``hvd_compress/bytes/<round>``,
        ``hvd_compress/total_ratio``) or a callable ``to(step, stats)``. Steps count
        completed exchanges from 1. Each rank logs its own bytes: call it on rank 0 only
        for one series. ``to=None`` stops logging. See :class:`StatsLogger`."""
        self._stats_logger = None if to is None else StatsLogger(to, every, prefix)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state plus residuals, scheme state and step counters."""
        state = super(self.__class__, self).state_dict()
        state[STATE_KEY] = self._pipeline.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        compression_state = state_dict.pop(STATE_KEY, None)
        super(self.__class__, self).load_state_dict(state_dict)
        if compression_state is not None:
            devices = {name: p.device for p, name in self._parameter_names.items()}
            pieces = getattr(self._pipeline, "tensor_of", {})  # hierarchy="host"
            devices.update({key: devices[t] for key, t in pieces.items() if t in devices})
            self._pipeline.load_state_dict(_on_devices(compression_state, devices))
        for p in self._delay:
            self._delay[p] = self.backward_passes_per_step
        self._synchronized = False

    @contextmanager
    def _local_step(self) -> Iterator[None]:
        """``step()`` applies local gradients without any exchange (used to initialise the
        wrapped optimizer's state on every rank before a broadcast)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True
            self._synchronized = False
            self._submitted.clear()
            for p in self._delay:
                self._delay[p] = self.backward_passes_per_step


def _on_devices(state: dict[str, Any], devices: dict[str, torch.device]) -> dict[str, Any]:
    """The pipeline's state with each tensor's residual and scheme state on the device of
    the parameter of that name, as torch's optimizers move their own state on loading (a
    checkpoint loaded with ``map_location="cpu"`` for a model on a GPU, say)."""
    def moved(name: str, value: Any) -> Any:
        device = devices.get(name)
        return value.to(device) if isinstance(value, torch.Tensor) and device else value

    state = dict(state)
    if isinstance(state.get("residuals"), dict):
        state["residuals"] = {n: moved(n, r) for n, r in state["residuals"].items()}
    if isinstance(state.get("scheme_state"), dict):
        state["scheme_state"] = {n: {k: moved(n, v) for k, v in st.items()}
                                 for n, st in state["scheme_state"].items()}
    return state


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Any = None,
    backward_passes_per_step: int = 1,
    op: int = hvd.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: Any = None,
    *,
    policy: Policy | None = None,
    seed: int = 0,
    ps: str | None = None,
    bucket_mb: float | None = DEFAULT_BUCKET_MB,
    connect_timeout: float | None = None,
    report_every: int = DEFAULT_REPORT_EVERY,
    collectives: str = "horovod",
    hierarchy: str | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks and
    exchanged with ``compression``: a scheme of :class:`hvd_compress.Compression` (default
    ``Compression.none``), or Horovod's own ``hvd.Compression.none``/``hvd.Compression.fp16``,
    which mean ``Compression.none``/``Compression.fp16``.

    The arguments and their meaning are those of ``horovod.torch.DistributedOptimizer``:
    communication starts from a hook as each gradient is accumulated, ``step()`` (or
    ``synchronize()``) waits for it, ``backward_passes_per_step`` accumulates locally first,
    ``op`` is ``hvd.Average`` or ``hvd.Sum``, ``gradient_predivide_factor`` divides before the
    sum and multiplies after. The returned object is an instance of the wrapped optimizer's
    class, so schedulers and checkpoints treat it as such; its ``state_dict()`` also holds
    the compression state (residuals, PowerSGD's ``Q``, step counters).

    Additional keyword arguments:
        policy: which tensors are compressed (:class:`hvd_compress.Policy`; by default,
            tensors of at least 1024 elements and two or more dimensions).
        seed: base seed of the schemes' random streams; the same on every rank.
        ps: parameter servers (``python -m ps_server``) that sum the sparse schemes'
            pairs (top-k, DGC): ``"grpc://host:7070,host:7071"`` (one address per shard,
            ``grpcs://`` for TLS with the CA file in ``$HVD_COMPRESS_PS_CA``), or ``"mpi"``
            for servers in the same MPMD ``mpirun`` (start Horovod with
            :func:`hvd_compress.torch.init`). Defaults to ``$HVD_COMPRESS_PS``; with neither,
            sparse pairs are summed by Horovod ``allgather`` (same frames, same sums). Every
            other collective goes through Horovod either way. The token is read from
            ``$HVD_COMPRESS_PS_TOKEN``. The syntax is checked here (``ValueError`` naming a
            bad address and the accepted forms); the servers are contacted at the first
            step that sends sparse pairs.
        bucket_mb: like DDP's ``bucket_cap_mb``, the size in MiB (of float32 gradients) of
            the buckets whose gradients are exchanged together, filled in reverse
            registration order (the order backward produces gradients). Once a bucket's
            gradients are ready, each communication round goes as one collective per kind
            and dtype. Smaller buckets start communicating earlier; larger ones start fewer
            collectives. Default 64 (Horovod's fusion threshold), or the scheme's own size
            when it names one (:func:`~hvd_compress.policy.default_bucket_mb`: 1-bit 8.01);
            ``None`` or 0: one bucket, started once backward has finished.
        connect_timeout: seconds to wait for a gRPC server that does not answer at all
            before the step fails with a ``PSError`` naming it (default
            ``$HVD_COMPRESS_PS_CONNECT_TIMEOUT``, else 10 s); failures after a server has
            answered are retried for ``$HVD_COMPRESS_PS_RETRY_TIMEOUT`` (60 s).
        report_every: how often ``compression_feedback`` measures the compression error of
            a tensor without error feedback (fp16, TernGrad, QSGD, the vote): every
            ``report_every``-th step (default 10; 1: every step; 0: never). Measuring
            decodes the rank's own payload, one extra decode per tensor. Tensors with error
            feedback and DGC's velocity are measured at every step.
        collectives: what carries the dense rounds (all-reduces, PowerSGD's ``P`` and
            ``Q``, the compressed all-reduce's scatter and gather). ``"horovod"`` (default):
            Horovod's collectives, each round waiting for the next ``HOROVOD_CYCLE_TIME``
            cycle. ``"gloo"``: a ``torch.distributed`` Gloo group over Horovod's ranks
            (:func:`hvd_compress.comm.gloo_torch.horovod_gloo_group`), each round started at
            once from this thread as DDP's hooks do; collectives are then matched by the
            order they start, so every rank must run the same parameters' backward (unused
            parameters are sent as zeros at ``step()``). Needs the global process set.
            Top-k's pairs go on the group too (every rank sends ``k``, so one all-gather
            of a size known in advance carries them); other sparse pairs (DGC's,
            threshold's) still go through Horovod, and every sparse sum to a ``ps=`` server;
            for dense schemes and top-k ``HOROVOD_CYCLE_TIME=100`` spares Horovod's idle
            loop (docs/user-guide.md). ``"nccl"``: the same on a NCCL group for a model on
            the GPU (:mod:`hvd_compress.comm.torch_dist`); refused, with what to change, unless
            this torch has NCCL, CUDA is available and every parameter is on the current
            CUDA device (``torch.cuda.set_device(hvd.local_rank())`` then
            ``model.cuda()``).
        hierarchy: ``None`` (default): every rank compresses and exchanges with every
            other. ``"host"``: two-level compression: the ranks of a host first sum their
            gradients dense, then each local rank exchanges its slice of every tensor
            (PowerSGD: whole tensors) compressed across hosts, and the host all-gathers the
            result (:mod:`hvd_compress.hierarchy`). Hosts are Horovod's (split by
            network namespace), or ``$HVD_COMPRESS_RANKS_PER_HOST`` consecutive ranks; needs
            ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` (or the sets registered at ``hvd.init``),
            ``collectives="horovod"`` and the global process set; a ``ps=`` server is then
            started with ``--workers`` the number of hosts. See
            docs/user-guide.md#two-level-compression.

    Horovod's explicit ``groups``/``num_groups`` are not supported (Horovod's tensor fusion
    still batches small all-reduces), nor is ``op=hvd.Adasum``: both raise ``ValueError``.
    """
    check_wrappable(optimizer)  # not OneBitAdam & co., which exchange by themselves
    compression = resolve_compression(compression, "torch")
    compression.check_optimizer(optimizer)  # e.g. DGC refuses an optimizer with momentum
    check_horovod_arguments(hvd, op=op, gradient_predivide_factor=gradient_predivide_factor,
                            groups=groups, num_groups=num_groups,
                            backward_passes_per_step=backward_passes_per_step)
    if bucket_mb is DEFAULT_BUCKET_MB:  # not given: the scheme's preference, if any
        bucket_mb = default_bucket_mb(compression)
    if bucket_mb is not None and bucket_mb < 0:
        raise ValueError(f"bucket_mb must be >= 0 or None, got {bucket_mb}")
    if collectives not in COLLECTIVES:
        raise ValueError(f"collectives must be one of {COLLECTIVES}, got {collectives!r}")
    if collectives != "horovod" and process_set is not None \
            and process_set.process_set_id != hvd.global_process_set.process_set_id:
        raise ValueError(f"collectives={collectives!r} runs over Horovod's global ranks; "
                         "pass process_set=None or use collectives='horovod'")
    if collectives == "nccl":
        check_nccl(p.device for group in optimizer.param_groups for p in group["params"])
    check_timeout(connect_timeout, "connect_timeout")
    ps = resolve_ps(ps)
    check_hierarchy(hierarchy, compression, collectives=collectives, ps=ps,
                    process_set=process_set, global_set=hvd.global_process_set)
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_DistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters, compression, backward_passes_per_step,
               op, gradient_predivide_factor, sparse_as_dense, policy, seed, process_set, ps,
               bucket_mb, connect_timeout, report_every, collectives, hierarchy)


def init(ps: str | None = None, controller: str | None = None, **kwargs: Any) -> None:
    """Start Horovod: ``hvd.init(**kwargs)``, or, for ``ps="mpi"`` (default
    ``$HVD_COMPRESS_PS``), split the parameter-server ranks of an MPMD ``mpirun`` off
    ``MPI.COMM_WORLD`` and start Horovod on the workers' communicator::

        mpirun -np 2 python train.py : -np 1 python -m ps_server --transport mpi --workers 2

    ``controller`` (``"auto"``, ``"gloo"`` or ``"horovod"``; default
    ``$HVD_COMPRESS_CONTROLLER``, else ``"auto"``: Horovod's Gloo controller in ranks that
    ``mpirun`` started, unless something needs its MPI controller) as in
    :func:`hvd_compress.mpmd.init`.

    See :func:`hvd_compress.mpmd.init` (shared with ``hvd_compress.tensorflow.init``)."""
    mpmd.init(hvd, "hvd_compress.torch", ps, controller, **kwargs)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """``hvd.broadcast_optimizer_state`` for either optimizer.

    Horovod initialises an empty optimizer state by calling ``step()`` with zero gradients;
    on this optimizer that step runs locally, without an exchange, so no compression state
    (residuals, step counters) changes. Tensors of dtypes Horovod cannot broadcast
    (bfloat16 momentum buffers, Adam moments) travel as their bit patterns
    (:func:`hvd_compress.torch.broadcast.broadcast_parameters`).
    """
    local_step = getattr(optimizer, "_local_step", None)
    with any_dtype_broadcasts():
        if local_step is not None:
            with local_step():
                hvd.broadcast_optimizer_state(optimizer, root_rank)
        else:
            hvd.broadcast_optimizer_state(optimizer, root_rank)
