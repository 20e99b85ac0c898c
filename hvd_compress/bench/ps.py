"""Parameter-server aggregation throughput: (index, value) pairs summed per second.

Every measurement uses one sparse tensor of ``numel`` elements where each simulated worker
pushes ``density * numel`` random pairs (fp32 values, delta+varint indices) per round, for
``rounds`` timed rounds after one untimed warm-up round (it registers the tensor and
connects). Per (shards, workers) pair, over each transport:

* ``grpc``: real server processes (``python -m ps_server``, one per shard, on loopback)
  and one client thread per worker sending pre-encoded frames over gRPC: push, then pull
  the aggregate (not decoded: the client's cost is kept out of the figure). Throughput is
  pairs pushed per wall-clock second divided by the number of server processes; the
  server processes' CPU seconds are reported beside it, since clients and servers share
  this machine's cores.
* ``grpc, no work``: the same clients against servers that do no work
  (:mod:`hvd_compress.bench.null_server`: same gRPC settings; pushes answered unread,
  pulls at once with a payload the size of the real aggregate): what gRPC alone can move
  on this machine, measured beside each ``grpc`` row.
* ``mpi``: one MPMD ``mpirun`` on this machine (OpenMPI's default transports, shared
  memory here): one worker rank per simulated worker sending the same pre-encoded frames
  through :meth:`~hvd_compress.comm.ps_transport.mpi.MPIPSClient.exchange`, and one
  ``python -m ps_server --transport mpi`` rank per shard. Worker 0 times the rounds between
  two barriers of the workers, and reads the server ranks' CPU seconds.
* ``in-process``: the same frames through one shard's request handling
  (:class:`ps_server.service.ShardService`: decode, hold, sum at the close, encode the
  aggregate once) called directly on one thread: the aggregation code without transport.
  Each round's CPU time is measured alone (the thread's, so time preempted by other
  processes does not count), and beside it a memcpy of the round's bytes (its pushes and
  one aggregate): the row gives the fastest of each and their ratio, and the medians.

Every row has a ``mode`` (the server's ``--mode``: ``union`` pulls the union of all pushes,
``topk`` a re-sparsified top-k of it with the server's residual, ``gtopk`` the top-k of the
sum with the residual on the workers, see :mod:`ps_server.rounds`), the bytes each worker
pulls per round against the bytes it pushes (``pull_vs_push``), the server's CPU time per
pair, and on gRPC rows the ratio of pairs per server CPU-second to the no-work row of the
same mode and worker count (``vs_no_work``). Above 8 workers a configuration runs
``max(2, rounds * 8 // workers)`` rounds, so each moves about as many pairs.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import psutil

from hvd_compress.bench.launch import process_env, run_mpirun
from hvd_compress.bench.report import Column, Row, Target, field, optional_field
from hvd_compress.comm.base import poll_until
from hvd_compress.comm.ps_client import GRPC_SERVICE, MPIPSClient, shard_bounds
from hvd_compress.sparse_wire import Kind, decode_frame, encode_frame
from ps_server.service import ShardService
from ps_server.store import MODES, ShardStore

TENSOR = "bench.ps"
READY = re.compile(r"serving shard \d+/\d+ on (\S+) ")
TRANSPORT_ONLY = "grpc, no work"

COLUMNS = [
    Column("transport", field("transport")),
    Column("mode", field("mode")),
    Column("shards", field("shards")),
    Column("workers", field("workers")),
    Column("pairs/round", field("pairs_per_round", "{:,}")),
    Column("rounds", field("rounds")),
    Column("wall s", field("seconds", "{:.3f}")),
    Column("pulled B/worker/round", optional_field("pull_bytes_per_worker", "{:,.0f}")),
    Column("pull / push", optional_field("pull_vs_push", "{:.2f}")),
    Column("server ns/pair", optional_field("server_ns_per_pair", "{:.2f}")),
    Column("memcpy ns/pair", optional_field("memcpy_ns_per_pair", "{:.2f}")),
    Column("vs memcpy", optional_field("vs_memcpy", "{:.1f}")),
    Column("M pairs/s per server", field("mpairs_per_s_per_server", "{:.2f}")),
    Column("M pairs per server cpu s", optional_field("mpairs_per_server_cpu_s", "{:.2f}")),
    Column("vs no work", optional_field("vs_no_work", "{:.2f}")),
    Column("server faults/round", optional_field("server_faults_per_round", "{:.0f}")),
    Column("server switches/round", optional_field("server_switches_per_round", "{:.0f}")),
]
TARGETS = [
    Target({"transport": "grpc"}, "mpairs_per_server_cpu_s", ">=", 60.0),
    Target({"transport": "in-process", "workers": 2}, "server_ns_per_pair", "<=", 6.0),
    *(Target({"transport": "grpc", "mode": mode, "workers": 8}, "vs_no_work", ">=", 0.8)
      for mode in MODES),
    *(Target({"transport": "grpc", "mode": mode, "workers": w}, "pull_vs_push", "<=", 1.25)
      for mode in ("topk", "gtopk") for w in (8, 32)),
]
"""The goals (docs/parameter-server.md): pairs per CPU-second of the server processes over
gRPC, the figure that holds when clients and servers share the machine's cores (pairs per
wall second do not), at least 0.8 of the no-work ceiling at 8 workers; the server's own
work at most 6 ns per pair in-process; top-k pulls (either top-k mode) at most 1.25x one
worker's push."""


