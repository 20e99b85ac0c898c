"""``bench overhead``: what our PowerSGD costs the CPU per step, against DDP's
``powerSGD_hook``, side by side in one process.

On a cluster the exchange's own computation competes with the model's for the cores; a
multi-host run mixes it with waiting on the network. Here one process, a world of one rank
(nothing to wait for), trains each model of ``bench cluster``'s zoo
(:data:`~hvd_compress.bench.cluster_rank.MODELS`) in turn with:

- ``floor``: plain SGD, no exchange;
- ``ddp``: ``DistributedDataParallel`` (one bucket, as ``bench cluster`` runs the hook)
  whose comm hook hands the bucket back untouched: DDP's own cost, no compression;
- ``hook``: the same DDP with ``powerSGD_hook`` (error feedback, warm start);
- ``ours``: :func:`hvd_compress.torch.DistributedOptimizer` with PowerSGD at the same rank
  and start, on Horovod started in this process;
- ``alternate``: the same with ``alternate=True`` at twice the rank (one round and one
  side per step: the same bytes per step as ``ours``).

Each is timed for ``steps`` steps after ``warmup`` (past PowerSGD's start; ours also past
error feedback's early measurements, :func:`~hvd_compress.bench.cluster_rank.settling_steps`),
``repeats`` times in turn so a slow spell of the machine falls on all alike. Per step: the median
wall time and the mean CPU seconds of the whole process. The hook's own cost is ``hook``
less ``ddp``; ours is ``ours`` less ``floor``, and the sum of our optimizer's measured
phases (``feedback``, ``scheme``, ``fuse``, ``settle``, ``commit``: its work on the training thread,
without waits). Horovod's background cycle (``HOROVOD_CYCLE_TIME``) delays a one-rank
all-reduce without using the CPU, so CPU seconds, not wall time, compare the two.

Each exchange alone (:func:`own_costs`): the differences above subtract two whole training
steps, whose backward pass dominates, so on a loaded machine they are noisy. The exchange's
own CPU is also measured with no model step at all, on one backward pass's gradients of the
model, kept and handed over again every step: DDP's ``powerSGD_hook`` called on a stand-in
of DDP's one bucket (:class:`OneBucket`, the gradients laid out as DDP lays them, refilled
before each call; the refill is measured alone and subtracted), against our
:class:`~hvd_compress.pipeline.Pipeline` on Horovod's one rank submitting every gradient and
writing the aggregates into buffers of their own, with PowerSGD (``ours``), its
``alternate`` form at twice the rank, 1-bit and top-k 0.1% (``onebit``, ``topk``; no hook
to compare with). Each runs :data:`OWN_WARMUP` untimed steps first (past error feedback's
early measurements, :class:`~hvd_compress.feedback.ErrorFeedback`'s ``window``, which a
long run pays only once), then ``repeats`` turns of ``steps`` steps in turn; the median
turn's process CPU per step is reported.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from hvd_compress.bench.cluster_rank import (
    MODELS,
    Workload,
    _cpu_seconds,
    _loss,
    settling_steps,
)
from hvd_compress.bench.report import Column, Row
from hvd_compress.native.loader import disabled

SYSTEMS = ("floor", "ddp", "hook", "ours", "alternate")
OWN_PHASES = ("feedback", "scheme", "fuse", "settle", "commit", "report")
"""Our optimizer's phases that are its own work (the others are ``wait ...``)."""
DEFAULT_MODELS = ("mlp", "mlp8m", "mlp-deep", "mlp-narrow", "cnn", "transformer")
CPU_RATIO = 1.2
"""Target: our own CPU seconds per step at most this times the hook's."""
ALONE = ("hook", "ours", "ours-torch", "alternate", "onebit", "topk")
"""The exchanges :func:`own_costs` times alone. ``ours-torch`` is ``ours`` with the native
kernels off (:func:`hvd_compress.native.loader.disabled`): PowerSGD's products and commit
by torch (MKL) instead of ``lowrank.cpp``, as on a machine where they are not built."""
OWN_WARMUP = 30
"""Untimed steps of each exchange before :func:`own_costs` times it."""
TOPK_RATIO = 0.001


