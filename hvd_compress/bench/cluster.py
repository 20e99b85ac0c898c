"""``bench cluster``: training step time of every system on an emulated cluster, side by side.

For each link rate, :func:`hvd_compress.bench.hosts.emulated_hosts` makes ``ranks`` worker
hosts (plus one for the parameter server when a configuration uses it), each running
``ranks_per_host`` ranks in its one network namespace (``--hosts H --ranks-per-host L``: the
ranks of a host talk to each other over its loopback, unthrottled, and to other hosts over
its throttled link), and every system
trains the same MLP on those hosts, one launch (fresh processes) per configuration, or with
``separate=False`` one per system running its configurations one after the other
(:mod:`hvd_compress.bench.cluster_rank`):

- PyTorch DDP on Gloo: no hook, ``fp16_compress_hook``, ``powerSGD_hook`` and
  ``batched_powerSGD_hook`` at the same rank
  and start iteration as ours (one bucket: the default buckets can deadlock at 4 ranks);
  and, when asked for (:data:`DDP_FLOORS`), a floor: our PowerSGD's two rounds with no
  arithmetic (:class:`~hvd_compress.bench.cluster_rank.RoundsOnly`);
- stock Horovod: ``Compression.none`` and ``Compression.fp16``, on Horovod's Gloo
  controller (``horovod``), under ``mpirun`` (``horovod-mpi``), and under ``mpirun`` with
  ``HOROVOD_HIERARCHICAL_ALLREDUCE=1`` and ``HOROVOD_HIERARCHICAL_ALLGATHER=1``
  (``horovod-mpi-hierarchical``);
- hvd-compress: each scheme given, sparse ones through Horovod ``allgather`` and, with
  ``@ps`` after the spec, through a gRPC parameter server on its own host; with ``@gloo``
  after the spec, its dense rounds on a ``torch.distributed`` Gloo group instead of
  Horovod's collectives; with ``@host``, two-level (``hierarchy="host"``: dense inside a
  host, compressed across hosts).

Horovod-based systems run on Horovod's Gloo controller (ranks started on their hosts with
the environment ``horovodrun --gloo`` gives them, and Horovod's own rendezvous server), or
under ``mpirun`` with OpenMPI's ring all-reduce (hvd-compress with ``--controller mpi``;
stock Horovod as listed in ``--horovod-controllers``, both by default). Speed-ups against
Horovod are against the faster of its controllers on that link.

Time to accuracy trains digits at one rate: uncompressed stock Horovod (Gloo) first, for
``epochs`` epochs; it sets the target (its final accuracy minus one point) and the time
budget (its training seconds). Every other configuration trains at least ``epochs`` epochs
and goes on, while it has not reached the target, until it has used the same budget (at
most ``max_epochs``): time decides, not epochs, so a system with cheap steps may take more
of them. Each row holds the
median and 90th-percentile step time of the timed steps, the bytes each host's interface
sent per step on its link (host 0's ``eth0`` counters, headers included; what the ranks of
a host send each other goes over its loopback, counted apart), what the optimizer says it sent,
whether the replicas ended identical, and the speed-up against uncompressed Horovod and
against DDP with no hook on the same link, in the same run.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_compress.bench.cluster_rank import MODELS, PHASES, ROUNDS, p90, parameter_count
from hvd_compress.bench.hosts import (
    emulated_hosts,
    host_command,
    host_namespace,
    launcher_address,
    mpirun_host_args,
    rate_bits,
    require_root,
)
from hvd_compress.bench.launch import process_env, run_mpirun
from hvd_compress.bench.link import RING_ALLREDUCE
from hvd_compress.bench.report import Row

SERVER_SUFFIX = "@ps"
"""After a scheme spec: its sparse pairs go to a parameter server on a host of its own."""
GLOO_SUFFIX = "@gloo"
"""After a scheme spec: its dense rounds go on a ``torch.distributed`` Gloo group
(``collectives="gloo"``) instead of Horovod's collectives."""
HOST_SUFFIX = "@host"
"""After a scheme spec: two-level, the optimizer's ``hierarchy="host"`` (the ranks of a host
reduce dense over its loopback, the compressed exchange runs across hosts)."""
SUFFIXES = (GLOO_SUFFIX, SERVER_SUFFIX, HOST_SUFFIX)


def split_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """A ``bench cluster`` scheme spec's scheme and options: ``SPEC[@gloo][@ps][@host]``
    (the suffixes in any order)."""
    scheme, *flags = spec.split("@")
    unknown = sorted(set(flags) - {suffix[1:] for suffix in SUFFIXES})
    if unknown:
        raise ValueError(f"{spec!r}: unknown suffix(es) {unknown}; after a scheme come "
                         f"{', '.join(SUFFIXES)}")
    options: dict[str, Any] = {
        "server": SERVER_SUFFIX[1:] in flags,
        "collectives": "gloo" if GLOO_SUFFIX[1:] in flags else "horovod"}
    if HOST_SUFFIX[1:] in flags:
        options["hierarchy"] = "host"
    return scheme, options


def spec_label(scheme: str, settings: dict[str, Any]) -> str:
    """The row label of a scheme run with these settings (the inverse of :func:`split_spec`)."""
    label = scheme
    if settings.get("collectives", "horovod") != "horovod":
        label += GLOO_SUFFIX
    if settings.get("ps", "allgather") != "allgather":
        label += SERVER_SUFFIX
    if settings.get("hierarchy"):
        label += HOST_SUFFIX
    return label
DEFAULT_RATES = ("100mbit", "1gbit", "10gbit")
DEFAULT_SCHEMES = ("none", "fp16", "powersgd:rank=4,start_iter=2", "onebit",
                   "topk:ratio=0.001", "topk:ratio=0.001@ps",
                   "auto:powersgd:rank=4,start_iter=2")
DDP_SCHEMES = ("none", "fp16", "powersgd:rank=4,start_iter=2",
               "batched-powersgd:rank=4,start_iter=2")
DDP_FLOORS = ("rounds-powersgd:rank=4,start_iter=2",)
"""``--ddp`` configurations that are floors, not systems, run only when named: what the
collectives of our PowerSGD at rank 4 take with nothing computed
(:class:`~hvd_compress.bench.cluster_rank.RoundsOnly`). No target reads them."""
HOROVOD_SCHEMES = ("none", "fp16")
HIERARCHICAL = "mpi-hierarchical"
"""Stock Horovod's controller choice for ``mpirun`` with ``HOROVOD_HIERARCHICAL_ALLREDUCE``
and ``HOROVOD_HIERARCHICAL_ALLGATHER`` set (row ``horovod-mpi-hierarchical``). Horovod
0.28.1 built without NCCL has a hierarchical all-gather on MPI but no hierarchical
all-reduce on the CPU (only NCCL's): its all-reduce then stays OpenMPI's."""
HIERARCHICAL_ENV = {"HOROVOD_HIERARCHICAL_ALLREDUCE": "1", "HOROVOD_HIERARCHICAL_ALLGATHER": "1"}
HOROVOD_SYSTEMS = ("horovod", "horovod-mpi", f"horovod-{HIERARCHICAL}")
"""Stock Horovod's rows: on its Gloo controller, under ``mpirun``, and under ``mpirun``
with Horovod's hierarchical settings."""
OURS = "hvd-compress"
"""hvd-compress's rows: ``hvd-compress`` on Horovod's Gloo controller, ``hvd-compress-mpi``
under ``mpirun`` on its MPI controller (``controller="horovod"``), ``hvd-compress-mpi-gloo``
under ``mpirun`` with Horovod's Gloo controller (``controller="gloo"``, ``init()``'s
default there)."""
FLOOR = "floor"
"""The compute floor's row: the same model and ranks, no communication at all."""


