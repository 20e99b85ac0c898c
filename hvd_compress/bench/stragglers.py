"""Step time with a straggler, full rounds against ``--quorum`` rounds::

    python -m hvd_compress.bench.stragglers [--workers 4] [--steps 48] [--compute 0.05]
        [--delay 5] [--every 4] [--quorum 3] [--grace 0.025]

``W`` workers (threads) each "compute" for ``--compute`` seconds per step (a sleep), then
exchange a 256x256 gradient by top-k (1 %) through a parameter server over gRPC on
loopback (in this process). The last worker sleeps ``--delay`` times the compute time
more on every ``--every``-th step. Three runs: undelayed with full rounds, delayed with
full rounds, delayed with ``--quorum`` and ``--grace``. For each: worker 0's mean step
time, the job's wall time (until the last worker is done), the rounds closed without a
worker and the pushes refused as late. docs/reliability.md#stragglers has a run.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from hvd_compress.comm.parameter_server import ParameterServerCommunicator
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


def _worker(address: str, rank: int, args: argparse.Namespace, delayed: bool,
            times: dict[int, list[float]]) -> None:
    client = PSClient(address, rank, timeout=120, retry_timeout=60)
    comm = ParameterServerCommunicator(SparseOnly(rank, args.workers), client,
                                       "stragglers")
    pipeline = Pipeline(TopK(0.01), comm)
    gen = torch.Generator().manual_seed(rank)
    stamps = [time.perf_counter()]
    try:
        for step in range(args.steps):
            slow = delayed and rank == args.workers - 1 and step % args.every == args.every - 1
            time.sleep(args.compute * (1 + (args.delay if slow else 0)))
            pipeline.reduce({"w": torch.randn(256, 256, generator=gen)})
            stamps.append(time.perf_counter())
    finally:
        client.close()
    times[rank] = stamps


def run(args: argparse.Namespace, delayed: bool, quorum: int | None) -> dict[str, float]:
    """One run; worker 0's mean step time, the job's wall time and the quorum counters."""
    store = ShardStore(args.workers, 0, 1, deadline=60.0, quorum=Quorum.parse(
        None if quorum is None else str(quorum), args.workers, args.grace, keep=4096))
    service = ShardService(store)
    server, port = grpc_transport.serve(service, "127.0.0.1:0", 60.0)
    times: dict[int, list[float]] = {}
    threads = [threading.Thread(target=_worker, args=(f"127.0.0.1:{port}", r, args, delayed,
                                                      times)) for r in range(args.workers)]
    began = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - began
    server.stop(0)
    service.close()
    first = times[0]
    return {"step": (first[-1] - first[0]) / args.steps, "wall": wall,
            "partial": store.partial_rounds, "late": store.late_pushes}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_compress.bench.stragglers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--compute", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--delay", type=float, default=5.0, help="x the compute time")
    parser.add_argument("--every", type=int, default=4, help="the delayed steps")
    parser.add_argument("--quorum", type=int, default=3)
    parser.add_argument("--grace", type=float, default=0.025, help="seconds")
    args = parser.parse_args(argv)
    print(f"{args.workers} workers, {args.steps} steps, compute {args.compute:g} s/step; "
          f"worker {args.workers - 1} delayed by {args.delay:g}x on every {args.every}th "
          f"step")
    base = None
    for label, delayed, quorum in (("undelayed, full rounds", False, None),
                                   ("delayed, full rounds", True, None),
                                   (f"delayed, quorum {args.quorum} grace {args.grace:g} s",
                                    True, args.quorum)):
        result = run(args, delayed, quorum)
        base = base or result["step"]
        print(f"{label:<36} step {1e3 * result['step']:6.1f} ms ({result['step'] / base:4.2f}x)"
              f"  job wall {result['wall']:5.2f} s  rounds without a worker "
              f"{result['partial']:3d}  late pushes {result['late']:3d}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