def _unchanged(state, bucket):
    """A DDP comm hook that sends nothing: the bucket comes back as it is. (No annotations:
    DDP checks them, and these would be strings.)"""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _wrap(system: str, model: nn.Module, rank: int, start: int
          ) -> tuple[nn.Module, torch.optim.Optimizer]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if system == "floor":
        return model, optimizer
    if system in ("ddp", "hook"):
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, bucket_cap_mb=1000, init_sync=False)
        if system == "hook":
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                       start_powerSGD_iter=start, use_error_feedback=True,
                                       warm_start=True)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        else:
            ddp.register_comm_hook(None, _unchanged)
        return ddp, optimizer
    import hvd_compress.torch as hvdc
    from hvd_compress import Compression

    alternate = system == "alternate"
    scheme = Compression.powersgd(rank=2 * rank if alternate else rank, start_iter=start,
                                  alternate=alternate)
    return model, hvdc.DistributedOptimizer(optimizer, compression=scheme,
                                            named_parameters=model.named_parameters())


def time_system(system: str, workload: Workload, steps: int, warmup: int, rank: int,
                start: int) -> dict[str, Any]:
    """``steps`` timed steps of one system on a fresh model: per-step wall times, CPU
    seconds per step and (ours) the optimizer's own phases per step."""
    forward, optimizer = _wrap(system, workload.build(0), rank, start)
    warmup += settling_steps(optimizer)
    batch = workload.batch(torch.Generator().manual_seed(0))
    times: list[float] = []
    phases: dict[str, float] = {}
    cpu0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            cpu0 = _cpu_seconds()
        began = time.perf_counter()
        optimizer.zero_grad()
        _loss(forward(batch[0]), batch[1]).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
        stats = getattr(optimizer, "compression_stats", None)
        if stats is not None and step >= warmup:
            for part, spent in stats.seconds.items():
                phases[part] = phases.get(part, 0.0) + spent / steps
    return {"times": times[warmup:], "cpu": (_cpu_seconds() - cpu0) / steps, "phases": phases}


class OneBucket:
    """A stand-in for :class:`torch.distributed.GradBucket` holding every gradient, as DDP
    with ``bucket_cap_mb=1000`` has them: one flat buffer and views of it, in the order
    given. It answers what ``powerSGD_hook`` asks of a bucket."""

    def __init__(self, gradients: Sequence[torch.Tensor]) -> None:
        self.flat = torch.cat([g.reshape(-1) for g in gradients])
        self._buffer = torch.empty_like(self.flat)
        self._views, offset = [], 0
        for g in gradients:
            self._views.append(self._buffer[offset:offset + g.numel()].view(g.shape))
            offset += g.numel()

    def refill(self) -> None:
        """Put the gradients back (the hook overwrites them with the aggregate)."""
        self._buffer.copy_(self.flat)

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def is_last(self) -> bool:
        return True

    def parameters(self) -> list[torch.Tensor]:
        return []


def _scheme(system: str, rank: int, start: int) -> Any:
    from hvd_compress import Compression

    if system == "onebit":
        return Compression.onebit()
    if system == "topk":
        return Compression.topk(ratio=TOPK_RATIO)
    alternate = system == "alternate"
    return Compression.powersgd(rank=2 * rank if alternate else rank, start_iter=start,
                                alternate=alternate)