def system_label(runs: str, controller: str | None) -> str:
    """A row's system: ``runs`` (stock ``horovod`` or ``hvd-compress``), with ``-mpi`` when
    its Horovod runs under ``mpirun``."""
    return runs if controller in (None, "gloo") else f"{runs}-{controller}"


def is_ours(row: Row) -> bool:
    return row["system"].startswith(OURS)


@dataclass
class Plan:
    """What one run of the benchmark measures."""

    ranks: int = 4
    """Worker hosts (``--hosts``, or ``--ranks`` as before hosts had several ranks)."""
    ranks_per_host: int = 1
    """Ranks on each worker host, sharing its namespace and its one link."""
    rates: Sequence[str] = DEFAULT_RATES
    latency_ms: float = 0.0
    models: Sequence[str] = ("mlp",)
    steps: int = 12
    warmup: int = 5
    schemes: Sequence[str] = DEFAULT_SCHEMES
    ddp: Sequence[str] = DDP_SCHEMES
    horovod: Sequence[str] = HOROVOD_SCHEMES
    horovod_controllers: Sequence[str] = ("gloo", "mpi")
    controllers: Sequence[str] = ("gloo",)
    floor: bool = True
    horovod_env: dict[str, str] = field(default_factory=dict)
    """More environment for every Horovod-based system (``--env KEY=VALUE``), to measure
    what a setting costs: ``OMPI_MCA_mpi_yield_when_idle=0`` undoes what
    :func:`hvd_compress.torch.init` sets under ``mpirun``."""
    cycle_time_ms: float | None = 10.0
    separate: bool = True
    bucket_mb: float | None = None
    accuracy_rate: str | None = "100mbit"
    epochs: int = 12
    max_epochs: int = 60
    hidden: int = 1024
    timeout: float = 1800
    repeats: int = 1
    pin_cores: bool = False
    progress: Callable[[str], None] = field(default=lambda text: None)

    @classmethod
    def quick(cls) -> Plan:
        """A tiny model on 2 hosts at 1 Gbit/s, 3 timed steps: checks the harness in
        seconds."""
        powersgd = "powersgd:rank=4,start_iter=2"
        return cls(ranks=2, rates=("1gbit",), models=("tiny",), steps=3, warmup=2,
                   schemes=("none", powersgd, "topk:ratio=0.01@ps", f"auto:{powersgd}"),
                   ddp=("none", powersgd), horovod=("none",), accuracy_rate="1gbit",
                   epochs=2, max_epochs=3, hidden=32)

    def systems(self) -> list[System]:
        """What runs, in order: stock Horovod first (time to accuracy takes its target and
        budget from it), then DDP, then hvd-compress."""
        ours = []
        for spec in self.schemes:
            scheme, options = split_spec(spec)
            ours.append({"scheme": scheme, **options, "bucket_mb": self.bucket_mb})
        horovod = [System(system_label("horovod", c), "horovod", c,
                          [{"scheme": s} for s in self.horovod])
                   for c in self.horovod_controllers]
        floor = [System(FLOOR, "local", None, [{"scheme": "none"}])] if self.floor else []
        systems = [*horovod, System("ddp", "ddp", None, [{"scheme": s} for s in self.ddp]),
                   *(System(system_label(OURS, c), OURS, c, ours) for c in self.controllers),
                   *floor]
        if self.separate:  # fresh processes for every configuration
            return [System(s.label, s.runs, s.controller, [c]) for s in systems
                    for c in s.configs]
        return [system for system in systems if system.configs]

    @property
    def world(self) -> int:
        """Every worker rank: hosts times ranks per host."""
        return self.ranks * self.ranks_per_host

    @property
    def needs_server(self) -> bool:
        return any(split_spec(spec)[1]["server"] for spec in self.schemes)


@dataclass
class System:
    """One launch's worth of configurations: the row label, the system the ranks run
    (:mod:`hvd_compress.bench.cluster_rank`'s ``--system``), and Horovod's controller."""

    label: str
    runs: str
    controller: str | None
    configs: list[dict[str, Any]]


class LaunchError(RuntimeError):
    """A system's ranks failed or overran the time limit; the message holds their output
    and Python stacks."""


def _run_direct(commands: list[list[str]], timeout: float, directory: Path,
                extra_env: dict[str, str] | None = None) -> None:
    """Start one process per command, each in its own session; wait for all. The first to
    fail, or the time limit, ends all the others; the error holds their output."""
    env = dict(process_env(), **(extra_env or {}))
    logs = [directory / f"rank{i}.log" for i in range(len(commands))]
    procs = []
    for command, log in zip(commands, logs):
        with log.open("wb") as sink:
            procs.append(subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                          stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True))
    give_up = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs)
                           if p.poll() is not None and p.returncode != 0), None)
            if failed is not None or time.monotonic() > give_up:
                break
            time.sleep(0.2)
        else:
            failed = next((i for i, p in enumerate(procs) if p.returncode != 0), None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed is None and all(p.returncode == 0 for p in procs):
        return
    what = f"rank {failed} exited with {procs[failed].returncode}" if failed is not None \
        else f"ranks still running after the time limit of {timeout:.0f} s"
    output = "".join(f"\n--- rank {i}:\n{log.read_text(errors='replace')[-4000:]}"
                     for i, log in enumerate(logs))
    raise LaunchError(f"{what}{output}{_stacks(directory)}")


def _rows(directory: Path) -> list[Row]:
    """The rows a launch wrote; :class:`LaunchError` with the tails of its logs and stacks
    when its processes all ended well but left no readable result (the directory, and
    with it the cause, is gone once the launch is reported)."""
    try:
        return json.loads((directory / "rows.json").read_text())
    except (OSError, ValueError) as exc:
        logs = "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-4000:]}"
                       for log in sorted(directory.glob("*.log")))
        raise LaunchError(f"the launch ended without a result ({exc}){logs}"
                          f"{_stacks(directory)}") from exc


def _stacks(directory: Path) -> str:
    return "".join(f"\n{path.stem}:\n{path.read_text()[-4000:]}"
                   for path in sorted(directory.glob("stacks-rank*.txt")) if path.stat().st_size)


def _rank_argv(system: System, plan: Plan, model: str, directory: Path, deadline: float,
               digits: Digits | None) -> list[str]:
    argv = [sys.executable, "-m", "hvd_compress.bench.cluster_rank", "--system", system.runs,
            "--configs", json.dumps(system.configs), "--model", model,
            "--steps", str(plan.steps), "--warmup", str(plan.warmup),
            "--digits-epochs", str(plan.epochs if digits else 0),
            "--digits-hidden", str(plan.hidden),
            "--out", str(directory / "rows.json"), "--progress", str(directory / "progress"),
            "--stacks-at", str(deadline), "--stacks-dir", str(directory)]
    if plan.pin_cores:
        argv.append("--pin-cores")
    if digits is not None and digits.budget_s is not None:
        argv += ["--digits-budget-s", str(digits.budget_s), "--digits-max-epochs",
                 str(plan.max_epochs)]
        if digits.target is not None:
            argv += ["--digits-target", str(digits.target)]
    return argv


