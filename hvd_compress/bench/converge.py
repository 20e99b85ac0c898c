"""``bench converge``: does each scheme, at its recommended settings, train as well as no
compression? Held-out loss and accuracy against steps and bytes, on 2 ranks.

Two tasks, every configuration trained with the same seed, the same batches and the same
number of steps as the uncompressed run of its task (:mod:`hvd_compress.bench.converge_rank`
runs them all, one after the other, in one ``horovodrun --gloo`` launch on localhost):

- ``lm``: a character-level transformer (2 pre-norm layers, width 128, 4 heads, context 64;
  431 K parameters) on the English text of CPython's ``pydoc_data.topics``, AdamW with a
  linear warm-up and a cosine decay; the score is the mean cross-entropy (nats per
  character) over the whole held-out last tenth of the text. Every scheme goes through
  ``hvd_compress.torch.DistributedOptimizer(..., compression=Compression.parse(spec))``;
  1-bit Adam is ``hvd_compress.torch.OneBitAdam``.
- ``digits``: scikit-learn's digits, the ``64-128-128-10`` MLP, SGD with momentum 0.9 (DGC
  and Signum carry the momentum themselves and run SGD without it); the score is the test
  accuracy on the fixed 20% split.

Top-k also goes through a real parameter server (rows ``topk-server-union`` and
``topk-server-topk``, the ``topk`` row's scheme and optimizer): :func:`run` starts one
``python -m ps_server`` per such row on localhost (a free port, ``--workers 2``, its
``--mode``, a checkpoint directory in the run's temporary directory), the ranks reach it
with ``DistributedOptimizer(..., ps="grpc://127.0.0.1:PORT")``, and every server is stopped
when the launch ends, failed or not. Those rows also carry the frame bytes the server
received and sent per step and rank (its totals at exit, headers included): in ``union``
mode a worker pulls the sum over the union of every worker's indices, in ``topk`` mode the
server's global top-k of ``k`` pairs with the rest in its residual
(``docs/parameter-server.md#choosing-the-mode``).

Each row holds the final held-out loss and accuracy, the gap to the uncompressed run of its
task (the loss's relative gap in %, the accuracy's in points), the bytes per step each rank
sent as its optimizer's compression statistics count them (``payload_bytes``; over all
steps, and after the configuration's warm-up: PowerSGD's and 1-bit's ``start_iter``,
1-bit Adam's ``freeze_step``), their ratio to float32 (``dense_bytes``), the held-out curve
and whether the replicas ended bit-identical. Targets (:func:`targets`, reported, never
enforced): on ``lm`` every configuration within 2% of the uncompressed loss, 1-bit Adam
within 1% at 16x or more fewer bytes per step after its warm-up; on ``digits`` within 1
accuracy point.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hvd_compress.bench.launch import ROOT, process_env

Row = dict[str, Any]


@dataclass(frozen=True)
class Config:
    """One trained configuration: its row label, its task, the scheme's spec
    (:meth:`hvd_compress.Compression.parse`; ``None`` for 1-bit Adam, which is an
    optimizer), the optimizer's options over the task's defaults (``kind`` ``adamw``,
    ``sgd`` or ``onebit_adam``), the :class:`~hvd_compress.Policy` options, and the steps
    before compression starts (excluded from "bytes after warm-up")."""

    task: str
    name: str
    scheme: str | None
    optimizer: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 0
    ps_mode: str | None = None
    """``None``: the collectives' route; a server mode (``ps_server.store.MODES``): the
    sparse pairs go through a parameter server of that ``--mode`` started for this
    configuration."""


PS_MODES = ("union", "topk", "gtopk")
"""The server modes of the ``topk-server-<mode>`` rows by default (``ps_server.store.MODES``)."""


def server_configs(topk: Config, modes: Sequence[str]) -> list[Config]:
    """``topk``'s scheme and optimizer through a parameter server in each of ``modes``."""
    return [replace(topk, name=f"topk-server-{mode}", ps_mode=mode) for mode in modes]