def title(numel: int, density: float, rounds: int, modes: Sequence[str] = ("union",)) -> str:
    return (f"Parameter-server throughput: one tensor of {numel:,} elements, density "
            f"{density:g}, {rounds} rounds, {' and '.join(modes)} mode, fp32 values (pairs "
            f"pushed by all workers per second, per server process)")


def rounds_for(workers: int, rounds: int) -> int:
    """Rounds timed with ``workers`` workers: fewer above 8, for about as many pairs."""
    return rounds if workers <= 8 else max(2, rounds * 8 // workers)


def worker_frames(worker: int, shards: int, numel: int, density: float, rounds: int,
                  seed: int = 0) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """``pushes[r][s]`` and ``pulls[r][s]``: one worker's encoded frames for every round
    and shard (random supports, drawn from a generator seeded with ``(seed, worker)``)."""
    rng = np.random.default_rng([seed, worker])
    k = max(1, int(density * numel))
    bounds = shard_bounds(numel, shards)
    pushes, pulls = [], []
    for r in range(rounds):
        idx = np.sort(rng.choice(numel, k, replace=False))
        val = rng.standard_normal(k).astype(np.float32)
        cuts = np.searchsorted(idx, bounds)
        pushes.append([
            encode_frame(Kind.PUSH, TENSOR, s, shards, r, worker, bounds[s + 1] - bounds[s],
                         idx[cuts[s]:cuts[s + 1]] - bounds[s], val[cuts[s]:cuts[s + 1]])
            for s in range(shards)])
        pulls.append([
            encode_frame(Kind.PULL, TENSOR, s, shards, r, worker, bounds[s + 1] - bounds[s])
            for s in range(shards)])
    return pushes, pulls


def make_frames(workers: int, shards: int, numel: int, density: float, rounds: int,
                seed: int = 0) -> tuple[list[list[list[bytes]]], list[list[list[bytes]]]]:
    """``pushes[w][r][s]`` and ``pulls[w][r][s]``: :func:`worker_frames` of every worker."""
    frames = [worker_frames(w, shards, numel, density, rounds, seed) for w in range(workers)]
    return [pushes for pushes, _ in frames], [pulls for _, pulls in frames]


def _row(transport: str, shards: int, workers: int, pairs_per_round: int, rounds: int,
         seconds: float, server_cpu: float | None, mode: str = "union",
         push_bytes: float | None = None, pull_bytes: float | None = None) -> Row:
    pairs = pairs_per_round * rounds
    return {
        "transport": transport, "mode": mode, "shards": shards, "workers": workers,
        "pairs_per_round": pairs_per_round, "rounds": rounds, "seconds": seconds,
        "server_cpu_seconds": server_cpu,
        "mpairs_per_s_per_server": pairs / seconds / shards / 1e6,
        "mpairs_per_server_cpu_s": None if not server_cpu else pairs / server_cpu / 1e6,
        "server_ns_per_pair": None if not server_cpu else server_cpu / pairs * 1e9,
        "push_bytes_per_worker": push_bytes, "pull_bytes_per_worker": pull_bytes,
        "pull_vs_push": None if not push_bytes or pull_bytes is None
        else pull_bytes / push_bytes,
        "memcpy_ns_per_pair": None, "vs_memcpy": None, "vs_no_work": None,
    }


def _round_bytes(pushes: list[list[list[bytes]]], r: int) -> tuple[float, int]:
    """One worker's push bytes in round ``r`` (the mean over workers, all shards) and the
    bytes of all pushes of that round."""
    sizes = [sum(map(len, worker[r])) for worker in pushes]
    return sum(sizes) / len(sizes), sum(sizes)


def measure_in_process(workers: int, numel: int, density: float, rounds: int,
                       mode: str = "union") -> Row:
    """One shard's request handling, called directly (see the module docstring)."""
    pushes, pulls = make_frames(workers, 1, numel, density, 1 + rounds)
    service = ShardService(ShardStore(workers, 0, 1, mode))
    pulled: list[int] = []

    def run_round(r: int) -> None:
        for w in range(workers):
            service.push(pushes[w][r][0], "bench")
        for w in range(workers):
            pulled.append(len(service.pull(pulls[w][r][0], "bench", timeout=60.0)))

    run_round(0)  # warm-up: registers the tensor
    times, copies = [], []
    source = np.zeros(_round_bytes(pushes, 1)[1] + pulled[-1], np.uint8)
    target = np.empty_like(source)
    cpu = time.process_time()
    walls = []
    for r in range(1, 1 + rounds):  # this thread's CPU time: not the time it was preempted
        start, wall = time.thread_time(), time.perf_counter()
        run_round(r)
        times.append(time.thread_time() - start)
        walls.append(time.perf_counter() - wall)
        start = time.thread_time()  # the same bytes copied, beside it
        np.copyto(target, source)
        copies.append(time.thread_time() - start)
    cpu = time.process_time() - cpu
    k = max(1, int(density * numel))
    row = _row("in-process", 1, workers, workers * k, rounds, sum(walls), cpu, mode,
               _round_bytes(pushes, 1)[0], float(np.mean(pulled[workers:])))
    # CPU time of the fastest round against the fastest copy (the medians beside them): on
    # a loaded machine, the rounds least slowed by other processes sharing the caches.
    pairs = workers * k
    row.update(server_ns_per_pair=min(times) / pairs * 1e9,
               memcpy_ns_per_pair=min(copies) / pairs * 1e9,
               vs_memcpy=min(times) / min(copies),
               median_ns_per_pair=float(np.median(times)) / pairs * 1e9,
               median_memcpy_ns_per_pair=float(np.median(copies)) / pairs * 1e9)
    return row


class ServerProcesses:
    """One server process per command (``python -m <module> <args>``), each logging to a
    file; ``prefix`` goes before each command (``ip netns exec ...`` to start it on an
    emulated host). ``addresses`` are the ones the servers said they serve on."""

    def __init__(self, commands: list[list[str]], prefix: Sequence[str] = ()) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="hvdc-bench-ps-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.addresses: list[str] = []
        env = process_env()
        try:
            for s, command in enumerate(commands):
                log = Path(self.dir.name) / f"shard{s}.log"
                with log.open("wb") as out:
                    self.procs.append(subprocess.Popen([*prefix, sys.executable, "-m",
                                                        *command],
                                                       stdout=out, stderr=subprocess.STDOUT,
                                                       env=env))
                self.addresses.append(self._wait_ready(self.procs[-1], log))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _wait_ready(proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> str:
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            text = log.read_text(errors="replace")
            if match := READY.search(text):
                return match.group(1)
            if proc.poll() is not None:
                raise RuntimeError(f"parameter server exited with {proc.returncode}:\n{text}")
            time.sleep(0.1)
        raise RuntimeError(f"parameter server not ready within {timeout} s:\n"
                           + log.read_text(errors="replace"))

    def cpu_seconds(self) -> float:
        """CPU seconds of the server processes so far: the sum of their threads' run times
        in nanoseconds (``/proc/<pid>/task/*/schedstat``) where Linux gives them, else
        :mod:`psutil`'s (in clock ticks of 10 ms, too coarse for a short run)."""
        total = 0.0
        for proc in self.procs:
            precise = _schedstat_seconds(proc.pid)
            if precise is None:
                times = psutil.Process(proc.pid).cpu_times()
                precise = times.user + times.system
            total += precise
        return total

    def events(self) -> tuple[int, int] | None:
        """Minor page faults and context switches (voluntary and not) of the server
        processes' threads so far, from ``/proc``; None where Linux does not give them."""
        faults = switches = 0
        try:
            for proc in self.procs:
                faults += int(Path(f"/proc/{proc.pid}/stat").read_text()
                              .rpartition(")")[2].split()[7])
                for task in Path(f"/proc/{proc.pid}/task").iterdir():
                    for line in (task / "status").read_text().splitlines():
                        if "ctxt_switches:" in line:
                            switches += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return faults, switches

    def close(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.dir.cleanup()


def _schedstat_seconds(pid: int) -> float | None:
    """The run time of every thread of ``pid`` (nanosecond counters), or None."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def aggregate_nbytes(pushes: list[list[list[bytes]]], round: int, shard: int,
                    mode: str = "union") -> int:
    """Size of the aggregate frame the server answers for this round and shard in
    ``mode`` (rounds up to ``round`` run through an in-process shard)."""
    first = decode_frame(pushes[0][0][shard])
    service = ShardService(ShardStore(len(pushes), shard, first.shards, mode))
    for r in range(round + 1):
        for worker in pushes:
            service.push(worker[r][shard], "bench")
        pull = encode_frame(Kind.PULL, TENSOR, shard, first.shards, r, 0, first.numel)
        answer = service.pull(pull, "bench", timeout=60.0)
    return len(answer)


def measure_grpc(shards: int, workers: int, numel: int, density: float, rounds: int,
                 transport_only: bool = False, mode: str = "union") -> Row:
    """Server processes over gRPC, or with ``transport_only`` servers that do no work
    (see the module docstring)."""
    import grpc

    pushes, pulls = make_frames(workers, shards, numel, density, 1 + rounds)
    if transport_only:
        commands = [["hvd_compress.bench.null_server", "--reply-bytes",
                     str(aggregate_nbytes(pushes, 1, s, mode)), "--workers", str(workers)]
                    for s in range(shards)]
    else:
        commands = [["ps_server", "--bind", "127.0.0.1:0", "--workers", str(workers),
                     "--shard", f"{s}/{shards}", "--deadline", "600", "--mode", mode,
                     "--max-message-mb", "512"] for s in range(shards)]
    servers = ServerProcesses(commands)
    options = [("grpc.max_send_message_length", 512 << 20),
               ("grpc.max_receive_message_length", 512 << 20)]
    channels = [[grpc.insecure_channel(a, options=options) for a in servers.addresses]
                for _ in range(workers)]
    errors: list[BaseException] = []
    pulled = [0] * workers  # bytes of the timed rounds' answers

    def worker(w: int, barrier: threading.Barrier) -> None:
        push = [c.unary_unary(f"/{GRPC_SERVICE}/Push") for c in channels[w]]
        pull = [c.unary_unary(f"/{GRPC_SERVICE}/Pull") for c in channels[w]]
        try:
            for r in range(1 + rounds):  # round 0 warms up, before the barrier
                if r == 1:
                    barrier.wait()
                for s in range(shards):
                    push[s](pushes[w][r][s], timeout=600)
                for s in range(shards):
                    answer = pull[s](pulls[w][r][s], timeout=600)
                    pulled[w] += len(answer) if r else 0
        except BaseException as err:  # reported by the caller
            errors.append(err)
            barrier.abort()

    try:
        for w in range(workers):  # connect before timing
            for channel in channels[w]:
                grpc.channel_ready_future(channel).result(timeout=30)
        barrier = threading.Barrier(workers + 1)
        threads = [threading.Thread(target=worker, args=(w, barrier)) for w in range(workers)]
        for t in threads:
            t.start()
        barrier.wait()  # every worker has finished the warm-up round
        cpu_before, events_before = servers.cpu_seconds(), servers.events()
        start = time.perf_counter()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - start
        cpu, events_after = servers.cpu_seconds() - cpu_before, servers.events()
    finally:
        for row in channels:
            for channel in row:
                channel.close()
        servers.close()
    if errors:
        raise RuntimeError(f"a simulated worker failed: {errors[0]!r}") from errors[0]
    k = max(1, int(density * numel))
    push_bytes = float(np.mean([_round_bytes(pushes, r)[0] for r in range(1, 1 + rounds)]))
    row = _row(TRANSPORT_ONLY if transport_only else "grpc", shards, workers, workers * k,
               rounds, seconds, cpu, mode, push_bytes, sum(pulled) / workers / rounds)
    if events_before is not None and events_after is not None:
        row["server_faults_per_round"] = (events_after[0] - events_before[0]) / rounds
        row["server_switches_per_round"] = (events_after[1] - events_before[1]) / rounds
    return row


def measure_mpi(shards: int, workers: int, numel: int, density: float, rounds: int,
                timeout: int = 900) -> Row:
    """Server ranks of one MPMD ``mpirun`` (see the module docstring)."""
    with tempfile.TemporaryDirectory(prefix="hvdc-bench-ps-mpi-") as tmp:
        out, log = Path(tmp) / "timing.json", Path(tmp) / "mpirun.log"
        returncode = run_mpirun(
            ["-np", str(workers), sys.executable, "-m", "hvd_compress.bench.ps",
             "--out", str(out), "--shards", str(shards), "--numel", str(numel),
             "--density", str(density), "--rounds", str(rounds),
             ":", "-np", str(shards), sys.executable, "-m", "ps_server", "--transport", "mpi",
             "--workers", str(workers), "--deadline", "600"],
            timeout, log)
        if returncode != 0 or not out.exists():
            raise RuntimeError(f"the MPI measurement failed (mpirun exit code {returncode})"
                               f"; its output:\n{log.read_text()[-8000:]}")
        timing = json.loads(out.read_text())
    k = max(1, int(density * numel))
    return _row("mpi", shards, workers, workers * k, rounds, timing["seconds"],
                timing["server_cpu_seconds"])


def mpi_worker_main(argv: Sequence[str] | None = None) -> None:
    """One simulated worker rank of :func:`measure_mpi`: pre-encoded frames through
    :meth:`MPIPSClient.exchange`; worker 0 times the rounds and the server ranks' CPU
    (its siblings under ``mpirun``) and writes them to ``--out``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    for name in ("--shards", "--numel", "--rounds"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--density", type=float, required=True)
    args = parser.parse_args(argv)

    client = MPIPSClient()
    pushes, pulls = worker_frames(client.worker, args.shards, args.numel, args.density,
                                  1 + args.rounds)
    servers = [p for p in psutil.Process().parent().children()
               if "ps_server" in p.cmdline()] if client.worker == 0 else []

    def cpu_seconds() -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in servers))

    def all_workers_here() -> None:  # a blocking barrier would spin a core
        request = client.comm.Ibarrier()
        poll_until(request.Test)

    for r in range(1 + args.rounds):  # round 0 warms up, untimed
        if r == 1:
            all_workers_here()
            cpu_before, start = cpu_seconds(), time.perf_counter()
        client.exchange(TENSOR, r, "push", pushes[r])
        client.exchange(TENSOR, r, "pull", pulls[r])
    all_workers_here()
    if client.worker == 0:
        args.out.write_text(json.dumps({"seconds": time.perf_counter() - start,
                                        "server_cpu_seconds": cpu_seconds() - cpu_before}))
    client.close()


TRANSPORTS = ("in-process", "grpc", "mpi")


def run(workers_list: Sequence[int], shards_list: Sequence[int], numel: int,
        density: float, rounds: int, modes: Sequence[str] = ("union",),
        transports: Sequence[str] = TRANSPORTS) -> list[Row]:
    """The rows of every (transport, mode, shards, workers); gRPC rows side by side with
    the no-work ceiling of the same configuration (see the module docstring)."""
    for given, known, what in ((transports, TRANSPORTS, "transports"),
                               (modes, MODES, "modes")):
        if set(given) - set(known):
            raise ValueError(f"{what} must be among {', '.join(known)}, got "
                             f"{', '.join(sorted(set(given) - set(known)))}")
    rows = []
    if "in-process" in transports:
        rows += [measure_in_process(w, numel, density, rounds_for(w, rounds), mode)
                 for mode in modes for w in workers_list]
    for s in shards_list:
        for w in workers_list:
            n = rounds_for(w, rounds)
            for mode in modes:  # side by side: the server, then the transport alone
                if "grpc" in transports:
                    real = measure_grpc(s, w, numel, density, n, mode=mode)
                    ceiling = measure_grpc(s, w, numel, density, n, True, mode)
                    if real["mpairs_per_server_cpu_s"] and ceiling["mpairs_per_server_cpu_s"]:
                        real["vs_no_work"] = (real["mpairs_per_server_cpu_s"]
                                              / ceiling["mpairs_per_server_cpu_s"])
                    rows += [real, ceiling]
                if "mpi" in transports and mode == "union":
                    rows.append(measure_mpi(s, w, numel, density, n))
    return rows


if __name__ == "__main__":
    mpi_worker_main()
