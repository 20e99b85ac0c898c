"""Step time on throttled links: emulated hosts (2 by default), real Horovod over MPI, real sockets.

Each rank runs on its own emulated host (:mod:`hvd_compress.bench.hosts`: a network
namespace whose link is throttled with ``tc tbf``). ``mpirun`` starts the ranks inside the
namespaces, with OpenMPI's ring all-reduce (``coll_tuned_allreduce_algorithm 4``) unless
asked for OpenMPI's default choice.
Every rank reduces the same random gradients of a layer set through the
:class:`~hvd_compress.Pipeline` of each scheme; the step time is the median over
``steps`` timed steps after one warm-up, each step started after a barrier.

Needs root, ``ip`` and ``tc``; the namespaces, bridge and links are created for the run and
deleted after it, and traffic stays between them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hvd_compress.bench.hosts import (
    emulated_hosts,
    mpirun_host_args,
    rate_bits,
    require_root,
)
from hvd_compress.bench.launch import run_mpirun
from hvd_compress.bench.report import Column, Row, field, optional_field

RING_ALLREDUCE = ("--mca", "coll_tuned_use_dynamic_rules", "1",
                  "--mca", "coll_tuned_allreduce_algorithm", "4")
"""OpenMPI's ring all-reduce, as the demo and the README launch with."""
LINK_SCHEMES = ("none", "fp16", "onebit", "qsgd:bits=4", "powersgd:rank=4,start_iter=0",
                "topk:ratio=0.001")

COLUMNS = (
    Column("layers", field("layers")),
    Column("scheme", field("scheme")),
    Column("payload bytes", field("bytes", "{:,}")),
    Column("step s", field("step_seconds", "{:.3f}")),
    Column("speed-up vs none", optional_field("speedup", "{:.2f}x")),
    Column("fp32 ring time s", field("ideal_fp32_seconds", "{:.3f}")),
)
TARGETS = ()


def title(ranks: int, rate: str, steps: int, ring: bool) -> str:
    algorithm = "ring all-reduce" if ring else "OpenMPI's default all-reduce choice"
    return (f"Step time of {ranks} ranks on emulated hosts with {rate} links (mpirun, "
            f"{algorithm}; median of {steps} steps). 'fp32 ring time' is the time an ideal "
            "ring needs for the uncompressed gradients at the link rate.")


def run(layers: str, schemes: Sequence[str], rate: str, steps: int, ring: bool = True,
        ranks: int = 2, timeout: float = 1800) -> list[Row]:
    """Launch the ranks on emulated hosts; returns one row per scheme. ``ring=False``
    leaves the all-reduce algorithm to OpenMPI's default choice.

    A launch still running after ``timeout`` seconds is aborted by ``mpirun --timeout``,
    which prints the state of its daemons and ranks; each rank writes its Python stacks to
    a file shortly before that (a file, because the throttled link may still be busy).
    Both appear in the error raised.
    """
    require_root("link")
    with tempfile.TemporaryDirectory(prefix="hvdc-link-") as tmp, \
            emulated_hosts(ranks, rate) as addresses:
        out, log = Path(tmp) / "rows.json", Path(tmp) / "mpirun.log"
        mpi_timeout = max(int(timeout), 10)
        returncode = run_mpirun(
            [*mpirun_host_args(addresses, Path(tmp)),
             *(RING_ALLREDUCE if ring else ()),
             sys.executable, "-m", "hvd_compress.bench.link", "--out", str(out),
             "--layers", layers, "--steps", str(steps), "--rate", rate,
             "--stacks-at", str(time.time() + mpi_timeout - min(5, mpi_timeout / 2)),
             "--stacks-dir", tmp, "--schemes", *schemes],
            mpi_timeout, log)
        if returncode != 0 or not out.exists():
            stacks = "".join(f"\n{path.stem}:\n{path.read_text()}"
                             for path in sorted(Path(tmp).glob("stacks-rank*.txt"))
                             if path.stat().st_size)
            raise RuntimeError(f"link benchmark ranks failed (mpirun exit code {returncode}"
                               f", timeout {mpi_timeout} s); mpirun's output:\n"
                               f"{log.read_text()[-8000:]}{stacks[-8000:]}")
        rows = json.loads(out.read_text())
        for row in rows:
            row["allreduce"] = "ring" if ring else "openmpi-default"
        return rows


def rank_main(argv: Sequence[str] | None = None) -> None:
    """One rank: time each scheme's step on the layer set, rank 0 writes the rows."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--rate", required=True)
    parser.add_argument("--schemes", nargs="+", required=True)
    parser.add_argument("--stacks-at", type=float, required=True,
                        help="write every thread's Python stack at this time.time()")
    parser.add_argument("--stacks-dir", type=Path, required=True,
                        help="into stacks-rank<N>.txt in this directory")
    args = parser.parse_args(argv)
    stacks = (args.stacks_dir / f"stacks-rank{os.environ['OMPI_COMM_WORLD_RANK']}.txt").open("w")
    faulthandler.dump_traceback_later(max(args.stacks_at - time.time(), 0.1), file=stacks)

    import horovod.torch as hvd
    import torch

    from hvd_compress import Compression, Pipeline, Policy
    from hvd_compress.bench.wire_bytes import LAYER_SETS
    from hvd_compress.comm.horovod_torch import HorovodTorchCommunicator

    hvd.init()
    torch.set_num_threads(1)
    comm = HorovodTorchCommunicator()
    gen = torch.Generator().manual_seed(hvd.rank())
    grads = {name: torch.randn(shape, generator=gen)
             for name, shape in LAYER_SETS[args.layers].items()}
    dense_bytes = 4 * sum(g.numel() for g in grads.values())
    ideal = 2 * (hvd.size() - 1) / hvd.size() * dense_bytes * 8 / rate_bits(args.rate)
    rows: list[Row] = []
    for spec in args.schemes:
        pipeline = Pipeline(Compression.parse(spec), comm, Policy())
        times = []
        for step in range(1 + args.steps):
            hvd.allreduce(torch.zeros(1), name=f"link.barrier.{spec}.{step}")
            start = time.perf_counter()
            pipeline.reduce(grads)
            times.append(time.perf_counter() - start)
        rows.append({"layers": args.layers, "scheme": spec, "rate": args.rate,
                     "bytes": pipeline.last_step.payload_bytes, "dense_bytes": dense_bytes,
                     "step_seconds": statistics.median(times[1:]),
                     "ideal_fp32_seconds": ideal})
    base = next((r["step_seconds"] for r in rows if r["scheme"] == "none"), None)
    for row in rows:
        row["speedup"] = None if base is None else base / row["step_seconds"]
    if hvd.rank() == 0:
        args.out.write_text(json.dumps(rows, indent=2))
    faulthandler.cancel_dump_traceback_later()
    stacks.close()


if __name__ == "__main__":
    rank_main()
