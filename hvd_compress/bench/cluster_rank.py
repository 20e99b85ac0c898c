"""One rank of ``bench cluster``: real training steps of one system on an emulated host.

Run by :mod:`hvd_compress.bench.cluster` inside a host's namespace, never by hand. Each
configuration of the plan builds a fresh model (the same weights on every rank, from one
seed), wraps it for its system and trains ``warmup + steps`` steps (forward, backward,
exchange, update) on this rank's own random batches; the ``steps`` timed steps give the
step times (our optimizer first also passes error feedback's early measurements,
:func:`settling_steps`). Around them the rank reads its interface's byte counters, and
after them checks that every rank holds the same parameters (a run whose replicas differ
is not a correct setting, whatever its speed). Rank 0 writes one row per configuration.

Systems:

- ``ddp``: PyTorch ``DistributedDataParallel`` on Gloo; scheme ``none`` (no hook),
  ``fp16`` (``fp16_compress_hook``), ``powersgd:rank=R,start_iter=S`` (``powerSGD_hook``)
  or ``batched-powersgd:rank=R,start_iter=S`` (``batched_powerSGD_hook``: the whole
  bucket as one square matrix); ``rounds-powersgd:rank=R,start_iter=S`` is not a system
  but a floor: PowerSGD's collectives at that rank with no arithmetic
  (:class:`RoundsOnly`).
- ``horovod``: stock ``horovod.torch.DistributedOptimizer`` with ``Compression.none`` or
  ``Compression.fp16``.
- ``hvd-compress``: :func:`hvd_compress.torch.DistributedOptimizer` with any scheme,
  sparse pairs summed by Horovod ``allgather`` or by the parameter server (``ps``), the
  dense rounds on Horovod or on a Gloo group (``collectives``), flat or two-level
  (``hierarchy``).

Bytes are the counters of this rank's host: its link (``eth0``) and, apart, its loopback
(``lo``), where the ranks sharing the host send each other their traffic.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import itertools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hvd_compress.bench.hosts import LOOPBACK, interface_counters
from hvd_compress.bench.models import CharTransformer

BATCH = 32
BATCHED = "batched-powersgd"
"""DDP's ``batched_powerSGD_hook``: the prefix of its ``ddp`` schemes."""
ROUNDS = "rounds-"
"""The prefix of the ``ddp`` schemes that run :class:`RoundsOnly` (``rounds-powersgd:...``):
the PowerSGD spec follows it."""