@dataclass
class Digits:
    """A time-to-accuracy launch: the training-seconds budget and the target accuracy
    (``None`` for the run that sets them)."""

    budget_s: float | None = None
    target: float | None = None


def _launch(system: System, plan: Plan, model: str, addresses: list[str], directory: Path,
            port: int, digits: Digits | None) -> None:
    """Run one system's configurations of ``model`` on the worker hosts ``addresses``,
    ``plan.ranks_per_host`` ranks on each: ranks ``h L`` to ``h L + L - 1`` on host ``h``,
    as ``horovodrun -H a:L,b:L`` and ``mpirun --host a:L,b:L`` place them."""
    timeout = plan.timeout
    argv = _rank_argv(system, plan, model, directory, time.time() + timeout - 5, digits)
    per_host = plan.ranks_per_host
    n = len(addresses) * per_host
    horovod_env = horovod_settings(plan, system)

    def on_host(rank: int, env: dict[str, str]) -> list[str]:
        host = rank // per_host
        return host_command(host, argv, directory, addresses[host], env)

    if system.runs == "local":
        _run_direct([on_host(r, {"RANK": str(r), "WORLD_SIZE": str(n)}) for r in range(n)],
                    timeout, directory)
    elif system.runs == "ddp":
        commands = [on_host(r, {
            "MASTER_ADDR": addresses[0], "MASTER_PORT": str(port), "RANK": str(r),
            "WORLD_SIZE": str(n), "LOCAL_RANK": str(r % per_host),
            "LOCAL_WORLD_SIZE": str(per_host), "GLOO_SOCKET_IFNAME": "eth0"})
            for r in range(n)]
        _run_direct(commands, timeout, directory)
    elif system.controller == "gloo":
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
        from horovod.runner.http.http_server import RendezvousServer

        rendezvous = RendezvousServer()
        rendezvous_port = rendezvous.start()
        try:
            slots = get_host_assignments(
                parse_hosts(",".join(f"{a}:{per_host}" for a in addresses)), n)
            rendezvous.init(slots)
            common = create_run_env_vars(launcher_address(addresses), {"eth0"},
                                         rendezvous_port)
            commands = [on_host(slot.rank, {**common, **create_slot_env_vars(slot),
                                            **horovod_env})
                        for slot in slots]
            _run_direct(commands, timeout, directory)
        finally:
            rendezvous.stop()
    else:
        # The hosts' interface, for collectives="gloo" (its group finds no other address
        # under mpirun); Horovod's MPI controller does not read it.
        env = {**horovod_env, "GLOO_SOCKET_IFNAME": "eth0"}
        if system.runs == OURS:  # init()'s default would give mpirun's ranks Gloo's
            env.setdefault("HVD_COMPRESS_CONTROLLER",
                           "gloo" if system.controller == "mpi-gloo" else "horovod")
        if system.controller == HIERARCHICAL:
            env.update(HIERARCHICAL_ENV)
        exported = [arg for key, value in env.items() for arg in ("-x", f"{key}={value}")]
        code = run_mpirun([*mpirun_host_args(addresses, directory, per_host), *RING_ALLREDUCE,
                           *exported, *argv],
                          int(timeout), directory / "mpirun.log")
        if code != 0:
            raise LaunchError(f"mpirun exited with {code}:\n"
                              f"{(directory / 'mpirun.log').read_text()[-8000:]}"
                              f"{_stacks(directory)}")


def horovod_settings(plan: Plan, system: System | None = None) -> dict[str, str]:
    """Horovod's environment for every Horovod-based system of the plan (stock and ours
    alike): ``HOROVOD_CYCLE_TIME`` when the plan sets it (by default 10 ms, what
    :func:`hvd_compress.torch.init` sets; docs/benchmarks.md compares cycle times), and
    the plan's ``horovod_env``; for a launch of two-level configurations (``@host``),
    ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, which their process sets per host need."""
    cycle = {"HOROVOD_CYCLE_TIME": f"{plan.cycle_time_ms:g}"} if plan.cycle_time_ms else {}
    two_level = system is not None and any(c.get("hierarchy") for c in system.configs)
    dynamic = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1"} if two_level else {}
    return {**cycle, **dynamic, **plan.horovod_env}


def _servers(address: str, workers: Sequence[int], host: int) -> Any:
    """One parameter server per worker count on emulated host ``host`` (ports 7070 on):
    a flat job's ranks are its workers, a two-level job's hosts are."""
    from hvd_compress.bench.ps import ServerProcesses

    return ServerProcesses([["ps_server", "--bind", f"{address}:{7070 + i}", "--workers",
                             str(count), "--deadline", "600", "--max-message-mb", "512"]
                            for i, count in enumerate(workers)],
                           prefix=["ip", "netns", "exec", host_namespace(host)])


def server_workers(plan: Plan, config: dict[str, Any]) -> int:
    """The workers a configuration's server counts: the hosts with ``hierarchy="host"``
    (one push per host and slice), else every rank."""
    return plan.ranks if config.get("hierarchy") else plan.world


