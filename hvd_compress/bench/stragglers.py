"""Step time with a straggler: full rounds, ``--quorum`` rounds, and quorum rounds whose
late worker skips the rounds it missed::

    python -m hvd_compress.bench.stragglers [--workers 4] [--steps 48] [--compute 0.05]
        [--delay 5] [--every 4] [--quorum 3] [--grace 0.025] [--repeat 1]
        [--modes undelayed,full,quorum,skip]

``W`` workers (threads) each "compute" for ``--compute`` seconds per step (a sleep), then
exchange a 256x256 gradient by top-k (1 %) through a parameter server over gRPC on
loopback (in this process). The last worker sleeps ``--delay`` times the compute time
more on every ``--every``-th step it computes. Four runs: undelayed with full rounds,
delayed with full rounds, delayed with ``--quorum`` and ``--grace``, and the same with
the straggler's loader through
:func:`~hvd_compress.comm.parameter_server.skip_behind` (no gradient for the rounds
that closed without it). For each: the job's step time (its wall time over the steps,
and against the undelayed run), worker 0's, the fastest and the slowest worker's mean
step time, the gradients the straggler computed, the rounds closed without a worker and
the pushes refused as late. docs/reliability.md#stragglers has runs.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from hvd_compress.comm.parameter_server import (
    DEFAULT_PARTIAL,
    PARTIAL,
    ParameterServerCommunicator,
    skip_behind,
)
from hvd_compress.comm.ps_transport.grpc import PSClient
from hvd_compress.pipeline import Pipeline
from hvd_compress.schemes.topk import TopK
from ps_server import grpc_transport
from ps_server.service import ShardService
from ps_server.store import Quorum, ShardStore


class SparseOnly:
    """The dense side of a :class:`ParameterServerCommunicator` whose every tensor goes
    to the server (this bench, the quorum tests): it refuses dense collectives."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def start(self, name: str, op: Any) -> Any:
        raise RuntimeError(f"{name}: this bench sends sparse sums only")

    def wait(self, handle: Any) -> Any:
        raise RuntimeError("this bench sends sparse sums only")


def _worker(address: str, rank: int, args: argparse.Namespace, mode: str,
            times: dict[int, tuple[list[float], int]]) -> None:
    client = PSClient(address, rank, timeout=120, retry_timeout=60)
    comm = ParameterServerCommunicator(SparseOnly(rank, args.workers), client,
                                       "stragglers")
    pipeline = Pipeline(TopK(0.01), comm)
    gen = torch.Generator().manual_seed(rank)
    stamps = [time.perf_counter()]
    computed = 0

    def skip_step() -> None:  # a step on zeros: applies the closed round's aggregate
        pipeline.reduce({"w": torch.zeros(256, 256)})
        stamps.append(time.perf_counter())

    steps = range(args.steps)
    try:
        for _ in skip_behind(steps, comm, skip_step) if "skip" in mode else steps:
            computed += 1
            slow = not mode.startswith("undelayed") and rank == args.workers - 1 and \
                computed % args.every == 0
            time.sleep(args.compute * (1 + (args.delay if slow else 0)))
            pipeline.reduce({"w": torch.randn(256, 256, generator=gen)})
            stamps.append(time.perf_counter())
    finally:
        client.close()
    times[rank] = (stamps, computed)