LM_OPTIMIZER = {"kind": "adamw", "lr": 3e-3}
"""AdamW for the language model (its other options at PyTorch's defaults: betas (0.9,
0.999), eps 1e-8, weight decay 0.01); the schedule (:data:`LM_TASK`) warms it up and
decays it."""
DIGITS_OPTIMIZER = {"kind": "sgd", "lr": 0.1, "momentum": 0.9}
"""SGD with heavy momentum for digits, what a new user brings."""
ALL_TENSORS = {"min_numel": 1, "compress_1d": True}
"""A policy that compresses every tensor (the vote's step is ``lr * sign``, so a tensor
left dense would step by ``lr * gradient`` instead)."""

LM_TASK = {"steps": 400, "batch": 16, "context": 64, "d": 128, "layers": 2,
           "eval_every": 25, "lr_warmup": 20, "lr_final": 0.1}
"""Language-model steps (per-rank batch of 16 windows of 64 characters), the evaluation
interval, and the schedule: linear warm-up for 20 steps, cosine down to 0.1 of the peak."""
DIGITS_TASK = {"steps": 600, "batch": 32, "eval_every": 50, "lr_warmup": 0, "lr_final": 0.1}
"""Digits steps (per-rank batch 32, about 27 epochs of the 1437 training images on 2
ranks), the evaluation interval, and the schedule: cosine from the peak down to 0.1."""