def measure_link(plan: Plan, rate: str, digits: bool = False) -> list[Row]:
    """Every system's rows on one link rate, for every model of the plan: step times, or
    with ``digits`` accuracy against training seconds on digits."""
    rows: list[Row] = []
    failed: list[Row] = []
    hosts = plan.ranks + (1 if plan.needs_server else 0)
    budget = Digits() if digits else None
    models = plan.models[:1] if digits else plan.models  # digits trains its own MLP
    sizes = {model: MODELS[model].parameters() for model in models}
    with emulated_hosts(hosts, rate, plan.latency_ms) as addresses:
        workers = addresses[:plan.ranks]
        counts = sorted({server_workers(plan, c) for s in plan.systems() for c in s.configs
                         if c.get("server")})
        servers = _servers(addresses[-1], counts, plan.ranks) if counts else None
        try:
            # Step times: per model, every configuration ``repeats`` times, in turn, so that
            # a slow spell of the shared machine falls on every system alike. Digits: once.
            systems = [s for s in plan.systems() if not (digits and s.runs == "local")]
            launches = [(model, system) for model in models
                        for system in systems * (1 if digits else plan.repeats)]
            for index, (model, system) in enumerate(launches):
                system = System(system.label, system.runs, system.controller,
                                [dict(c) for c in system.configs])
                for config in system.configs:
                    if config.pop("server", False):
                        assert servers is not None
                        address = servers.addresses[counts.index(server_workers(plan,
                                                                                config))]
                        config["ps"] = f"grpc://{address}"
                with tempfile.TemporaryDirectory(prefix="hvdc-cluster-") as tmp:
                    directory = Path(tmp)
                    plan.progress(f"[{rate}] {model} {system.label}: starting "
                                  f"{len(system.configs)} configuration(s) on {len(workers)} "
                                  f"hosts x {plan.ranks_per_host} ranks "
                                  f"(launch {index + 1} of {len(launches)})")
                    try:
                        _launch_with_progress(system, plan, model, workers, directory,
                                              29400 + index, rate, budget)
                        got = _rows(directory)
                    except LaunchError as failure:
                        # Reported with its cause; the other launches go on.
                        failed.append(failed_row(system, model, rate, failure))
                        plan.progress(f"[{rate}] {model} {system.label}: the launch failed: "
                                      f"{str(failure).splitlines()[0]}")
                        continue
                for row in got:
                    row.update(system=system.label, link=rate, link_bits=rate_bits(rate),
                               latency_ms=plan.latency_ms, ranks=plan.world,
                               hosts=plan.ranks, ranks_per_host=plan.ranks_per_host,
                               model="digits-mlp" if digits else model,
                               parameters=parameter_count((64, plan.hidden, plan.hidden, 10))
                               if digits else sizes[model],
                               controller=system.controller)
                    if system.runs in ("horovod", OURS):
                        row["settings"].update(horovod_settings(plan, system))
                    if system.controller == HIERARCHICAL:
                        row["settings"].update(HIERARCHICAL_ENV)
                    row["scheme"] = spec_label(row["scheme"], row.get("settings", {}))
                rows += got
                base = _accuracy_base(rows) if digits else None
                if base is not None and budget is not None and budget.budget_s is None:
                    budget = Digits(base["curve_s"][-1], base["final_accuracy"] - ACCURACY_SLACK)
        finally:
            if servers is not None:
                servers.close()
    if digits:
        add_time_to_target(rows)
    else:
        rows = pool_runs(rows)
        add_speedups(rows)
    return rows + failed


def failed_row(system: System, model: str, rate: str, failure: LaunchError) -> Row:
    """What a launch that failed leaves in the results: where, which configurations, and
    its cause (the ranks' last output and Python stacks)."""
    return {"task": "failed", "system": system.label, "model": model, "link": rate,
            "schemes": [c["scheme"] for c in system.configs], "cause": str(failure)}


MEAN_FIELDS = ("tx_bytes_per_step", "rx_bytes_per_step", "tx_packets_per_step",
               "tx_payload_bytes_per_step", "loopback_tx_bytes_per_step", "cpu_s_per_step",
               "payload_bytes", "dense_bytes", "collectives")
"""Per-step figures of a row that :func:`pool_runs` averages over the launches."""


def _mean_dict(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
    keys = dict.fromkeys(k for d in dicts for k in d)
    return {k: sum(d.get(k, 0.0) for d in dicts) / len(dicts) for k in keys}


def pool_runs(rows: Sequence[Row]) -> list[Row]:
    """One row per (system, scheme) from the rows of its launches (``Plan.repeats``): the
    timed steps of all of them (median and p90 over the pool), the per-step bytes, CPU
    and phases averaged, the replicas agreeing only if they did in every launch. A
    configuration launched once keeps its row as it is (plus ``runs: 1``)."""
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["system"], row["scheme"]), []).append(row)
    pooled = []
    for runs in groups.values():
        row = dict(runs[0])
        times = [t for r in runs for t in r["step_times_s"]]
        if all("step_phases_s" in r for r in runs):
            row["step_phases_s"] = [p for r in runs for p in r["step_phases_s"]]
        agree = [r["replicas_agree"] for r in runs]
        row.update(runs=len(runs), step_times_s=times, step_s=statistics.median(times),
                   step_p90_s=p90(times),
                   replicas_agree=None if None in agree else all(agree))
        if len(runs) > 1:
            row["run_step_s"] = [r["step_s"] for r in runs]
            for key in MEAN_FIELDS:
                if all(r.get(key) is not None for r in runs):
                    row[key] = sum(r[key] for r in runs) / len(runs)
            for key in ("phases_s", "exchange_s", "collective_bytes", "cpu_threads_s_per_step"):
                if all(key in r for r in runs):
                    row[key] = _mean_dict([r[key] for r in runs])
            if all("gc" in r for r in runs):
                row["gc"] = {
                    "collections": [sum(c) for c in zip(*(r["gc"]["collections"] for r in runs))],
                    "seconds": [sum(c) for c in zip(*(r["gc"]["seconds"] for r in runs))],
                    "per_step_s": [t for r in runs for t in r["gc"]["per_step_s"]]}
        pooled.append(row)
    return pooled


def spread(times: Sequence[float]) -> float:
    """Step-time spread: p90 over median."""
    return p90(times) / statistics.median(times)


def tail_excess(row: Row) -> dict[str, float] | None:
    """Where the slow steps lose their time: over the steps at or above the row's p90 (never
    none: the p90 is one of the steps, and the slowest steps may tie), the mean excess of
    each phase (:data:`PHASES`) over that phase's median, in seconds; None for a row
    without per-step phases."""
    phases = row.get("step_phases_s")
    times = row["step_times_s"]
    if not phases or len(phases) != len(times):
        return None
    medians = [statistics.median(p[i] for p in phases) for i in range(len(PHASES))]
    tail = [p for p, t in zip(phases, times) if t >= row["step_p90_s"]]
    return {name: sum(p[i] for p in tail) / len(tail) - medians[i]
            for i, name in enumerate(PHASES)}


