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
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from hvd_compress.comm.parameter_server import ParameterServerCommunicator, skip_behind
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
        for _ in skip_behind(steps, comm, skip_step) if mode == "skip" else steps:
            computed += 1
            slow = mode != "undelayed" and rank == args.workers - 1 and \
                computed % args.every == 0
            time.sleep(args.compute * (1 + (args.delay if slow else 0)))
            pipeline.reduce({"w": torch.randn(256, 256, generator=gen)})
            stamps.append(time.perf_counter())
    finally:
        client.close()
    times[rank] = (stamps, computed)


def run(args: argparse.Namespace, mode: str) -> dict[str, float]:
    """One run (``mode``: ``undelayed``, ``full``, ``quorum`` or ``skip``): the step
    times and the quorum counters."""
    quorum = None if mode in ("undelayed", "full") else str(args.quorum)
    store = ShardStore(args.workers, 0, 1, deadline=60.0, quorum=Quorum.parse(
        quorum, args.workers, args.grace, keep=4096))
    service = ShardService(store)
    server, port = grpc_transport.serve(service, "127.0.0.1:0", 60.0)
    times: dict[int, tuple[list[float], int]] = {}
    threads = [threading.Thread(target=_worker, args=(f"127.0.0.1:{port}", r, args, mode,
                                                      times)) for r in range(args.workers)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    server.stop(0)
    service.close()
    per_worker = [(stamps[-1] - stamps[0]) / args.steps for stamps, _ in times.values()]
    return {"step": per_worker[0] if 0 in times else min(per_worker),
            "fastest": min(per_worker), "slowest": max(per_worker),
            "job": wall / args.steps, "partial": store.partial_rounds,
            "late": store.late_pushes, "computed": times[args.workers - 1][1]}


MODES = {"undelayed": "undelayed, full rounds", "full": "delayed, full rounds",
         "quorum": "delayed, quorum", "skip": "delayed, quorum + skipping"}


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
    parser.add_argument("--repeat", type=int, default=1, help="launches of the four runs")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"runs, in order, of {', '.join(MODES)}")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or "undelayed" not in modes:
        parser.error(f"--modes takes {', '.join(MODES)} including undelayed (the base); "
                     f"got {args.modes!r}")
    print(f"{args.workers} workers, {args.steps} steps, compute {args.compute:g} s/step; "
          f"worker {args.workers - 1} delayed by {args.delay:g}x on every {args.every}th "
          f"step it computes; quorum {args.quorum}, grace {args.grace:g} s")
    print(f"{'run':<28} {'job step':>14} {'worker 0':>9} {'fastest':>8} {'slowest':>8} "
          f"{'computed':>9} {'partial':>8} {'late':>5}")
    for launch in range(args.repeat):
        base = None
        for mode in sorted(modes, key=lambda m: m != "undelayed"):
            result = run(args, mode)
            base = base or result["job"]
            print(f"{MODES[mode]:<28} {1e3 * result['job']:6.1f} ms "
                  f"{result['job'] / base:5.2f}x {1e3 * result['step']:6.1f} ms "
                  f"{1e3 * result['fastest']:5.1f} ms {1e3 * result['slowest']:5.1f} ms "
                  f"{result['computed']:5d}/{args.steps:<3d} {result['partial']:4d}/"
                  f"{args.steps:<3d} {result['late']:5d}", flush=True)
        if launch + 1 < args.repeat:
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