def _exchanges(model: nn.Module, rank: int, start: int) -> dict[str, Callable[[], None]]:
    """One step of each exchange of :data:`ALONE` (and ``refill``, the hook's copy) on the
    gradients ``model`` holds, in backward order."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator
    from hvd_compress.pipeline import Pipeline

    named = [(name, p.grad.detach().clone()) for name, p in model.named_parameters()][::-1]
    bucket = OneBucket([g for _, g in named])
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                               start_powerSGD_iter=start, use_error_feedback=True,
                               warm_start=True)

    def hook() -> None:
        bucket.refill()
        psgd.powerSGD_hook(state, bucket).wait()  # type: ignore[arg-type]

    steps = {"hook": hook, "refill": bucket.refill}
    outputs = {name: torch.empty_like(g) for name, g in named}
    for system in ALONE[1:]:
        pipeline = Pipeline(_scheme(system, rank, start), HorovodTorchCommunicator(None))
        pipeline.plan([name for name, _ in named], [g.shape for _, g in named])

        def ours(pipeline: Pipeline = pipeline, native: bool = system != "ours-torch"
                 ) -> None:
            with contextlib.nullcontext() if native else disabled():
                for name, gradient in named:
                    pipeline.submit(name, gradient)
                pipeline.wait(outputs)

        steps[system] = ours
    return steps


def own_costs(workload: Workload, steps: int, repeats: int, rank: int, start: int
              ) -> dict[str, float]:
    """Process CPU seconds per step of each exchange of :data:`ALONE` alone on one backward
    pass's gradients of ``workload``'s model (the module notes): the median of ``repeats``
    turns of ``steps`` steps, after :data:`OWN_WARMUP` untimed ones; the hook's without its
    bucket's refill."""
    model = workload.build(0)
    inputs, target = workload.batch(torch.Generator().manual_seed(0))
    _loss(model(inputs), target).backward()
    exchanges = _exchanges(model, rank, start)
    for step in exchanges.values():
        for _ in range(OWN_WARMUP):
            step()
    turns: dict[str, list[float]] = {name: [] for name in exchanges}
    for _ in range(repeats):
        for name, step in exchanges.items():
            began = _cpu_seconds()
            for _ in range(steps):
                step()
            turns[name].append((_cpu_seconds() - began) / steps)
    median = {name: statistics.median(values) for name, values in turns.items()}
    median["hook"] -= median.pop("refill")
    return median


@contextmanager
def one_rank_world() -> Iterator[None]:
    """A ``torch.distributed`` Gloo group and Horovod, each of one rank, in this process."""
    import horovod.torch as hvd
    import torch.distributed as dist

    import hvd_compress.torch as hvdc

    with tempfile.TemporaryDirectory(prefix="hvdc-overhead-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        os.environ.setdefault("HOROVOD_GLOO", "1")  # no MPI singleton for one rank
        hvdc.init()
        try:
            yield
        finally:
            hvd.shutdown()
            dist.destroy_process_group()


def run(models: Sequence[str], steps: int = 20, warmup: int = 5, repeats: int = 3,
        rank: int = 4, start: int = 2,
        progress: Callable[[str], None] = lambda text: None) -> list[Row]:
    """One row per model: each system's median step and CPU per step, the hook's and our
    own cost, and their ratio."""
    torch.set_num_threads(1)
    rows = []
    with one_rank_world():
        for name in models:
            workload = MODELS[name]
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SYSTEMS}
            for turn in range(repeats):
                for system in SYSTEMS:
                    progress(f"{name}: {system} ({turn + 1} of {repeats})")
                    runs[system].append(time_system(system, workload, steps, warmup, rank,
                                                    start))
            progress(f"{name}: each exchange alone ({repeats} turns)")
            alone = own_costs(workload, steps, repeats, rank, start)
            rows.append(summarise(name, workload, runs, alone))
    return rows


def summarise(name: str, workload: Workload, runs: dict[str, list[dict[str, Any]]],
              alone: dict[str, float] | None = None) -> Row:
    step = {s: statistics.median(t for r in runs[s] for t in r["times"]) for s in SYSTEMS}
    cpu = {s: statistics.mean(r["cpu"] for r in runs[s]) for s in SYSTEMS}
    phases = {part: statistics.mean(r["phases"].get(part, 0.0) for r in runs["ours"])
              for part in OWN_PHASES}
    hook_cpu, ours_cpu = cpu["hook"] - cpu["ddp"], cpu["ours"] - cpu["floor"]
    alternate_cpu = cpu["alternate"] - cpu["floor"]
    return {"model": name, "parameters": workload.parameters(), "about": workload.about,
            "step_s": step, "cpu_s": cpu,
            "hook_wall_s": step["hook"] - step["ddp"], "hook_cpu_s": hook_cpu,
            "ours_cpu_s": ours_cpu, "ours_phases_s": phases,
            "ours_phases_total_s": sum(phases.values()),
            "cpu_ratio": ours_cpu / hook_cpu if hook_cpu > 0 else None,
            "alternate_cpu_s": alternate_cpu,
            "alternate_cpu_ratio": alternate_cpu / hook_cpu if hook_cpu > 0 else None,
            "alone_cpu_s": alone or {},
            "alone_ratio": _alone_ratios(alone or {})}