def spread_difference_interval(ours: Sequence[float], theirs: Sequence[float],
                               resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of ``spread(ours) - spread(theirs)``: both samples of step
    times redrawn with replacement ``resamples`` times (a fixed seed: the same rows give
    the same interval). An interval holding 0 means the two spreads are not told apart
    by this many steps."""
    rng = random.Random(seed)
    diffs = sorted(spread(rng.choices(ours, k=len(ours)))
                   - spread(rng.choices(theirs, k=len(theirs))) for _ in range(resamples))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def _launch_with_progress(system: System, plan: Plan, model: str, workers: list[str],
                          directory: Path, port: int, rate: str, digits: Digits | None) -> None:
    """:func:`_launch` on a thread while this one relays rank 0's latest step."""
    import threading

    failure: list[BaseException] = []

    def target() -> None:
        try:
            _launch(system, plan, model, workers, directory, port, digits)
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    shown = ""
    while thread.is_alive():
        thread.join(1.0)
        progress = directory / "progress"
        text = progress.read_text() if progress.exists() else ""
        if text and text != shown:
            plan.progress(f"[{rate}] {model} {system.label}: {text}")
            shown = text
    if failure:
        raise failure[0]


SPEEDUP_SCHEMES = ("onebit", "powersgd", "topk")
"""The schemes whose speed-up at 100 Mbit/s has a target (8x Horovod, 4x DDP)."""

WIRE_FACTORS = {"dense": "allreduce", "fp16": "allreduce", "P": "allreduce",
                "Q": "allreduce", "values": "allreduce", "scatter": "alltoall",
                "gather": "allgather", "sparse": "allgather"}
"""How each round of hvd-compress travels (round names of :mod:`hvd_compress.schemes`)."""


def expected_tx_bytes(row: Row) -> float | None:
    """Bytes one host should send per step for what the optimizer handed its collectives:
    a ring all-reduce sends ``2 (n-1)/n`` of its buffer, an all-to-all ``(n-1)/n``, a ring
    all-gather ``n - 1`` times this rank's part; pairs pushed to a server once. ``None``
    with several ranks per host (what a host's link carries then depends on where each
    collective's ring crosses hosts)."""
    handed = row.get("collective_bytes")
    if not handed or row.get("ranks_per_host", 1) != 1:  # per rank, not per host link
        return None
    n = row["ranks"]
    factors = {"allreduce": 2 * (n - 1) / n, "alltoall": (n - 1) / n, "allgather": n - 1}
    server = row.get("settings", {}).get("ps", "allgather") != "allgather"
    total = 0.0
    for round_name, nbytes in handed.items():
        kind = WIRE_FACTORS.get(round_name)
        if kind is None:
            return None
        total += nbytes * (1.0 if server and round_name == "sparse" else factors[kind])
    return total


def add_speedups(rows: list[Row]) -> None:
    """``speedup``: uncompressed Horovod's step time (the faster of its controllers) over
    the row's, for the same model on the same link; ``speedup_vs_ddp``: the same against
    DDP with no hook; ``floor_s`` and ``cpu_over_floor_s``: the compute floor's step time,
    and the row's CPU seconds per step (every thread of the process) beyond the floor's:
    what the system's own exchange costs the CPU, its communication library included."""
    def base(systems: tuple[str, ...], row: Row) -> Row | None:
        same = [r for r in rows if r["system"] in systems and r["scheme"] == "none"
                and r["link"] == row["link"] and r["model"] == row["model"]]
        return min(same, key=lambda r: r["step_s"], default=None)

    for row in rows:
        horovod, ddp = base(HOROVOD_SYSTEMS, row), base(("ddp",), row)
        floor = base((FLOOR,), row)
        row["speedup"] = None if horovod is None else horovod["step_s"] / row["step_s"]
        row["speedup_vs_ddp"] = None if ddp is None else ddp["step_s"] / row["step_s"]
        row["floor_s"] = None if floor is None else floor["step_s"]
        row["cpu_over_floor_s"] = None if floor is None else \
            row["cpu_s_per_step"] - floor["cpu_s_per_step"]
        row["bytes_per_step"] = row["tx_bytes_per_step"]
        row["spread"] = row["step_p90_s"] / row["step_s"]
        row["tail_excess_s"] = tail_excess(row)
        expected = expected_tx_bytes(row)
        row["expected_tx_bytes"] = expected
        # TCP's payload, the interface's bytes less the headers of every packet: what the
        # processes sent, the optimizer's collectives and any traffic of their own (Horovod's
        # negotiation, gRPC's and HTTP/2's framing). The headers are reported beside it.
        payload = row.get("tx_payload_bytes_per_step")
        row["wire_ratio"] = None if not expected or payload is None else payload / expected
        row["header_share"] = None if payload is None else \
            1 - payload / max(row["bytes_per_step"], 1)


ACCURACY_SLACK = 0.01
"""The time-to-accuracy target: uncompressed Horovod's final test accuracy minus this."""


def _accuracy_base(rows: Sequence[Row]) -> Row | None:
    """The run that sets the time-to-accuracy target: uncompressed Horovod on Gloo, else
    the first uncompressed run."""
    return next((r for r in rows if r["system"] == "horovod" and r["scheme"] == "none"),
                next((r for r in rows if r["scheme"] == "none"), None))


def add_time_to_target(rows: list[Row]) -> None:
    """``target_accuracy``: :func:`_accuracy_base`'s final accuracy minus
    :data:`ACCURACY_SLACK`; ``time_to_target_s``: training seconds until the row's first
    evaluation at or above it (``None``: never)."""
    base = _accuracy_base(rows)
    for row in rows:
        target = None if base is None else base["final_accuracy"] - ACCURACY_SLACK
        row["target_accuracy"] = target
        row["time_to_target_s"] = None if target is None else next(
            (s for s, a in zip(row["curve_s"], row["curve_accuracy"]) if a >= target), None)


def run(plan: Plan) -> list[Row]:
    """Step times on every rate of the plan, then (``accuracy_rate``) time to accuracy on
    digits."""
    require_root("cluster")
    for rate in [*plan.rates, *filter(None, [plan.accuracy_rate])]:
        rate_bits(rate)
    rows: list[Row] = []
    for rate in plan.rates:
        rows += measure_link(plan, rate)
    if plan.accuracy_rate and plan.epochs:
        rows += measure_link(plan, plan.accuracy_rate, digits=True)
    return rows


def step_rows(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.get("task") not in ("digits", "failed")]


def failed_rows(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.get("task") == "failed"]


def accuracy_rows(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if r.get("task") == "digits"]


# Reporting ---------------------------------------------------------------------------------
def label(row: Row) -> str:
    return f"{row['system']} {row['scheme']}"


def hosts_text(row: Row) -> str:
    """``4 emulated hosts``, or ``2 emulated hosts x 2 ranks`` with several ranks per host."""
    per_host = row.get("ranks_per_host", 1)
    hosts = row.get("hosts", row["ranks"])
    return f"{hosts} emulated hosts" + (f" x {per_host} ranks" if per_host > 1 else "")


def markdown(rows: Sequence[Row]) -> str:
    """A table per model: one line per (system, scheme); per link, median step (p90),
    bytes per host, the speed-ups and the CPU time per step beyond the compute floor."""
    tables = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        links = list(dict.fromkeys(r["link"] for r in mine))
        keys = list(dict.fromkeys((r["system"], r["scheme"]) for r in mine))
        by = {(r["system"], r["scheme"], r["link"]): r for r in mine}
        about = MODELS[model].about if model in MODELS else model
        head = "| system | scheme | " + " | ".join(
            f"{link}: step s (p90) | {link}: MB sent/host/step | {link}: vs Horovod | "
            f"{link}: vs DDP | {link}: CPU ms/step over floor" for link in links) + " |"
        lines = [f"**{model}** ({mine[0]['parameters'] / 1e6:.2f} M parameters; {about})",
                 "", head, "|---|---|" + "---:|" * (5 * len(links))]
        for system, scheme in keys:
            cells = []
            for link in links:
                r = by.get((system, scheme, link))
                if r is None:
                    cells += ["–"] * 5
                    continue
                over = r.get("cpu_over_floor_s")
                cells += [f"{r['step_s']:.3f} ({r['step_p90_s']:.3f})",
                          f"{r['bytes_per_step'] / 1e6:.2f}",
                          "–" if r["speedup"] is None else f"{r['speedup']:.1f}×",
                          "–" if r["speedup_vs_ddp"] is None else f"{r['speedup_vs_ddp']:.1f}×",
                          "–" if over is None or system == FLOOR else f"{1000 * over:.0f}"]
            lines.append(f"| {system} | `{scheme}` | " + " | ".join(cells) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


HOOK_RATIO = 0.9
"""Our PowerSGD's target step time against DDP's ``powerSGD_hook`` at the same rank."""
NO_SLOWER = ("onebit", "topk")
"""Our schemes whose target is a step no slower than DDP's ``powerSGD_hook``."""


def _step(rows: Sequence[Row], model: str, link: str, system: str, scheme: str
          ) -> Row | None:
    return next((r for r in rows if r["model"] == model and r["link"] == link
                 and r["system"] == system and r["scheme"] == scheme), None)


def sends_as_hook(spec: str, hook: str) -> bool:
    """Whether our scheme ``spec`` is PowerSGD sending the bytes per step of the hook's
    ``hook`` (a ``powersgd:...`` spec): the same rank and start, or ``alternate=True`` at
    twice the rank."""
    from hvd_compress import Compression
    from hvd_compress.schemes.powersgd import PowerSGD

    if not spec.startswith("powersgd"):
        return False
    ours, theirs = Compression.parse(spec), Compression.parse(hook)
    assert isinstance(ours, PowerSGD) and isinstance(theirs, PowerSGD)
    rank = 2 * theirs.rank if ours.alternate else theirs.rank
    return (ours.rank, ours.start_iter, ours.warm_start) == (rank, theirs.start_iter,
                                                             theirs.warm_start)


def _hook_targets(rows: Sequence[Row], model: str, link: str) -> list[str]:
    """Per launcher of ours: PowerSGD, on the faster of its routes (Horovod's collectives or
    ``@gloo``), at most :data:`HOOK_RATIO` of DDP's hook; 1-bit and top-k, each on the faster
    of its routes too, no slower than the hook; at <= 100 Mbit/s PowerSGD within 2x the
    compute floor plus its bytes' time."""
    lines = []
    hooks = [r for r in rows if r["model"] == model and r["link"] == link
             and r["system"] == "ddp" and r["scheme"].startswith("powersgd")]
    for hook in hooks:
        for system in dict.fromkeys(r["system"] for r in rows if is_ours(r)):
            mine = [r for r in rows if r["model"] == model and r["link"] == link
                    and r["system"] == system]
            # Our PowerSGD at the hook's settings, and alternate=True at twice the rank
            # (the same bytes per step), each on the faster of its routes.
            variants: dict[str, list[Row]] = {}
            for r in mine:
                spec = split_spec(r["scheme"])[0]
                if sends_as_hook(spec, hook["scheme"]):
                    variants.setdefault(spec, []).append(r)
            for routes in variants.values():
                best = min(routes, key=lambda r: r["step_s"])
                ok = best["step_s"] <= HOOK_RATIO * hook["step_s"]
                lines.append(f"{'PASS' if ok else 'FAIL'}  {model} {link}: {label(best)} "
                             f"{best['step_s']:.3f} s <= {HOOK_RATIO} x DDP "
                             f"{hook['scheme']} hook {hook['step_s']:.3f} s "
                             f"({best['step_s'] / hook['step_s']:.2f} x)")
            # 1-bit and top-k, each (with its options, server and hierarchy) on the
            # faster of its routes, as PowerSGD above.
            others: dict[tuple[str, bool, bool], list[Row]] = {}
            for r in mine:
                spec, options = split_spec(r["scheme"])
                if spec.split(":")[0] in NO_SLOWER:
                    key = (spec, options["server"], "hierarchy" in options)
                    others.setdefault(key, []).append(r)
            for routes in others.values():
                best = min(routes, key=lambda r: r["step_s"])
                ok = best["step_s"] <= hook["step_s"]
                lines.append(f"{'PASS' if ok else 'FAIL'}  {model} {link}: {label(best)} "
                             f"{best['step_s']:.3f} s <= DDP powerSGD_hook "
                             f"{hook['step_s']:.3f} s")
    for r in rows:
        if r["model"] != model or r["link"] != link or not is_ours(r) \
                or not r["scheme"].startswith("powersgd") or rate_bits(link) > 1e8:
            continue
        if r.get("floor_s") is not None and r.get("expected_tx_bytes"):
            limit = 2 * (r["floor_s"] + 8 * r["expected_tx_bytes"] / r["link_bits"])
            ok = r["step_s"] <= limit
            lines.append(f"{'PASS' if ok else 'FAIL'}  {model} {link}: {label(r)} "
                         f"{r['step_s']:.3f} s <= 2 x (compute floor {r['floor_s']:.3f} s + "
                         f"its bytes' time on the link) = {limit:.3f} s")
    return lines


TWO_LEVEL_SPEEDUP = 1.6
"""Two-level PowerSGD's and 1-bit's target at <= 100 Mbit/s: this many times faster per step
than the same scheme flat."""
TWO_LEVEL_BYTES = 0.55
"""... while their host link carries at most this share of the flat route's bytes per step."""


def _two_level_targets(rows: Sequence[Row], model: str, link: str) -> list[str]:
    """With several ranks per host: every ``SPEC@host`` row of ours against ``SPEC`` flat
    (PowerSGD and 1-bit at <= 100 Mbit/s: :data:`TWO_LEVEL_SPEEDUP` faster, at most
    :data:`TWO_LEVEL_BYTES` of the host-link bytes), and two-level ``none`` no slower than
    stock Horovod's hierarchical all-reduce."""
    lines = []
    here = [r for r in rows if r["model"] == model and r["link"] == link
            and r.get("ranks_per_host", 1) > 1]
    where = f"{model} {link}"
    hierarchical = _step(here, model, link, f"horovod-{HIERARCHICAL}", "none")
    for r in here:
        if not is_ours(r) or not r["scheme"].endswith(HOST_SUFFIX):
            continue
        flat = _step(here, model, link, r["system"], r["scheme"].removesuffix(HOST_SUFFIX))
        kind = r["scheme"].split(":")[0].split("@")[0]
        if flat is not None and kind in ("powersgd", "onebit") and rate_bits(link) <= 1e8:
            speedup = flat["step_s"] / r["step_s"]
            share = r["bytes_per_step"] / max(flat["bytes_per_step"], 1)
            lines.append(f"{'PASS' if speedup >= TWO_LEVEL_SPEEDUP else 'FAIL'}  {where}: "
                         f"{label(r)} {r['step_s']:.3f} s, {speedup:.2f}x faster than flat "
                         f"{flat['step_s']:.3f} s (target {TWO_LEVEL_SPEEDUP}x)")
            lines.append(f"{'PASS' if share <= TWO_LEVEL_BYTES else 'FAIL'}  {where}: "
                         f"{label(r)} host link {r['bytes_per_step'] / 1e6:.3f} MB/step = "
                         f"{share:.2f} x flat's {flat['bytes_per_step'] / 1e6:.3f} MB "
                         f"(target <= {TWO_LEVEL_BYTES})")
        if kind == "none" and hierarchical is not None:
            ok = r["step_s"] <= hierarchical["step_s"]
            lines.append(f"{'PASS' if ok else 'FAIL'}  {where}: {label(r)} {r['step_s']:.3f} s "
                         f"<= stock Horovod hierarchical all-reduce "
                         f"{hierarchical['step_s']:.3f} s")
    return lines


def targets(rows: Sequence[Row]) -> list[str]:
    """PASS/FAIL lines for the goals that compare rows of this run (never enforced), per
    model and link."""
    lines = []
    for model, link in dict.fromkeys((r["model"], r["link"]) for r in rows):
        here = [r for r in rows if r["model"] == model and r["link"] == link]
        where = f"{model} {link}"
        lines += _hook_targets(rows, model, link)
        lines += _two_level_targets(rows, model, link)
        for r in here:
            if not is_ours(r):
                continue
            scheme = split_spec(r["scheme"])[0]  # DDP's rows carry no suffix
            if r["scheme"].split(":")[0] in SPEEDUP_SCHEMES and rate_bits(link) <= 1e8:
                for key, peer, goal in (("speedup", "uncompressed Horovod", 8),
                                        ("speedup_vs_ddp", "DDP with no hook", 4)):
                    if r[key] is not None:
                        ok = r[key] >= goal
                        lines.append(f"{'PASS' if ok else 'FAIL'}  {where}: {label(r)} "
                                     f"{r[key]:.1f}x vs {peer} (target {goal}x)")
            hook = _step(rows, model, link, "ddp", scheme)
            if scheme.startswith("powersgd") and hook is not None:
                ok = r["spread"] <= hook["spread"]
                low, high = spread_difference_interval(r["step_times_s"],
                                                       hook["step_times_s"])
                told = "not told apart" if low <= 0 <= high else "told apart"
                difference = r["spread"] - hook["spread"]
                counts = f"{len(r['step_times_s'])} and {len(hook['step_times_s'])}"
                lines.append(f"{'PASS' if ok else 'FAIL'}  {where}: {label(r)} spread "
                             f"(p90/median) {r['spread']:.2f} <= DDP powerSGD_hook's "
                             f"{hook['spread']:.2f} (difference {difference:+.2f}, "
                             f"95% interval {low:+.2f} to {high:+.2f}: {told}, "
                             f"{counts} steps)")
            if r.get("wire_ratio") is not None:
                ok = abs(r["wire_ratio"] - 1) <= 0.1
                lines.append(f"{'PASS' if ok else 'FAIL'}  {where}: {label(r)} TCP payload "
                             f"sent {r['tx_payload_bytes_per_step'] / 1e6:.3f} MB = "
                             f"{r['wire_ratio']:.3f} x what its collectives should send "
                             f"(target within 10%; with the packets' headers "
                             f"{r['bytes_per_step'] / 1e6:.3f} MB, "
                             f"{100 * r['header_share']:.1f}% headers)")
            if r["scheme"].startswith("auto:"):
                inner = r["scheme"].removeprefix("auto:")
                peers = {s: _step(rows, model, link, r["system"], s)
                         for s in ("none", "fp16", inner)}
                known = {s: p["step_s"] for s, p in peers.items() if p is not None}
                if known:
                    best = min(known, key=known.__getitem__)
                    ok = r["step_s"] <= 1.05 * known[best]
                    lines.append(f"{'PASS' if ok else 'FAIL'}  {where}: {label(r)} "
                                 f"{r['step_s']:.3f} s <= 1.05 x the best of "
                                 f"{', '.join(known)} ({best} {known[best]:.3f} s)")
        ours = _step(rows, model, link, OURS, "none")
        ddp = _step(rows, model, link, "ddp", "none")
        if ours is not None and ddp is not None and rate_bits(link) >= 1e10:
            ok = ours["step_s"] <= 1.25 * ddp["step_s"]
            lines.append(f"{'PASS' if ok else 'FAIL'}  {where}: hvd-compress none "
                         f"{ours['step_s']:.3f} s <= 1.25 x DDP no hook {ddp['step_s']:.3f} s")
    for r in rows:
        if r["replicas_agree"] is False:
            lines.append(f"FAIL  {r['model']} {r['link']}: {label(r)}: replicas differ after "
                         "training")
    return lines


STYLES = {"ddp": "--", "horovod": ":", "horovod-mpi": "-.", "hvd-compress": "-",
          "hvd-compress-mpi": "-", FLOOR: ":"}
"""Line style of each system in the plots."""


@contextmanager
def _figure(path: Path, title: str) -> Iterator[Any]:
    """A matplotlib axes to draw on, then saved to ``path`` as a PNG with ``title``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    try:
        yield ax
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def plot_steps(rows: Sequence[Row], path: Path) -> None:
    """Step time against link rate, one line per (system, scheme), log-log."""
    first = rows[0]
    models = list(dict.fromkeys(r["model"] for r in rows))
    title = (f"{hosts_text(first)}, {first['model']} "
             f"({first['parameters'] / 1e6:.1f} M parameters)" if len(models) == 1
             else f"{hosts_text(first)}, {', '.join(models)}")
    with _figure(path, title) as ax:
        for model, system, scheme in dict.fromkeys((r["model"], r["system"], r["scheme"])
                                                   for r in rows):
            mine = sorted((r for r in rows if r["model"] == model and r["system"] == system
                           and r["scheme"] == scheme), key=lambda r: r["link_bits"])
            name = f"{system} {scheme}" if len(models) == 1 else f"{model}: {system} {scheme}"
            ax.plot([r["link_bits"] / 1e6 for r in mine], [r["step_s"] for r in mine],
                    STYLES.get(system, "-"), marker="o", label=name)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate, Mbit/s")
        ax.set_ylabel("median step time, s")


def accuracy_markdown(rows: Sequence[Row]) -> str:
    """One line per (system, scheme): final accuracy and seconds to the target."""
    lines = ["| system | scheme | final test accuracy | seconds to target | epochs |",
             "|---|---|---:|---:|---:|"]
    for r in rows:
        reached = "never" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"| {r['system']} | `{r['scheme']}` | {100 * r['final_accuracy']:.2f}% "
                     f"| {reached} | {r['epochs']} |")
    return "\n".join(lines)


def accuracy_targets(rows: Sequence[Row]) -> list[str]:
    """Every compressed scheme of ours reaches the target before uncompressed Horovod does
    (the faster of its controllers)."""
    reached = [r for r in rows if r["system"] in HOROVOD_SYSTEMS and r["scheme"] == "none"
               and r["time_to_target_s"] is not None]
    base = min(reached, key=lambda r: r["time_to_target_s"], default=None)
    if base is None:
        return []
    lines = [f"FAIL  {r['link']} digits: {label(r)}: replicas differ after training"
             for r in rows if not r["replicas_agree"]]
    for r in rows:
        if is_ours(r) and r["scheme"] != "none":
            got = r["time_to_target_s"]
            ok = got is not None and got < base["time_to_target_s"]
            shown = "never" if got is None else f"{got:.1f} s"
            lines.append(f"{'PASS' if ok else 'FAIL'}  {r['link']} digits: {label(r)} reaches "
                         f"{100 * r['target_accuracy']:.2f}% in {shown}, before uncompressed "
                         f"{base['system']} ({base['time_to_target_s']:.1f} s)")
    return lines


def plot_accuracy(rows: Sequence[Row], path: Path) -> None:
    """Test accuracy against training seconds, one line per (system, scheme)."""
    first = rows[0]
    title = (f"digits, {hosts_text(first)} at {first['link']}, MLP "
             f"64-{first['hidden']}-{first['hidden']}-10")
    with _figure(path, title) as ax:
        for r in rows:
            ax.plot(r["curve_s"], [100 * a for a in r["curve_accuracy"]],
                    STYLES.get(r["system"], "-"), marker=".", label=label(r))
        if first.get("target_accuracy") is not None:
            ax.axhline(100 * first["target_accuracy"], color="grey", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("training seconds (log)")
        ax.set_ylabel("test accuracy, %")
        # From 15 points under the lowest final accuracy: the early epochs are off-scale.
        ax.set_ylim(max(0.0, 100 * min(r["final_accuracy"] for r in rows) - 15), 100)


def host_bytes_markdown(rows: Sequence[Row]) -> str:
    """With several ranks per host: per (system, scheme) and link, the bytes host 0 sent
    per step on its link and, apart, over its loopback (between its own ranks), and the
    link's bytes against the same scheme flat (for a ``@host`` row)."""
    lines = ["| system | scheme | link | host link MB/step | loopback MB/step | "
             "link bytes vs flat |", "|---|---|---|---:|---:|---:|"]
    for r in rows:
        flat = _step(rows, r["model"], r["link"], r["system"],
                     r["scheme"].removesuffix(HOST_SUFFIX)) \
            if r["scheme"].endswith(HOST_SUFFIX) else None
        share = "–" if flat is None else \
            f"{r['bytes_per_step'] / max(flat['bytes_per_step'], 1):.2f}"
        loopback = r.get("loopback_tx_bytes_per_step")
        lines.append(f"| {r['system']} | `{r['scheme']}` | {r['link']} | "
                     f"{r['bytes_per_step'] / 1e6:.3f} | "
                     f"{'–' if loopback is None else f'{loopback / 1e6:.3f}'} | {share} |")
    return "\n".join(lines)


def rounds_floor_lines(rows: Sequence[Row]) -> list[str]:
    """For each model and link with a ``rounds-powersgd`` floor row (:data:`DDP_FLOORS`):
    the floor's step against DDP's hook at the same settings, the step it leaves our
    PowerSGD under :data:`HOOK_RATIO` of the hook, and what each of our PowerSGD rows at
    those settings spends over it (its arithmetic and bookkeeping on the ranks' cores)."""
    lines = []
    for floor in rows:
        if floor["system"] != "ddp" or not floor["scheme"].startswith(ROUNDS):
            continue
        model, link = floor["model"], floor["link"]
        hook_spec = floor["scheme"].removeprefix(ROUNDS)
        hook = _step(rows, model, link, "ddp", hook_spec)
        if hook is None:
            continue
        budget = HOOK_RATIO * hook["step_s"] - floor["step_s"]
        ours = [f"{r['system']} {r['scheme']} {r['step_s']:.3f} s, "
                f"{1000 * (r['step_s'] - floor['step_s']):.1f} ms over them"
                for r in rows if r["model"] == model and r["link"] == link
                and r["system"].startswith("hvd-compress")
                and split_spec(r["scheme"])[0] == hook_spec]
        lines.append(f"- {model} {link}: rounds alone {floor['step_s']:.3f} s, "
                     f"{floor['step_s'] / hook['step_s']:.2f} x the hook's "
                     f"{hook['step_s']:.3f} s; at {HOOK_RATIO:g} x the hook ours may spend "
                     f"{1000 * budget:.1f} ms over them" + "".join(f"; {o}" for o in ours))
    return lines


def launch_lines(rows: Sequence[Row]) -> list[str]:
    """For each model and link launched several times (``Plan.repeats``): each of our
    PowerSGD rows at the hook's settings (``alternate`` at twice the rank too), 1-bit and
    top-k rows over DDP's ``powerSGD_hook``, launch by launch, with how many launches met
    the row's target (:data:`HOOK_RATIO` for PowerSGD, 1 for the others). Launches are
    taken in turn, all systems then all again, so the i-th of each ran side by side. The
    targets read the pooled rows; these lines say how far one launch can move them."""
    lines = []
    for hook in rows:
        if hook["system"] != "ddp" or not hook["scheme"].startswith("powersgd") \
                or len(hook.get("run_step_s", ())) < 2:
            continue
        model, link, runs = hook["model"], hook["link"], hook["run_step_s"]
        for r in rows:
            spec = split_spec(r["scheme"])[0]
            if r["model"] != model or r["link"] != link or not is_ours(r) \
                    or len(r.get("run_step_s", ())) != len(runs):
                continue
            if sends_as_hook(spec, hook["scheme"]):
                goal = HOOK_RATIO
            elif spec.split(":")[0] in NO_SLOWER:
                goal = 1.0
            else:
                continue
            ratios = [mine / theirs for mine, theirs in zip(r["run_step_s"], runs, strict=True)]
            met = sum(ratio <= goal for ratio in ratios)
            lines.append(f"- {model} {link}: {label(r)} over DDP {hook['scheme']} hook: "
                         + ", ".join(f"{ratio:.3f}" for ratio in ratios)
                         + f"; mean {statistics.mean(ratios):.3f} (SD "
                         f"{statistics.stdev(ratios):.3f}); at most {goal:g} in {met} of "
                         f"{len(ratios)} launches")
    return lines


def summary(rows: Sequence[Row]) -> str:
    steps, accuracy = step_rows(rows), accuracy_rows(rows)
    measured = steps + accuracy
    out = [markdown(steps), "", "Settings:"] if steps else ["Settings:"]
    if any(r.get("ranks_per_host", 1) > 1 for r in steps):
        out[1:1] = ["", f"Bytes per step of host 0 ({hosts_text(steps[0])}; interface "
                    "counters, headers included):", "", host_bytes_markdown(steps)]
    for system, scheme in dict.fromkeys((r["system"], r["scheme"]) for r in measured):
        r = next(r for r in measured if r["system"] == system and r["scheme"] == scheme)
        extra = f", controller {r['controller']}" if r.get("controller") else ""
        out.append(f"- {system} {scheme}: {json.dumps(r['settings'])}{extra}")
    if accuracy:
        first = accuracy[0]
        out += ["", f"Time to accuracy on digits at {first['link']} (target: uncompressed "
                f"Horovod's final accuracy minus {100 * ACCURACY_SLACK:g} point):", "",
                accuracy_markdown(accuracy)]
    lines = targets(steps) + accuracy_targets(accuracy)
    if lines:
        out += ["", "Targets:", *lines]
    for r in failed_rows(rows):
        out += ["", f"FAILED LAUNCH  {r['model']} {r['link']}: {r['system']} "
                f"{', '.join(r['schemes'])}:", r["cause"][-3000:]]
    if steps:
        spreads = [f"{r['model']} {label(r)} @ {r['link']}: {r['spread']:.2f}" for r in steps]
        out += ["", "Spread (p90 / median): " + "; ".join(spreads)]
        tails = [f"- {r['model']} {label(r)} @ {r['link']}: " + ", ".join(
            f"{name} {1000 * excess:+.1f} ms" for name, excess in r["tail_excess_s"].items())
            for r in steps if r.get("tail_excess_s")]
        if tails:
            out += ["", "Steps slower than p90, mean excess of each phase over its median:",
                    *tails]
        floors = rounds_floor_lines(steps)
        if floors:
            out += ["", "Step over PowerSGD's rounds alone (rounds-powersgd):", *floors]
        launches = launch_lines(steps)
        if launches:
            out += ["", "Over the hook launch by launch (the targets read the pooled rows):",
                    *launches]
    return "\n".join(out)