def recommended(task: str, steps: int, ps_modes: Sequence[str] = PS_MODES) -> list[Config]:
    """Every scheme of ``task`` at its recommended settings for a run of ``steps`` steps,
    uncompressed first (the reference of the gaps); the ``topk`` row also through a
    parameter server in each of ``ps_modes``."""
    if task == "lm":
        opt = LM_OPTIMIZER
        start = max(steps // 10, 1)  # PowerSGD's and 1-bit's warm-up: 10% uncompressed
        freeze = max(3 * steps // 10, 1)  # 1-bit Adam: 30% of the run in plain Adam
        # Error feedback under Adam: a coordinate that travels every T steps arrives with
        # the sum of T gradients, so Adam's second moment grows about T-fold and its step
        # shrinks by sqrt(T). The learning rate of a sparsifier sending a fraction `ratio`
        # is scaled by 1/sqrt(ratio). Unbiased noise (TernGrad without error feedback)
        # inflates the second moment too: twice the lr. PowerSGD: rank 16 at 1.5 times
        # the lr. The tuning runs behind these settings are in docs/benchmarks.md.
        sparse = {**opt, "lr": round(opt["lr"] / 0.1 ** 0.5, 4)}
        scaled = {**opt, "lr": 1.5 * opt["lr"]}
        doubled = {**opt, "lr": 2 * opt["lr"]}
        powersgd = f"powersgd:rank=16,start_iter={start}"
        return [
            Config(task, "none", "none", opt),
            Config(task, "fp16", "fp16", opt),
            Config(task, "bf16", "bf16", opt),
            Config(task, "powersgd", powersgd, scaled, warmup_steps=start),
            # One round and one side per step (PowerSGD's alternate=True), at twice the
            # rank: the same bytes per step as the row above, in one round instead of two.
            Config(task, "powersgd-alternate",
                   f"powersgd:rank=32,start_iter={start},alternate=True", scaled,
                   warmup_steps=start),
            # 1-bit: its dense warm-up (start_iter, 10% of the steps, as PowerSGD's) lets
            # Adam's second moment start from exact gradients; small buckets at 3 times
            # the lr (OneBit.trains_under_adam).
            Config(task, "onebit", f"onebit:bucket_size=32,start_iter={start}",
                   {**opt, "lr": 3 * opt["lr"]}, warmup_steps=start),
            # LoCo's moving-average residual (beta 0.8, DeepSpeed's) against the plain one.
            Config(task, "onebit-loco", f"onebit:bucket_size=32,start_iter={start},"
                   "loco_beta=0.8", {**opt, "lr": 3 * opt["lr"]}, warmup_steps=start),
            Config(task, "qsgd", "qsgd:bits=8", opt),
            Config(task, "terngrad", "terngrad", doubled),
            Config(task, "topk", "topk:ratio=0.1", sparse),
            Config(task, "topk-loco", "topk:ratio=0.1,loco_beta=0.8", sparse),
            *server_configs(Config(task, "topk", "topk:ratio=0.1", sparse), ps_modes),
            Config(task, "dgc", "dgc:ratio=0.1,momentum=0.0", sparse),
            # Random-k without error feedback, at the sparsifiers' lr / sqrt(ratio) (Adam's
            # moments both shrink by the ratio, its step by sqrt(ratio);
            # RandomK.trains_under_adam).
            Config(task, "randomk", "randomk:ratio=0.3,error_feedback=False",
                   {**opt, "lr": round(opt["lr"] / 0.3 ** 0.5, 4)}),
            Config(task, "signum", "vote:momentum=0.9",
                   {"kind": "sgd", "lr": 2e-3, "momentum": 0.0}, ALL_TENSORS),
            # Routes the large matrices to PowerSGD, so PowerSGD's learning rate.
            Config(task, "auto", f"auto:{powersgd}", scaled, warmup_steps=start),
            Config(task, "onebit-adam", None,
                   {"kind": "onebit_adam", "lr": opt["lr"], "freeze_step": freeze},
                   warmup_steps=freeze),
            # 0/1 Adam at 1-bit Adam's freeze and lr; rounds of 1, 2, then 4 steps after it.
            Config(task, "zero-one-adam", None,
                   {"kind": "zero_one_adam", "lr": opt["lr"], "var_freeze_step": freeze,
                    "local_step_scaler": steps // 10, "local_step_clipper": 4},
                   warmup_steps=freeze),
        ]
    if task == "digits":
        opt = DIGITS_OPTIMIZER
        no_momentum = {**opt, "momentum": 0.0}
        # 1-bit and random-k: momentum 0.8, as their construction warning advises.
        lighter = {**opt, "momentum": 0.8}
        powersgd = "powersgd:rank=4,start_iter=10"
        return [
            Config(task, "none", "none", opt),
            Config(task, "fp16", "fp16", opt),
            Config(task, "bf16", "bf16", opt),
            Config(task, "powersgd", powersgd, opt, warmup_steps=10),
            Config(task, "powersgd-alternate", "powersgd:rank=8,start_iter=10,alternate=True",
                   opt, warmup_steps=10),
            Config(task, "onebit", "onebit", lighter),
            Config(task, "qsgd", "qsgd", opt),
            Config(task, "terngrad", "terngrad", opt),
            Config(task, "topk", "topk:ratio=0.01", opt),
            Config(task, "topk-loco", "topk:ratio=0.01,loco_beta=0.8", opt),
            *server_configs(Config(task, "topk", "topk:ratio=0.01", opt), ps_modes),
            Config(task, "dgc", "dgc:ratio=0.01,momentum=0.9", no_momentum),
            Config(task, "randomk", "randomk:ratio=0.1", lighter),
            Config(task, "signum", "vote:momentum=0.9",
                   {"kind": "sgd", "lr": 0.002, "momentum": 0.0}, ALL_TENSORS),
            Config(task, "auto", f"auto:{powersgd}", opt, warmup_steps=10),
        ]
    raise ValueError(f"unknown task {task!r}; choose from lm, digits")


TASKS = ("lm", "digits")
QUICK_NAMES = ("none", "powersgd", "onebit-adam")
"""The configurations of ``--quick`` (those of a task that it has); on digits also top-k,
by the collectives and through a server in each mode."""


@dataclass
class Plan:
    """What one run trains: the tasks' settings (:data:`LM_TASK`, :data:`DIGITS_TASK`),
    the configurations in order, the seed, and the launch's time limit."""

    tasks: dict[str, dict[str, Any]]
    configs: list[Config]
    seed: int = 0
    timeout: float = 1800
    progress: Callable[[str], None] = field(default=lambda text: None)

    @classmethod
    def full(cls, tasks: Sequence[str] = TASKS, steps: dict[str, int] | None = None,
             every: int | None = None, only: Sequence[str] | None = None,
             ps_modes: Sequence[str] = PS_MODES) -> Plan:
        """Every recommended configuration of ``tasks``; ``steps`` overrides a task's step
        count, ``every`` its evaluation interval, ``only`` keeps the configurations of
        those names (uncompressed is always kept: it is the reference), ``ps_modes`` the
        server modes of the ``topk-server-<mode>`` rows."""
        settings = {"lm": dict(LM_TASK), "digits": dict(DIGITS_TASK)}
        for task, count in (steps or {}).items():
            settings[task]["steps"] = count
        if every is not None:
            for task in settings.values():
                task["eval_every"] = every
        every_config = [c for task in tasks
                        for c in recommended(task, settings[task]["steps"], ps_modes)]
        unknown = sorted(set(only or ()) - {c.name for c in every_config})
        if unknown:
            raise ValueError(f"no configuration named {', '.join(unknown)} in "
                             f"{', '.join(tasks)}; the names are "
                             f"{', '.join(dict.fromkeys(c.name for c in every_config))}")
        configs = [c for c in every_config
                   if only is None or c.name in only or c.name == "none"]
        return cls({task: settings[task] for task in tasks}, configs)

    @classmethod
    def quick(cls, ps_modes: Sequence[str] = PS_MODES) -> Plan:
        """A harness check: a few dozen steps of both tasks, three configurations each
        (on digits also top-k, by the collectives and through a server in each of
        ``ps_modes``), a narrower language model on shorter windows."""
        topk = ["topk", *(f"topk-server-{mode}" for mode in ps_modes)]
        plan = cls.full(only=[*QUICK_NAMES, *topk], steps={"lm": 30, "digits": 40},
                        every=10, ps_modes=ps_modes)
        plan.configs = [c for c in plan.configs if c.task == "digits" or c.name not in topk]
        plan.tasks["lm"].update(batch=8, context=32, d=64, lr_warmup=5)
        plan.configs = [replace(c, optimizer={**c.optimizer, "freeze_step": 10},
                                warmup_steps=10) if c.name == "onebit-adam" else c
                        for c in plan.configs]
        return plan

    def to_json(self, servers: dict[int, str] | None = None) -> dict[str, Any]:
        """The plan for the ranks; ``servers`` maps a configuration's index to the
        ``ps=`` address of its server."""
        servers = servers or {}
        return {"tasks": self.tasks, "seed": self.seed,
                "configs": [{**asdict(c), "ps": servers.get(i)}
                            for i, c in enumerate(self.configs)]}


class LaunchError(RuntimeError):
    """The ranks failed or overran the time limit; the message holds their output."""


HOROVOD_ENV = {"HOROVOD_CYCLE_TIME": "1"}
"""Horovod's 1 ms cycle (its own default) instead of the 10 ms that
:func:`hvd_compress.torch.init` sets: this benchmark counts bytes and loss, not seconds, and
its small steps would mostly wait for cycles."""


def launch_command(plan_file: Path, out: Path, progress: Path, ranks: int = 2) -> list[str]:
    """``horovodrun`` on this machine's Gloo controller, one rank per slot of localhost."""
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    return [horovodrun, "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
            sys.executable, "-m", "hvd_compress.bench.converge_rank", "--plan",
            str(plan_file), "--out", str(out), "--progress", str(progress)]


def run(plan: Plan) -> list[Row]:
    """Train every configuration of ``plan`` on 2 ranks; rows with gaps (:func:`add_gaps`)
    and, for those through a server, its byte counts (:func:`add_server_bytes`). Rank 0's
    progress lines go to ``plan.progress`` as they come."""
    with tempfile.TemporaryDirectory(prefix="hvdc-converge-") as tmp:
        directory = Path(tmp)
        servers = start_servers(plan, directory)
        try:
            rows = _launch(plan, directory, {i: f"grpc://{address}" for i, address in
                                             zip(servers.indices, servers.addresses)})
        finally:
            totals = stop_servers(servers)
    add_gaps(rows)
    add_server_bytes(rows, dict(zip(servers.indices, totals)))
    return rows


def _launch(plan: Plan, directory: Path, servers: dict[int, str]) -> list[Row]:
    """One ``horovodrun`` of the ranks over the plan; their rows."""
    plan_file, out, progress = (directory / name
                                for name in ("plan.json", "rows.json", "progress"))
    plan_file.write_text(json.dumps(plan.to_json(servers)))
    progress.touch()
    log = directory / "horovodrun.log"
    env = {**process_env(), **HOROVOD_ENV}
    with log.open("w") as sink, progress.open() as lines:
        proc = subprocess.Popen(launch_command(plan_file, out, progress), cwd=ROOT,
                                env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        give_up = time.monotonic() + plan.timeout
        try:
            while proc.poll() is None and time.monotonic() < give_up:
                time.sleep(0.5)
                for line in lines.readlines():
                    plan.progress(line.rstrip("\n"))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for line in lines.readlines():
            plan.progress(line.rstrip("\n"))
    if proc.returncode != 0:
        what = f"exited with {proc.returncode}" if proc.returncode != -9 else \
            f"was still running after the time limit of {plan.timeout:.0f} s"
        raise LaunchError(f"horovodrun {what}; its output:\n{log.read_text()[-8000:]}")
    return json.loads(out.read_text())


# Parameter servers -------------------------------------------------------------------------
SERVER_STOPPED = re.compile(r"stopped: (\d+) rounds closed, (\d+) failed; (\d+) pushes "
                            r"accepted; ([\d,]+) bytes in, ([\d,]+) bytes out")
"""The totals line ``python -m ps_server`` logs when it stops (``ShardService.summary``)."""


class Servers:
    """The parameter servers of a plan: ``indices`` (the configurations they serve, in
    order), their ``addresses`` and their processes (``processes``, a
    :class:`hvd_compress.bench.ps.ServerProcesses`, or ``None`` when the plan has none)."""

    def __init__(self, indices: list[int], processes: Any) -> None:
        self.indices, self.processes = indices, processes
        self.addresses: list[str] = [] if processes is None else processes.addresses


def start_servers(plan: Plan, directory: Path, ranks: int = 2) -> Servers:
    """One ``python -m ps_server`` per configuration of ``plan`` with a ``ps_mode``, on a
    free port of localhost, for ``ranks`` workers, in its mode, checkpointing into its own
    directory under ``directory``; all are up when this returns (none is left running if
    one fails to start)."""
    from hvd_compress.bench.ps import ServerProcesses

    indices = [i for i, c in enumerate(plan.configs) if c.ps_mode is not None]
    if not indices:
        return Servers([], None)
    commands = []
    for i in indices:
        checkpoints = directory / f"ps-{i}"
        checkpoints.mkdir()
        commands.append(["ps_server", "--bind", "127.0.0.1:0", "--workers", str(ranks),
                         "--mode", str(plan.configs[i].ps_mode), "--deadline", "600",
                         "--checkpoint-dir", str(checkpoints)])
    return Servers(indices, ServerProcesses(commands))


def stop_servers(servers: Servers, timeout: float = 30) -> list[dict[str, int] | None]:
    """Stop every server (SIGTERM, then SIGKILL past ``timeout`` s) and remove their logs;
    each one's totals from its last log line (rounds closed and failed, pushes, frame bytes
    in and out), ``None`` for one that did not log them."""
    processes = servers.processes
    if processes is None:
        return []
    for proc in processes.procs:
        proc.terminate()
    for proc in processes.procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass  # killed by close() below
    totals: list[dict[str, int] | None] = []
    for s in range(len(processes.procs)):
        log = Path(processes.dir.name) / f"shard{s}.log"
        match = SERVER_STOPPED.search(log.read_text(errors="replace")) if log.exists() \
            else None
        totals.append(None if match is None else dict(zip(
            ("rounds", "failed_rounds", "pushes", "bytes_in", "bytes_out"),
            (int(g.replace(",", "")) for g in match.groups()))))
    processes.close()
    return totals


def add_server_bytes(rows: list[Row], totals: dict[int, dict[str, int] | None],
                     ranks: int = 2) -> None:
    """Per row through a server (index in ``rows`` to that server's totals): the
    server's rounds, and the frame bytes it received (``server_in_bytes_per_step``) and
    sent (``server_out_bytes_per_step``) per step and rank, headers and acknowledgements
    included; ``pull_push_ratio``, the second over the first."""
    for i, row in enumerate(rows):
        total = totals.get(i)
        if total is None:
            continue
        per = ranks * row["steps"]
        row.update(server_rounds=total["rounds"], server_failed_rounds=total["failed_rounds"],
                   server_in_bytes_per_step=total["bytes_in"] / per,
                   server_out_bytes_per_step=total["bytes_out"] / per,
                   pull_push_ratio=total["bytes_out"] / max(total["bytes_in"], 1))


def add_gaps(rows: list[Row]) -> None:
    """Per row, against the uncompressed row of its task: ``loss_gap_pct`` (relative, %),
    ``accuracy_gap_points`` (reference minus row, points), ``ratio`` and
    ``ratio_after_warmup`` (float32 bytes over bytes sent)."""
    base = {r["task"]: r for r in rows if r["name"] == "none"}
    for row in rows:
        ref = base.get(row["task"])
        row["loss_gap_pct"] = None if ref is None else \
            100 * (row["final_loss"] / ref["final_loss"] - 1)
        row["accuracy_gap_points"] = None if ref is None else \
            100 * (ref["final_accuracy"] - row["final_accuracy"])
        row["ratio"] = row["dense_bytes_per_step"] / max(row["bytes_per_step"], 1)
        row["ratio_after_warmup"] = row["dense_bytes_per_step"] / max(
            row["bytes_per_step_after_warmup"], 1)


# Reporting ---------------------------------------------------------------------------------
LM_LOSS_GAP, ONEBIT_ADAM_GAP, ONEBIT_ADAM_RATIO, DIGITS_POINTS = 2.0, 1.0, 16.0, 1.0
"""The targets: relative loss gap (%) on lm, 1-bit Adam's gap (%) and bytes ratio after its
warm-up, accuracy gap (points) on digits."""


def settings_text(row: Row) -> str:
    """The scheme spec, the optimizer and any policy options, in one line."""
    opt = dict(row["optimizer"])
    kind = opt.pop("kind")
    text = f"`{row['scheme']}`, " if row["scheme"] else ""
    text += f"{kind}(" + ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in opt.items()) + ")"
    if row["policy"]:
        text += ", Policy(" + ", ".join(f"{k}={v}" for k, v in row["policy"].items()) + ")"
    if row.get("ps_mode"):
        text += f", via a parameter server, `--mode {row['ps_mode']}`"
    return text


def markdown(rows: Sequence[Row]) -> str:
    """One table per task: the score, its gap, bytes per step per rank and the ratios."""
    out = []
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        first = mine[0]
        if task == "lm":
            out.append(f"Character-level transformer on pydoc_data.topics, 2 ranks, "
                       f"{first['steps']} steps (held-out loss in nats per character):")
            head = "| configuration | settings | held-out loss | gap | "
            score = lambda r: (f"{r['final_loss']:.4f}", _signed(r["loss_gap_pct"], "%"))  # noqa: E731
        else:
            out.append(f"Digits MLP, 2 ranks, {first['steps']} steps (test accuracy):")
            head = "| configuration | settings | test accuracy | gap (points) | "
            score = lambda r: (f"{100 * r['final_accuracy']:.2f}%",  # noqa: E731
                               _signed(r["accuracy_gap_points"], ""))
        out += ["", head + "kB/step/rank | vs fp32 | after warm-up: kB/step | vs fp32 | "
                "replicas identical |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in mine:
            value, gap = score(r)
            out.append(f"| {r['name']} | {settings_text(r)} | {value} | {gap} | "
                       f"{r['bytes_per_step'] / 1e3:.1f} | {r['ratio']:.1f}x | "
                       f"{r['bytes_per_step_after_warmup'] / 1e3:.1f} | "
                       f"{r['ratio_after_warmup']:.1f}x | "
                       f"{'yes' if r['replicas_agree'] else 'NO'} |")
        out.append("")
        out += server_table([r for r in mine if r.get("ps_mode")])
    return "\n".join(out).rstrip()


def server_table(rows: Sequence[Row]) -> list[str]:
    """The lines of a table of the rows through a server: its mode, the rounds it closed,
    the frame bytes it received and sent per step and rank, and their ratio (none when
    ``rows`` is empty)."""
    rows = [r for r in rows if "server_rounds" in r]
    if not rows:
        return []
    out = ["Through a parameter server (one `python -m ps_server` per row, 2 workers; frame "
           "bytes as the server counted them, headers included, per step and rank):", "",
           "| configuration | mode | rounds closed (failed) | received kB/step/rank | "
           "sent kB/step/rank | sent / received |", "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['name']} | {r['ps_mode']} | {r['server_rounds']} "
                   f"({r['server_failed_rounds']}) | "
                   f"{r['server_in_bytes_per_step'] / 1e3:.2f} | "
                   f"{r['server_out_bytes_per_step'] / 1e3:.2f} | "
                   f"{r['pull_push_ratio']:.2f}x |")
    return [*out, ""]


def _signed(value: float | None, unit: str) -> str:
    return "–" if value is None else f"{value:+.2f}{unit}"


def targets(rows: Sequence[Row]) -> list[str]:
    """PASS/FAIL lines for the goals (see the module docstring); never enforced."""
    lines = []
    for r in rows:
        if r["name"] == "none" or r["loss_gap_pct"] is None:
            continue
        if r["task"] == "lm":
            ok = r["loss_gap_pct"] <= LM_LOSS_GAP
            lines.append(f"{'PASS' if ok else 'FAIL'}  lm {r['name']}: held-out loss "
                         f"{r['final_loss']:.4f}, {r['loss_gap_pct']:+.2f}% against "
                         f"uncompressed (target <= {LM_LOSS_GAP:g}%)")
            if r["name"] == "onebit-adam":
                ok = r["loss_gap_pct"] <= ONEBIT_ADAM_GAP and \
                    r["ratio_after_warmup"] >= ONEBIT_ADAM_RATIO
                lines.append(f"{'PASS' if ok else 'FAIL'}  lm onebit-adam: "
                             f"{r['loss_gap_pct']:+.2f}% (target <= {ONEBIT_ADAM_GAP:g}%) at "
                             f"{r['ratio_after_warmup']:.1f}x fewer bytes per step after its "
                             f"warm-up (target >= {ONEBIT_ADAM_RATIO:g}x)")
        else:
            ok = r["accuracy_gap_points"] <= DIGITS_POINTS
            lines.append(f"{'PASS' if ok else 'FAIL'}  digits {r['name']}: "
                         f"{100 * r['final_accuracy']:.2f}%, {r['accuracy_gap_points']:+.2f} "
                         f"points under uncompressed (target <= {DIGITS_POINTS:g})")
        if not r["replicas_agree"]:
            lines.append(f"FAIL  {r['task']} {r['name']}: the replicas differ after training")
    return lines


def summary(rows: Sequence[Row]) -> str:
    text = markdown(rows)
    lines = targets(rows)
    if lines:
        text += "\n\nTargets:\n" + "\n".join(lines)
    warned = [f"- {r['task']} {r['name']}: {w}" for r in rows for w in r["warnings"]]
    if warned:
        text += "\n\nWarnings raised while training:\n" + "\n".join(warned)
    return text


def plot(rows: Sequence[Row], task: str, out_dir: Path) -> list[str]:
    """Two PNGs of the held-out loss of every configuration of ``task``: against the step
    (``converge-<task>-steps.png``) and against the megabytes each rank sent so far
    (``converge-<task>-bytes.png``, log scale); their names."""
    from matplotlib import colormaps

    from hvd_compress.bench.cluster import _figure

    mine = [r for r in rows if r["task"] == task]
    what = ("character transformer on pydoc_data.topics, AdamW" if task == "lm"
            else "digits MLP, SGD with momentum")
    low = min(p["loss"] for r in mine for p in r["curve"])
    high = max(max(r["final_loss"] for r in mine) * 1.6, low * 1.3)
    names = []
    for axis, label in (("steps", "step"), ("bytes", "MB sent per rank (log)")):
        name = f"converge-{task}-{axis}.png"
        with _figure(out_dir / name, f"{what}: held-out loss, 2 ranks") as ax:
            for i, r in enumerate(mine):
                xs = [p["step"] if axis == "steps" else max(p["bytes"], 1) / 1e6
                      for p in r["curve"]]
                # Uncompressed in black and thick (fp16 and bf16 often lie on it), the
                # others in 20 distinct colours.
                ax.plot(xs, [p["loss"] for p in r["curve"]], marker=".", label=r["name"],
                        color="black" if r["name"] == "none" else colormaps["tab20"](i % 20),
                        linewidth=3 if r["name"] == "none" else 1.2, zorder=0 if r["name"] ==
                        "none" else 1)
            if axis == "bytes":
                ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel("held-out loss" + (", nats per character" if task == "lm" else ""))
            ax.set_ylim(low * 0.97, high)
        names.append(name)
    return names


def write(rows: Sequence[Row], out_dir: Path, command: str) -> list[str]:
    """``converge.json``, ``converge.md`` (with the command that made it) and the plots of
    :func:`plot` for each task, into ``out_dir``; the names written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "converge.json").write_text(json.dumps(list(rows), indent=2) + "\n")
    (out_dir / "converge.md").write_text(f"`{command}`\n\n{summary(rows)}\n")
    written = ["converge.json", "converge.md"]
    for task in dict.fromkeys(r["task"] for r in rows):
        written += plot(rows, task, out_dir)
    return written
