"""Step time on throttled links: emulated hosts (2 by default), real Horovod over MPI, real sockets.

Each rank runs in its own network namespace, joined to the others by a veth pair on a
bridge, with a token-bucket filter (``tc ... tbf rate RATE``) on both ends of every link,
so each host sends and receives at most ``RATE``. ``mpirun`` starts the ranks inside the
namespaces (its ``plm_rsh_agent`` is a script that maps a host address to
``ip netns exec``), with OpenMPI's ring all-reduce (``coll_tuned_allreduce_algorithm 4``)
unless asked for OpenMPI's default choice.
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
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from hvd_compress.bench.launch import run_mpirun
from hvd_compress.bench.report import Column, Row, field, optional_field

RING_ALLREDUCE = ("--mca", "coll_tuned_use_dynamic_rules", "1",
                  "--mca", "coll_tuned_allreduce_algorithm", "4")
"""OpenMPI's ring all-reduce, as the demo and the README launch with."""
NO_TOPOLOGY_SHMEM = ("--mca", "rtc_hwloc_vmhole", "none")
"""Daemons do not publish their hwloc topology in shared memory: two of them doing so on
one machine crashed one now and then (a segfault in ``hwloc_shmem_topology_write``), and a
daemon that dies before it reports leaves ``mpirun`` waiting for ever."""
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


def rate_bits(rate: str) -> float:
    """``100mbit``, ``1gbit``, ``10gbit`` -> bits per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for suffix, scale in units.items():
        if rate.endswith(suffix) and rate[:-len(suffix)].replace(".", "", 1).isdigit():
            return float(rate[:-len(suffix)]) * scale
    raise ValueError(f"link rate must look like 100mbit or 1gbit, got {rate!r}")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _kill_processes_in(namespace: str) -> None:
    """SIGKILL whatever still runs in ``namespace`` (ranks and daemons of a launch that
    timed out); deleting a namespace does not end its processes."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout.split()
    for pid in map(int, pids):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def network_name_prefixes() -> tuple[str, str]:
    """The prefixes of the names of every namespace (``hvdc-<pid>-``) and root-namespace
    link (``hv<pid>``) that :func:`emulated_hosts` creates in this process."""
    tag = f"{os.getpid() % 100000}"
    return f"hvdc-{tag}-", f"hv{tag}"


def host_namespace(i: int) -> str:
    """The namespace of emulated host ``i``."""
    return f"{network_name_prefixes()[0]}{i}"


@contextmanager
def emulated_hosts(count: int, rate: str) -> Iterator[list[str]]:
    """``count`` namespaces joined by a bridge, each link throttled to ``rate``; yields
    their addresses (host ``i`` lives in namespace :func:`host_namespace` ``(i)``).

    The bridge lives in a namespace of its own (``hvdc-<pid>-sw``), so the hosts' traffic
    never passes the machine's own firewall: with ``br_netfilter`` loaded and a
    ``FORWARD`` policy of ``DROP`` (as Docker sets), a bridge in the root namespace would
    silently drop it. The root namespace (where ``mpirun`` runs) joins the bridge through
    an unthrottled link that carries only the launcher's control traffic.
    """
    namespace_prefix, link_prefix = network_name_prefixes()
    subnet = f"10.213.{os.getpid() % 200 + 20}"
    switch, bridge, uplink = f"{namespace_prefix}sw", "br0", f"{link_prefix}up"
    burst = max(int(rate_bits(rate) / 8 / 250), 16 << 10)  # one 4 ms tick, at least 16 KiB
    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", "100ms"]
    namespaces = [switch]
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", switch, "link", "set", bridge, "up")
        _ip("link", "add", uplink, "type", "veth", "peer", "name", "root", "netns", switch)
        _ip("-n", switch, "link", "set", "root", "master", bridge, "up")
        _ip("addr", "add", f"{subnet}.254/24", "dev", uplink)
        _ip("link", "set", uplink, "up")
        addresses = []
        for i in range(count):
            ns, port = host_namespace(i), f"host{i}"
            _ip("netns", "add", ns)
            namespaces.append(ns)
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", switch, "link", "set", port, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{subnet}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            for where, device in ((switch, port), (ns, "eth0")):
                subprocess.run(["tc", "-n", where, "qdisc", "add", "dev", device, "root",
                                *tbf], check=True, capture_output=True, text=True)
            addresses.append(f"{subnet}.{i + 1}")
        yield addresses
    finally:
        for ns in namespaces:
            _kill_processes_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", uplink], capture_output=True)


def _agent_script(directory: Path, addresses: Sequence[str]) -> Path:
    """The ``plm_rsh_agent`` mpirun calls as ``agent HOST COMMAND...``.

    Each emulated host gets a ``TMPDIR`` of its own, as a real host has its own ``/tmp``:
    OpenMPI's daemons keep their session directories there, named after the host name,
    which all namespaces share.
    """
    cases = []
    for i, address in enumerate(addresses):
        (directory / f"host{i}").mkdir()
        cases.append(f'    {address}) ns={host_namespace(i)}; tmp={directory / f"host{i}"} ;;')
    script = directory / "netns-agent.sh"
    script.write_text(f"""#!/bin/sh
host="$1"; shift
case "$host" in
{chr(10).join(cases)}
    *) echo "unknown emulated host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" env TMPDIR="$tmp" sh -c "$*"
""")
    script.chmod(0o755)
    return script


def run(layers: str, schemes: Sequence[str], rate: str, steps: int, ring: bool = True,
        ranks: int = 2, timeout: float = 1800) -> list[Row]:
    """Launch the ranks on emulated hosts; returns one row per scheme. ``ring=False``
    leaves the all-reduce algorithm to OpenMPI's default choice.

    A launch still running after ``timeout`` seconds is aborted by ``mpirun --timeout``,
    which prints the state of its daemons and ranks; each rank writes its Python stacks to
    a file shortly before that (a file, because the throttled link may still be busy).
    Both appear in the error raised.
    """
    if os.geteuid() != 0:
        raise SystemExit("the link benchmark needs root (network namespaces and tc)")
    with tempfile.TemporaryDirectory(prefix="hvdc-link-") as tmp, \
            emulated_hosts(ranks, rate) as addresses:
        subnet = addresses[0].rsplit(".", 1)[0] + ".0/24"
        out, log = Path(tmp) / "rows.json", Path(tmp) / "mpirun.log"
        mpi_timeout = max(int(timeout), 10)
        returncode = run_mpirun(
            ["-np", str(ranks), "--host", ",".join(f"{a}:1" for a in addresses),
             "--mca", "plm_rsh_agent", str(_agent_script(Path(tmp), addresses)),
             "--mca", "plm_rsh_no_tree_spawn", "1", "--mca", "routed", "direct",
             *NO_TOPOLOGY_SHMEM,
             "--mca", "oob_tcp_if_include", subnet, "--mca", "btl", "self,tcp",
             "--mca", "btl_tcp_if_include", subnet,
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