def _launch(args: argparse.Namespace, mode: str, worker: Callable[..., None],
            out: dict[int, Any]) -> tuple[ShardStore, float]:
    """A server (full rounds, or ``--quorum`` and ``--grace`` unless ``mode`` is
    ``undelayed`` or ``full``) and ``worker(address, rank, args, mode, out)`` in a thread
    per worker; the server's store and the wall time until every worker is done."""
    quorum = None if mode in ("undelayed", "full") else str(args.quorum)
    store = ShardStore(args.workers, 0, 1, deadline=120.0, quorum=Quorum.parse(
        quorum, args.workers, args.grace, keep=4096))
    service = ShardService(store)
    server, port = grpc_transport.serve(service, "127.0.0.1:0", 120.0)
    threads = [threading.Thread(target=worker, args=(f"127.0.0.1:{port}", r, args, mode,
                                                     out)) for r in range(args.workers)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    server.stop(0)
    service.close()
    return store, wall


def run(args: argparse.Namespace, mode: str) -> dict[str, float]:
    """One run (``mode``: ``undelayed``, ``full``, ``quorum`` or ``skip``): the step
    times and the quorum counters."""
    times: dict[int, tuple[list[float], int]] = {}
    store, wall = _launch(args, mode, _worker, times)
    per_worker = [(stamps[-1] - stamps[0]) / args.steps for stamps, _ in times.values()]
    return {"step": per_worker[0] if 0 in times else min(per_worker),
            "fastest": min(per_worker), "slowest": max(per_worker),
            "job": wall / args.steps, "partial": store.partial_rounds,
            "late": store.late_pushes, "computed": times[args.workers - 1][1]}


MODES = {"undelayed": "undelayed, full rounds", "full": "delayed, full rounds",
         "quorum": "delayed, quorum", "skip": "delayed, quorum + skipping",
         "undelayed-skip": "undelayed, quorum + skipping"}

TRAIN = {"digits": {"steps": 300, "batch": 32, "optimizer": {"kind": "sgd", "lr": 0.1,
                                                            "momentum": 0.9}},
         "lm": {"steps": 150, "batch": 16, "context": 64, "d": 128, "layers": 2,
                "optimizer": {"kind": "adamw", "lr": 3e-3}}}
"""``--task``: bench converge's digits MLP and character transformer (its tasks, data and
optimizers), for a fixed number of rounds each (shorter than converge's runs)."""


_SEEDING = threading.Lock()


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """``--task``'s settings, with ``--rounds`` for its rounds when given."""
    rounds = getattr(args, "rounds", None)
    return {**TRAIN[args.task], **({"steps": rounds} if rounds else {})}


def _train_worker(address: str, rank: int, args: argparse.Namespace, mode: str,
                  out: dict[int, dict[str, Any]]) -> None:
    """One worker of ``--task``: its shard's batches, top-k 1 % of every tensor through
    the server, the aggregate averaged into ``.grad`` and the optimizer's step."""
    from hvd_compress.bench.converge_rank import TASKS
    from hvd_compress.policy import Policy

    settings = _settings(args)
    with _SEEDING:  # the model seeds torch's global generator: one thread at a time
        task = TASKS[args.task](settings, rank, args.workers)
        model = task.model(args.seed)  # the same initial weights on every worker
    options = dict(settings["optimizer"])
    kind = options.pop("kind")
    optimizer = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[kind](
        model.parameters(), **options)
    client = PSClient(address, rank, timeout=300, retry_timeout=60)
    comm = ParameterServerCommunicator(SparseOnly(rank, args.workers), client, args.task,
                                       partial=args.partial)
    pipeline = Pipeline(TopK(0.01), comm, Policy(min_numel=0, compress_1d=True))
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(1000 + rank)

    def apply(grads: dict[str, torch.Tensor]) -> None:
        for name, result in pipeline.reduce(grads).items():
            params[name].grad = result.view_as(params[name])
        optimizer.step()

    def skip_step() -> None:  # no batch, no gradient: the closed round's aggregate only
        apply({name: torch.zeros_like(p) for name, p in params.items()})

    computed, began = 0, time.perf_counter()
    steps = range(settings["steps"])
    try:
        loop = skip_behind(steps, comm, skip_step, compute_open=args.compute_open) \
            if "skip" in mode else steps
        for _ in loop:
            computed += 1
            if not mode.startswith("undelayed") and rank == args.workers - 1 and \
                    computed % args.every == 0:
                time.sleep(args.delay * args.compute)
            optimizer.zero_grad()
            task.loss(model, task.batch(gen)).backward()
            apply({name: p.grad for name, p in params.items()})
    finally:
        client.close()
    out[rank] = {"seconds": time.perf_counter() - began, "computed": computed,
                 "weights": torch.cat([p.detach().reshape(-1) for p in params.values()]),
                 "model": model}


def train(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """One training run of ``--task`` in ``mode``: held-out loss and accuracy (the whole
    held-out set, scored on worker 0's model), whether every worker ended with the same
    weights, the job's wall time and the straggler's computed steps."""
    from hvd_compress.bench.converge_rank import TASKS

    out: dict[int, dict[str, Any]] = {}
    store, wall = _launch(args, mode, _train_worker, out)
    if len(out) != args.workers:
        raise RuntimeError(f"{args.workers - len(out)} workers failed (see above)")
    whole = TASKS[args.task](TRAIN[args.task], 0, 1)
    model, totals = out[0]["model"], torch.zeros(3, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for x, y in whole.held_out():
            logits = model(x).reshape(-1, whole.classes)
            target = y.reshape(-1)
            totals[0] += torch.nn.functional.cross_entropy(logits, target,
                                                           reduction="sum").item()
            totals[1] += (logits.argmax(1) == target).sum().item()
            totals[2] += target.numel()
    same = all(torch.equal(out[r]["weights"], out[0]["weights"]) for r in out)
    return {"loss": float(totals[0] / totals[2]), "accuracy": float(totals[1] / totals[2]),
            "identical": same, "job": wall / _settings(args)["steps"],
            "computed": out[args.workers - 1]["computed"],
            "partial": store.partial_rounds / max(store.closed_rounds, 1)}


def design_name(args: argparse.Namespace, mode: str) -> str:
    """A run's design: ``partial`` (and ``+open`` with ``compute_open``) for a quorum
    run; empty for full rounds, where no round is partial."""
    if mode in ("undelayed", "full"):
        return ""
    return args.partial + ("+open" if args.compute_open else "")


def train_main(args: argparse.Namespace, modes: list[str]) -> int:
    """Every ``--seeds`` seed: full-round modes once, quorum modes once per design."""
    steps = _settings(args)["steps"]
    designs = [d.strip() for d in args.designs.split(",") if d.strip()]
    print(f"--task {args.task}: {args.workers} workers, {steps} rounds, top-k 1 % of every "
          f"tensor; worker {args.workers - 1} sleeps {args.delay * args.compute:g} s on every "
          f"{args.every}th step it computes; quorum {args.quorum}, grace {args.grace:g} s")
    print(f"{'seed':>4} {'run':<30} {'design':<14} {'held-out loss':>13} {'accuracy':>9} "
          f"{'job step':>9} {'computed':>9} {'partial':>7} replicas")
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mode in _launches(args.repeat, modes):
            for design in designs if mode not in ("undelayed", "full") else [designs[0]]:
                partial, _, extra = design.partition("+")
                run_args = argparse.Namespace(**{**vars(args), "seed": seed,
                                                 "partial": partial,
                                                 "compute_open": extra == "open"})
                r = train(run_args, mode)
                name = design_name(run_args, mode)
                rows.append({"seed": seed, "mode": mode, "design": name,
                             **{k: v for k, v in r.items()}})
                print(f"{seed:4d} {MODES[mode]:<30} {name:<14} {r['loss']:13.4f} "
                      f"{100 * r['accuracy']:8.2f}% {1e3 * r['job']:6.1f} ms "
                      f"{r['computed']:5d}/{steps:<3d} {100 * r['partial']:6.1f}% "
                      f"{'identical' if r['identical'] else 'DIFFER'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"task": args.task, "workers": args.workers, "rounds": steps,
                       "quorum": args.quorum, "grace": args.grace,
                       "delay": args.delay * args.compute, "every": args.every,
                       "runs": rows}, f, indent=1)
    return 0


def _launches(repeat: int, modes: list[str]) -> Iterator[str]:
    """``modes`` ``repeat`` times, a blank line printed between launches."""
    for launch in range(repeat):
        if launch:
            print()
        yield from modes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_compress.bench.stragglers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--compute", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--delay", type=float, default=5.0, help="x the compute time")
    parser.add_argument("--every", type=int, default=4,
                        help="the straggler's delayed steps (of those it computes)")
    parser.add_argument("--quorum", type=int, default=3)
    parser.add_argument("--grace", type=float, default=0.025, help="seconds")
    parser.add_argument("--repeat", type=int, default=1, help="launches of the runs")
    parser.add_argument("--modes", default="undelayed,full,quorum,skip",
                        help=f"runs, in order, of {', '.join(MODES)}")
    parser.add_argument("--task", choices=sorted(TRAIN),
                        help="train this model instead (compute is real; --compute only "
                        "scales the delay)")
    parser.add_argument("--seeds", default="0",
                        help="--task's initial weights: seeds, comma-separated")
    parser.add_argument("--designs", default=DEFAULT_PARTIAL,
                        help="--task: what a partial round applies, comma-separated, each "
                        f"run side by side: {', '.join(PARTIAL)} (ParameterServer"
                        "Communicator's partial), with +open the late worker computes a "
                        "gradient for the open round (skip_behind's compute_open)")
    parser.add_argument("--json", help="--task: write every run's figures to this file")
    parser.add_argument("--rounds", type=int,
                        help="--task's rounds (default: digits 300, lm 150)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    bad = [d for d in args.designs.split(",") if d.strip().partition("+")[0] not in PARTIAL
           or d.strip().partition("+")[2] not in ("", "open")]
    if bad:
        parser.error(f"--designs takes {', '.join(PARTIAL)}, each optionally with +open; "
                     f"got {', '.join(bad)}")
    if unknown or ("undelayed" not in modes and args.task is None):
        parser.error(f"--modes takes {', '.join(MODES)} including undelayed (the base); "
                     f"got {args.modes!r}")
    torch.set_num_threads(1)
    if args.task is not None:
        return train_main(args, modes)
    print(f"{args.workers} workers, {args.steps} steps, compute {args.compute:g} s/step; "
          f"worker {args.workers - 1} delayed by {args.delay:g}x on every {args.every}th "
          f"step it computes; quorum {args.quorum}, grace {args.grace:g} s")
    print(f"{'run':<28} {'job step':>14} {'worker 0':>9} {'fastest':>8} {'slowest':>8} "
          f"{'computed':>9} {'partial':>8} {'late':>5}")
    run(argparse.Namespace(**{**vars(args), "steps": 2}), "undelayed")  # warm-up, unshown
    base = 0.0
    for mode in _launches(args.repeat, sorted(modes, key=lambda m: m != "undelayed")):
        result = run(args, mode)
        base = result["job"] if mode == "undelayed" else base
        print(f"{MODES[mode]:<28} {1e3 * result['job']:6.1f} ms "
              f"{result['job'] / base:5.2f}x {1e3 * result['step']:6.1f} ms "
              f"{1e3 * result['fastest']:5.1f} ms {1e3 * result['slowest']:5.1f} ms "
              f"{result['computed']:5d}/{args.steps:<3d} {result['partial']:4d}/"
              f"{args.steps:<3d} {result['late']:5d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