def make_model(widths: Sequence[int], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def parameter_count(widths: Sequence[int]) -> int:
    return sum(a * b + b for a, b in itertools.pairwise(widths))


Batch = tuple[torch.Tensor, torch.Tensor]


def _batched_hook_needs_shim(psgd: Any) -> bool:
    """Let ``batched_powerSGD_hook`` run where it cannot by itself: since PyTorch's
    ``_orthogonalize`` takes batches of matrices (pytorch/pytorch#75157) the batched hook
    still hands it one 2-D matrix and fails an assertion (torch 2.13). The shim
    orthogonalizes a 2-D matrix as a batch of one, in place, which is what the hook means.
    Returns whether it is needed (and so installed)."""
    if getattr(psgd._orthogonalize, "shim", False):
        return True
    try:
        psgd._orthogonalize(torch.eye(4, 2))
        return False
    except AssertionError:
        pass
    batches = psgd._orthogonalize

    def orthogonalize(matrices: torch.Tensor, epsilon: float = 0) -> None:
        batches(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)

    orthogonalize.shim = True  # type: ignore[attr-defined]
    psgd._orthogonalize = orthogonalize
    return True


class RoundsOnly:
    """A DDP comm hook's state (one bucket) that sends what our PowerSGD sends, round by
    round, and computes nothing: the step time of those collectives alone.

    Per step, as :class:`hvd_compress.schemes.powersgd.PowerSGD` through the pipeline with
    the default :class:`hvd_compress.policy.Policy`: one all-reduce of the tensors sent
    dense together with every ``P`` (``n r`` floats a matrix), then one of every ``Q``
    (``m r``). ``powerSGD_hook`` sends its dense tensors in a round of their own, so this
    is a lower bound of both. No product, no orthogonalisation, no error feedback: the
    bucket comes back as zeros, so every replica stays as it started (they agree, and
    nothing is learnt). A PowerSGD row's step over this row's, on the same link in the same
    run, is what the arithmetic and the bookkeeping cost on the ranks' cores. Every step
    sends the rounds (``start_iter`` is not read)."""

    def __init__(self, scheme: Any) -> None:
        self.scheme = scheme
        self.rounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per bucket index, its two rounds' buffers: zeros, which all-reducing keeps
        zeros, so they are allocated once and sent every step."""

    def round_sizes(self, shapes: Sequence[torch.Size]) -> tuple[int, int]:
        """Floats of the first round (dense tensors and every ``P``) and of the second
        (every ``Q``)."""
        from hvd_compress.policy import Policy

        policy, first, second = Policy(), 0, 0
        for shape in shapes:
            if not policy.compresses(self.scheme, shape):
                first += shape.numel()
                continue
            n, m = self.scheme.matrix_shape(shape)
            r = self.scheme.factor_rank(shape)
            first, second = first + n * r, second + m * r
        return first, second


def rounds_only_hook(state, bucket):  # DDP reads the annotations: none here
    """:class:`RoundsOnly`'s two all-reduces, the second started once the first is done;
    the bucket's answer is zeros."""
    import torch.distributed as dist

    rounds = state.rounds.get(bucket.index())
    if rounds is None:
        sizes = state.round_sizes([g.shape for g in bucket.gradients()])
        rounds = state.rounds[bucket.index()] = (torch.zeros(sizes[0]), torch.zeros(sizes[1]))
    first, second = rounds
    buffer = bucket.buffer()

    def second_round(done):
        done.value()
        dist.all_reduce(second, async_op=True).get_future().wait()
        return buffer.zero_()

    return dist.all_reduce(first, async_op=True).get_future().then(second_round)


@dataclass(frozen=True)
class Workload:
    """One model of the zoo: how to build it (the same weights on every rank from one
    seed) and one rank's random batch of inputs and class targets; the loss is the
    cross-entropy of the logits (for a sequence, of every position's)."""

    build: Callable[[int], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    about: str

    def parameters(self) -> int:
        return sum(p.numel() for p in self.build(0).parameters())


def _mlp(widths: tuple[int, ...]) -> Workload:
    def batch(gen: torch.Generator) -> Batch:
        return (torch.randn(BATCH, widths[0], generator=gen),
                torch.randint(0, widths[-1], (BATCH,), generator=gen))

    return Workload(lambda seed: make_model(widths, seed), batch,
                    "MLP " + "-".join(map(str, widths)))


def _cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in ((3, 32), (32, 64), (64, 128)):
        layers += [nn.Conv2d(a, b, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*layers, nn.Flatten(), nn.Linear(128 * 4 * 4, 1024), nn.ReLU(),
                         nn.Linear(1024, 10))


def _images(gen: torch.Generator) -> Batch:
    return (torch.randn(BATCH, 3, 32, 32, generator=gen),
            torch.randint(0, 10, (BATCH,), generator=gen))


LM_VOCAB, LM_CONTEXT, LM_BATCH = 96, 32, 16


def _transformer(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return CharTransformer(LM_VOCAB, LM_CONTEXT, d=256, layers=2, heads=4)


def _characters(gen: torch.Generator) -> Batch:
    text = torch.randint(0, LM_VOCAB, (LM_BATCH, LM_CONTEXT + 1), generator=gen)
    return text[:, :-1], text[:, 1:]


MODELS: dict[str, Workload] = {
    "mlp": _mlp((1024, 4096, 2048, 1024)),
    "mlp8m": _mlp((1024, 2048, 2048, 1024)),
    "mlp-deep": _mlp((1024, 2048, 2048, 2048, 1024)),
    "mlp-narrow": _mlp((512, 1024, 1024, 1024, 1024, 512)),
    "cnn": Workload(_cnn, _images, "CNN: 3 conv 3x3 (32, 64, 128 channels) with max-pool, "
                    "then Linear(2048, 1024)-Linear(1024, 10), 3x32x32 images"),
    "transformer": Workload(_transformer, _characters,
                            "bench converge's character transformer at d=256, 2 layers, "
                            f"4 heads, context {LM_CONTEXT}, {LM_VOCAB} symbols, batch "
                            f"{LM_BATCH}"),
    "tiny": _mlp((64, 256, 128, 64)),
}
"""The zoo ``bench cluster --models`` trains: MLPs of several widths and depths (``mlp``:
14.7 M parameters, 59 MB of float32 gradients; ``mlp8m`` 8.4 M; ``mlp-deep`` three hidden
layers of 2048; ``mlp-narrow`` four of 1024), a small CNN (4-D weights, which PowerSGD
reshapes), a character transformer (embeddings, layer norms, many small tensors), and
``tiny`` for the harness's own test."""


def _checksum(model: nn.Module) -> torch.Tensor:
    return torch.stack([p.detach().double().sum() for p in model.parameters()])


class _System:
    """How one system wraps a model and checks its replicas."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "ddp":
            import torch.distributed as dist

            dist.init_process_group("gloo")
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        elif name == "local":
            self.rank, self.size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            self.local_size = None
        else:
            import horovod.torch as hvd

            if name == "hvd-compress":  # as its README starts it (Horovod's and MPI's knobs)
                import hvd_compress.torch as hvdc

                hvdc.init()
            else:
                hvd.init()
            self.rank, self.size = hvd.rank(), hvd.size()
            self.local_size = hvd.local_size()  # the ranks Horovod sees on this host

    def wrap(self, model: nn.Module, config: dict[str, Any], lr: float = 0.01,
             momentum: float = 0.0) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
        """The model to run forward, the optimizer to step, and the settings used."""
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
        scheme = config["scheme"]
        if self.name == "ddp":
            return self._ddp(model, optimizer, scheme)
        if self.name == "local":  # the compute floor: no exchange at all
            return model, optimizer, {"communication": None}
        import horovod.torch as hvd

        if self.name == "horovod":
            compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[scheme]
            wrapped = hvd.DistributedOptimizer(optimizer,
                                               named_parameters=model.named_parameters(),
                                               compression=compression)
            return model, wrapped, {"compression": f"hvd.Compression.{scheme}"}
        import hvd_compress.torch as hvdc
        from hvd_compress import Compression

        extra = {"bucket_mb": config["bucket_mb"]} if config.get("bucket_mb") else {}
        if config.get("hierarchy"):  # two-level; only passed when asked for
            extra["hierarchy"] = config["hierarchy"]
        collectives = config.get("collectives", "horovod")
        wrapped = hvdc.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                            compression=Compression.parse(scheme),
                                            ps=config.get("ps") or "", collectives=collectives,
                                            **extra)
        return model, wrapped, {"compression": scheme, "ps": config.get("ps") or "allgather",
                                "collectives": collectives, **extra}

    def _ddp(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheme: str
             ) -> tuple[nn.Module, torch.optim.Optimizer, dict[str, Any]]:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel

        from hvd_compress import Compression
        from hvd_compress.schemes.powersgd import PowerSGD

        batched = scheme.startswith(BATCHED)
        if scheme.startswith(ROUNDS):
            spec = Compression.parse(scheme.removeprefix(ROUNDS))
            assert isinstance(spec, PowerSGD)
            ddp = DistributedDataParallel(model, bucket_cap_mb=1000, init_sync=False)
            ddp.register_comm_hook(RoundsOnly(spec), rounds_only_hook)
            return ddp, optimizer, {"hook": rounds_only_hook.__name__, "bucket_cap_mb": 1000,
                                    "matrix_approximation_rank": spec.rank}
        if scheme.startswith("powersgd") or batched:
            # One bucket: with DDP's default 25 MB buckets the hook's collectives, issued
            # from asynchronous callbacks, can deadlock at 4 ranks.
            ddp = DistributedDataParallel(model, bucket_cap_mb=1000, init_sync=False)
            spec = Compression.parse(scheme.removeprefix("batched-"))
            assert isinstance(spec, PowerSGD)
            state = psgd.PowerSGDState(process_group=None,
                                       matrix_approximation_rank=spec.rank,
                                       start_powerSGD_iter=max(spec.start_iter, 2),
                                       min_compression_rate=spec.min_compression_rate,
                                       use_error_feedback=True, warm_start=spec.warm_start)
            hook = psgd.batched_powerSGD_hook if batched else psgd.powerSGD_hook
            ddp.register_comm_hook(state, hook)
            settings = {"hook": hook.__name__, "bucket_cap_mb": 1000,
                        "matrix_approximation_rank": spec.rank,
                        "start_powerSGD_iter": max(spec.start_iter, 2)}
            if batched and _batched_hook_needs_shim(psgd):
                settings["orthogonalize_shim"] = True
        else:
            ddp = DistributedDataParallel(model, init_sync=False)  # default 25 MB buckets
            settings = {"hook": None, "bucket_cap_mb": 25}
            if scheme == "fp16":
                ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
                settings["hook"] = "fp16_compress_hook"
            elif scheme != "none":
                raise ValueError(f"ddp runs none, fp16, powersgd, {BATCHED} or {ROUNDS}powersgd, "
                                 f"not {scheme!r}")
        return ddp, optimizer, settings

    def replicas_agree(self, model: nn.Module) -> bool | None:
        """Whether every rank holds the same parameters (``None`` for ``local``, whose
        ranks never exchange)."""
        local = _checksum(model)
        if self.name == "local":
            return None
        if self.name == "ddp":
            import torch.distributed as dist

            gathered = [torch.empty_like(local) for _ in range(self.size)]
            dist.all_gather(gathered, local)
        else:
            import horovod.torch as hvd

            gathered = list(hvd.allgather(local.unsqueeze(0), name="cluster.check").unbind(0))
        return all(torch.equal(g, gathered[0]) for g in gathered)

    def rank0(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a decision every rank must take alike)."""
        value = torch.tensor([float(flag) if self.rank == 0 else 0.0])
        if self.name == "local":
            return flag
        if self.name == "ddp":
            import torch.distributed as dist

            dist.all_reduce(value)
        else:
            import horovod.torch as hvd

            value = hvd.allreduce(value, op=hvd.Sum, name="cluster.rank0")
        return bool(value.item())

    def barrier(self, tag: str) -> None:
        if self.name == "local":
            return
        if self.name == "ddp":
            import torch.distributed as dist

            dist.barrier()
        else:
            import horovod.torch as hvd

            hvd.allreduce(torch.zeros(1), name=f"cluster.barrier.{tag}")


def p90(times: Sequence[float]) -> float:
    """The 90th percentile of ``times``: the element at rank ``0.9 (n - 1)`` (rounded) of
    the sorted values, the figure every row's ``step_p90_s`` holds."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def _cpu_seconds() -> float:
    """CPU time of this whole process (every thread: Horovod's, Gloo's, the server
    client's) so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU time so far of each live thread of this process, by thread id: its name
    (``/proc``'s ``comm``; the main thread is called ``main``) and its user + system seconds.
    A thread that ended before the call is not counted."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on
        tid = int(task)
        out[tid] = ("main" if tid == os.getpid() else name,
                    (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
    return out


def thread_cpu_per_step(before: dict[int, tuple[str, float]],
                        after: dict[int, tuple[str, float]], steps: int) -> dict[str, float]:
    """CPU seconds per step between two :func:`_thread_cpu` snapshots, summed by thread
    name (``main``, Horovod's and Gloo's threads, ...), busiest first."""
    spent: dict[str, float] = {}
    for tid, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(tid, (name, 0.0))[1]
    return {name: s / steps for name, s in sorted(spent.items(), key=lambda kv: -kv[1])}


PHASES = ("forward", "backward", "step")
"""The parts of a timed step in a row's ``step_phases_s`` (and the keys of ``phases_s``, their
means): the forward pass, ``loss.backward()`` (where DDP's hooks communicate) and
``optimizer.step()`` (where hvd-compress waits for its rounds)."""


class GCPauses:
    """Python's garbage collections on this process's threads (``gc.callbacks``): per
    generation their number and seconds, and the seconds spent in them since
    :meth:`take`; :meth:`row` gives the row's ``gc`` field."""

    def __init__(self) -> None:
        self._started: float | None = None
        self.reset()

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            spent = time.perf_counter() - self._started
            self._started = None
            self.collections[info["generation"]] += 1
            self.seconds[info["generation"]] += spent
            self._since += spent

    def reset(self) -> None:
        """Forget what was counted so far (the untimed steps)."""
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.per_step: list[float] = []
        self._since = 0.0

    def take(self) -> None:
        """End a step: its collections' seconds go to ``per_step``."""
        self.per_step.append(self._since)
        self._since = 0.0

    def row(self) -> dict[str, Any]:
        return {"collections": self.collections, "seconds": self.seconds,
                "per_step_s": self.per_step}


def _stats(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    stats = getattr(optimizer, "compression_stats", None)
    if stats is None:
        return {}
    out = {"payload_bytes": stats.payload_bytes, "dense_bytes": stats.dense_bytes,
           "collective_bytes": dict(stats.collective_bytes),
           "collectives": stats.collectives}
    pipeline = getattr(optimizer, "_pipeline", None)
    local = getattr(pipeline, "local", None)
    if local is not None:  # two-level: how the ranks of a host met (the scale model's check)
        from hvd_compress.comm.shm import ShmHostCommunicator

        out["in_host"] = "shm" if isinstance(local, ShmHostCommunicator) else "horovod"
    decision = getattr(pipeline, "auto_decision", None)
    if decision is not None:  # Compression.auto: what it chose, from what
        out["auto"] = {"routes": dict(collections.Counter(decision.routes.values())),
                       "predicted_exchange_s": decision.predicted,
                       "dense_predicted_exchange_s": decision.dense_predicted,
                       "latency_s": decision.link.latency,
                       "bandwidth_bytes_s": decision.link.bandwidth}
    return out


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       target.reshape(-1))


def settling_steps(optimizer: torch.optim.Optimizer) -> int:
    """Untimed steps a system takes beyond the bench's ``--warmup`` so that it is timed in
    its steady state: for our optimizer, error feedback's ``window``
    (:class:`~hvd_compress.feedback.ErrorFeedback`: each tensor's first ``window`` commits
    with a residual measure two norms for the growth warning, a start-up cost a long run
    pays once); 0 for the others. The same on every rank (the default window)."""
    feedback = getattr(getattr(optimizer, "_pipeline", None), "feedback", None)
    return feedback.window if feedback is not None else 0


def run_config(system: _System, workload: Workload, config: dict[str, Any], steps: int,
               warmup: int, progress: Callable[[str], None]) -> dict[str, Any]:
    model = workload.build(0)
    forward, optimizer, settings = system.wrap(model, config)
    warmup += settling_steps(optimizer)
    gen = torch.Generator().manual_seed(1000 + system.rank)
    batches = [workload.batch(gen) for _ in range(4)]
    loss_fn = _loss
    times: list[float] = []
    step_phases: list[tuple[float, float, float]] = []  # per step, in PHASES order
    exchange: dict[str, float] = {}  # hvd-compress's own breakdown (StepStats.seconds)
    counters0, loopback0 = interface_counters(), interface_counters(LOOPBACK)
    cpu0 = 0.0  # both set when the timed steps start
    threads0: dict[int, tuple[str, float]] = {}
    pauses = GCPauses()
    gc.callbacks.append(pauses)
    for step in range(warmup + steps):
        if step == warmup:
            system.barrier(f"{config['scheme']}.{step}")
            counters0, loopback0 = interface_counters(), interface_counters(LOOPBACK)
            cpu0, threads0 = _cpu_seconds(), _thread_cpu()
            pauses.reset()
        x, y = batches[step % len(batches)]
        start = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(forward(x), y)
        forwarded = time.perf_counter()
        loss.backward()
        backwarded = time.perf_counter()
        optimizer.step()
        end = time.perf_counter()
        pauses.take()
        times.append(end - start)
        step_phases.append((forwarded - start, backwarded - forwarded, end - backwarded))
        stats = getattr(optimizer, "compression_stats", None)
        if stats is not None and step >= warmup:
            for part, spent in stats.seconds.items():
                exchange[part] = exchange.get(part, 0.0) + spent
        progress(f"{config['scheme']} step {step + 1}/{warmup + steps} {times[-1]:.3f} s")
    gc.callbacks.remove(pauses)
    sent = interface_counters() - counters0
    loopback = interface_counters(LOOPBACK) - loopback0
    cpu = (_cpu_seconds() - cpu0) / steps
    threads = thread_cpu_per_step(threads0, _thread_cpu(), steps)
    timed = sorted(times[warmup:])
    agree = system.replicas_agree(model)
    row = {"scheme": config["scheme"], "settings": settings,
           "step_s": statistics.median(timed), "untimed_steps": warmup,
           "step_p90_s": p90(timed),
           "step_times_s": times[warmup:],
           "step_phases_s": step_phases[warmup:],
           "tx_bytes_per_step": sent.tx_bytes / steps, "rx_bytes_per_step": sent.rx_bytes / steps,
           "tx_packets_per_step": sent.tx_packets / steps,
           "tx_payload_bytes_per_step": sent.tx_payload_bytes / steps,
           "loopback_tx_bytes_per_step": loopback.tx_bytes / steps,
           "cpu_s_per_step": cpu,
           "cpu_threads_s_per_step": threads,
           "phases_s": {name: sum(p[i] for p in step_phases[warmup:]) / steps
                        for i, name in enumerate(PHASES)},
           "exchange_s": {part: total / steps for part, total in exchange.items()},
           "replicas_agree": agree, "cpu_affinity": sorted(os.sched_getaffinity(0)),
           "local_size": system.local_size,
           "gc": pauses.row(),
           **_stats(optimizer)}
    return row


DIGITS_LR, DIGITS_MOMENTUM, DIGITS_BATCH = 0.1, 0.5, 32
"""Plain SGD on digits for every system: the global batch is 32 per rank."""


def digits_shard(rank: int, size: int) -> tuple[torch.Tensor, ...]:
    """scikit-learn's digits (1797 8x8 images, scaled to [0, 1]), split 80/20 with a fixed
    seed; this rank's share of the training set, and the whole test set."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data.astype(np.float32) / 16.0, digits.target.astype(np.int64),
        test_size=0.2, random_state=0, stratify=digits.target)
    return (torch.from_numpy(x_train[rank::size]), torch.from_numpy(y_train[rank::size]),
            torch.from_numpy(x_test), torch.from_numpy(y_test))


def run_digits(system: _System, hidden: int, config: dict[str, Any], epochs: int,
               progress: Callable[[str], None], budget_s: float | None = None,
               target: float | None = None, max_epochs: int | None = None
               ) -> dict[str, Any]:
    """Train ``64-hidden-hidden-10`` on digits; after each epoch, the training seconds so
    far (evaluation not counted) and the test accuracy.

    Without ``budget_s``: ``epochs`` epochs. With it, time decides, not epochs: after
    ``epochs`` epochs the run goes on while it has not reached ``target`` accuracy, until
    its training seconds reach ``budget_s`` or ``max_epochs`` epochs (rank 0's clock
    decides for every rank)."""
    x_train, y_train, x_test, y_test = digits_shard(system.rank, system.size)
    model = make_model((64, hidden, hidden, 10))
    forward, optimizer, settings = system.wrap(model, config, DIGITS_LR, DIGITS_MOMENTUM)
    steps = (1437 // system.size) // DIGITS_BATCH  # the same number on every rank
    order = torch.Generator().manual_seed(system.rank)
    loss_fn = nn.CrossEntropyLoss()
    seconds, curve = 0.0, []
    limit = max(epochs, max_epochs or epochs) if budget_s is not None else epochs
    for epoch in range(limit):
        perm = torch.randperm(len(x_train), generator=order)
        model.train()
        start = time.perf_counter()
        for step in range(steps):
            batch = perm[step * DIGITS_BATCH:(step + 1) * DIGITS_BATCH]
            optimizer.zero_grad()
            loss_fn(forward(x_train[batch]), y_train[batch]).backward()
            optimizer.step()
        seconds += time.perf_counter() - start
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        curve.append((seconds, accuracy))
        progress(f"{config['scheme']} digits epoch {epoch + 1}/{limit} "
                 f"{seconds:.1f} s, accuracy {accuracy:.4f}")
        if budget_s is not None and epoch + 1 >= epochs and system.rank0(
                seconds >= budget_s or (target is not None and accuracy >= target)):
            break
    return {"scheme": config["scheme"], "task": "digits", "settings": settings,
            "hidden": hidden, "epochs": len(curve), "steps_per_epoch": steps,
            "budget_s": budget_s,
            "lr": DIGITS_LR, "momentum": DIGITS_MOMENTUM,
            "curve_s": [c[0] for c in curve], "curve_accuracy": [c[1] for c in curve],
            "final_accuracy": curve[-1][1], "replicas_agree": system.replicas_agree(model),
            **_stats(optimizer)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--system", choices=("ddp", "horovod", "hvd-compress", "local"),
                        required=True)
    parser.add_argument("--configs", required=True, help="JSON list of configurations")
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True, help="rank 0 writes rows here")
    parser.add_argument("--progress", type=Path, help="rank 0 writes its latest step here")
    parser.add_argument("--stacks-at", type=float, required=True,
                        help="write every thread's Python stack at this time.time()")
    parser.add_argument("--stacks-dir", type=Path, required=True)
    parser.add_argument("--digits-epochs", type=int, default=0,
                        help="train on digits for this many epochs instead of timing steps")
    parser.add_argument("--digits-hidden", type=int, default=1024)
    parser.add_argument("--digits-budget-s", type=float,
                        help="after --digits-epochs, go on until this many training seconds "
                        "or --digits-target accuracy")
    parser.add_argument("--digits-target", type=float)
    parser.add_argument("--digits-max-epochs", type=int)
    parser.add_argument("--pin-cores", action="store_true",
                        help="run on one core only, rank r on the r-th core this process may "
                        "use (modulo their number), with every thread it starts")
    args = parser.parse_args(argv)
    rank_hint = os.environ.get("HOROVOD_RANK") or os.environ.get("RANK") \
        or os.environ.get("OMPI_COMM_WORLD_RANK", "x")
    if args.pin_cores and rank_hint.isdigit():
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(rank_hint) % len(cores)]})
    stacks = (args.stacks_dir / f"stacks-rank{rank_hint}.txt").open("w")
    faulthandler.dump_traceback_later(max(args.stacks_at - time.time(), 0.1), file=stacks)
    torch.set_num_threads(1)
    system = _System(args.system)

    def progress(text: str) -> None:
        if system.rank == 0 and args.progress is not None:
            args.progress.write_text(text)

    rows = []
    for config in json.loads(args.configs):
        if args.digits_epochs:
            rows.append(run_digits(system, args.digits_hidden, config, args.digits_epochs,
                                   progress, args.digits_budget_s, args.digits_target,
                                   args.digits_max_epochs))
        else:
            rows.append(run_config(system, MODELS[args.model], config, args.steps,
                                   args.warmup, progress))
        system.barrier(f"{config['scheme']}.done")
        if system.rank == 0:
            args.out.write_text(json.dumps(rows, indent=2))
    faulthandler.cancel_dump_traceback_later()
    stacks.close()
    if args.system == "ddp":
        import torch.distributed as dist

        # Gloo's worker threads can still hold work objects of the DDP reducer and the
        # comm hook; torn down during interpreter finalization they abort the process
        # (SIGABRT, "terminate called without an active exception", seen once in CI).
        # Free the models' work while Python is fully alive, destroy the group, and
        # leave without finalization: the rows are written and every rank passed the
        # barrier above.
        rows.clear()
        gc.collect()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