def _alone_ratios(alone: dict[str, float]) -> dict[str, float]:
    """Each of our exchanges' CPU alone over the hook's, for those with a hook to match
    (PowerSGD, both forms); none when the hook's was not measured above zero."""
    hook = alone.get("hook", 0.0)
    return {s: alone[s] / hook for s in ("ours", "ours-torch", "alternate")
            if s in alone and hook > 0}


def _ms(value: float) -> str:
    return f"{1000 * value:.1f}"


COLUMNS = [
    Column("model", lambda r: r["model"]),
    Column("params M", lambda r: f"{r['parameters'] / 1e6:.2f}"),
    *(Column(f"{s} step ms", lambda r, s=s: _ms(r["step_s"][s])) for s in SYSTEMS),
    Column("hook CPU ms", lambda r: _ms(r["hook_cpu_s"])),
    Column("ours CPU ms", lambda r: _ms(r["ours_cpu_s"])),
    Column("ours phases ms", lambda r: _ms(r["ours_phases_total_s"])),
    Column("ours/hook CPU", lambda r: "-" if r["cpu_ratio"] is None
           else f"{r['cpu_ratio']:.2f}"),
    Column("alternate CPU ms", lambda r: _ms(r["alternate_cpu_s"])),
    Column("alternate/hook CPU", lambda r: "-" if r["alternate_cpu_ratio"] is None
           else f"{r['alternate_cpu_ratio']:.2f}"),
    *(Column(f"alone {s} ms", lambda r, s=s: "-" if s not in r["alone_cpu_s"]
             else _ms(r["alone_cpu_s"][s])) for s in ALONE),
    *(Column(f"alone {s}/hook", lambda r, s=s: "-" if s not in r["alone_ratio"]
             else f"{r['alone_ratio'][s]:.2f}") for s in ("ours", "ours-torch", "alternate")),
]


def title(steps: int, repeats: int, rank: int) -> str:
    return (f"PowerSGD rank {rank}: our optimizer against DDP's powerSGD_hook, one process, "
            f"one rank, one thread; {repeats} x {steps} timed steps per system, in turn. "
            "CPU: the process's seconds per step beyond the floor's (ours) or beyond DDP "
            "with a hook that sends nothing (the hook's); alone: each exchange's process CPU "
            f"per step on the model's gradients without a training step, after {OWN_WARMUP} "
            f"untimed steps (onebit: 1-bit; topk: top-k {TOPK_RATIO:g})")


def targets(rows: Sequence[Row]) -> list[str]:
    lines = []
    for r in rows:
        if r["cpu_ratio"] is None:
            lines.append(f"FAIL  {r['model']}: the hook's CPU time was not measured above "
                         "DDP's own")
            continue
        for what, cpu, ratio in (("", r["ours_cpu_s"], r["cpu_ratio"]),
                                 (" (alternate)", r["alternate_cpu_s"],
                                  r["alternate_cpu_ratio"])):
            ok = ratio <= CPU_RATIO
            lines.append(f"{'PASS' if ok else 'FAIL'}  {r['model']}: our CPU per step{what} "
                         f"{_ms(cpu)} ms <= {CPU_RATIO} x the hook's "
                         f"{_ms(r['hook_cpu_s'])} ms ({ratio:.2f} x)")
        for system, ratio in r.get("alone_ratio", {}).items():
            if system == "ours-torch":  # a reference (without the kernels)
                continue
            what = "" if system == "ours" else " (alternate)"
            lines.append(f"{'PASS' if ratio <= CPU_RATIO else 'FAIL'}  {r['model']}: our "
                         f"exchange alone{what} {_ms(r['alone_cpu_s'][system])} ms <= "
                         f"{CPU_RATIO} x the hook alone {_ms(r['alone_cpu_s']['hook'])} ms "
                         f"({ratio:.2f} x)")
    return lines
