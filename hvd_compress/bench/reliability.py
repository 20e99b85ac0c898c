"""``python -m hvd_compress.bench.reliability [fuzz|faults|load|security|all] --json OUT``:
the parameter server's reliability campaign against live ``python -m ps_server`` processes.

Each part prints its figures and the whole run is written as JSON to ``OUT``:

fuzz
    ``--requests`` (100,000) generated requests over gRPC: valid push and pull frames with
    flipped bytes, truncated, extended, header fields rewritten with the CRC recomputed
    (so the frame passes the checksum and reaches the field checks), random bytes, frames
    sent to the wrong method and calls of methods that do not exist. Counted: server
    crashes (checked every 5,000 requests and at the end), hangs (a call that outlives its
    timeout), requests answered OK although the client-side reference decoder or the job's
    shape says they are invalid ("accepted invalid"), and the server's RSS. Afterwards
    a clean round on a tensor that only ever received broken frames, and one on a fresh
    tensor, must sum exactly.
faults
    ``--trials`` (10) trials of each fault, 2 workers x 2 tensors, integer-valued pushes
    (so any sum counted twice or missed shows): a worker SIGKILLed mid-round; the server
    SIGKILLed at a random round and restarted on its port from its checkpoint; the server
    killing itself at each step of the close and checkpoint sequence
    (``$HVD_COMPRESS_PS_FAULT``, at a random occurrence) and restarted; the server stopped
    (SIGSTOP) for longer than ``--deadline``; a lossy and a stalled link (the server on an
    emulated host, :mod:`hvd_compress.bench.hosts`: a token bucket too small for the
    bursts, or the interface down for seconds; needs root, skipped otherwise). A
    trial passes when every worker applied only exact sums, the workers' aggregates are
    identical round for round, and either every worker finished or every surviving one
    stopped with an error (the job stopped cleanly); it fails when a replica diverged, a
    sum was wrong, or a worker hung.
load
    ``--workers`` (64 and 128) workers x ``--rounds`` (1,000) rounds x 2 shards: worker
    ids spread over 4 processes of one thread and one real gRPC client per id. Checked:
    every aggregate is the exact sum, and each server's count of accepted pushes is
    exactly workers x rounds (none lost, none counted twice); reported: each server's RSS
    at start and end, and the percentiles of a worker's round time (its push to its
    aggregate).
security
    No token, a wrong token, a replay of a closed round's push (by a call without
    identity, so refused: its worker is bound), a second different push
    for the same (worker, round) from clients without identity, impersonation (another
    process, with its own client, and a raw call without identity, pushing as a worker
    bound to a running client, in a round that worker has not pushed yet: both refused,
    the first before its body is read, and the round still the exact sum of the real
    workers' pushes), eight 100 MB unauthenticated pushes at once (the server's peak RSS
    measured), a worker id out of range, and TLS misconfigured both ways (wrong CA, TLS
    to a plain server), with the time each TLS error took.

Run it niced on a shared machine (``nice -n 10``); the latencies are measured under
whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from hvd_compress.bench.launch import ROOT, process_env
from hvd_compress.ps_protocol import GRPC_SERVICE, token_metadata
from hvd_compress.sparse_wire import HEADER_BYTES, Kind, decode_frame, encode_frame

READY = re.compile(r"serving shard \d+/\d+ on \S+:(\d+) ")
SUMMARY = re.compile(r"stopped: (\d+) rounds closed, (\d+) failed; (\d+) pushes accepted")
NUMEL, PAIRS = 4000, 64
"""The fault and security trials' tensors: 4,000 elements, 64 pairs per push."""
PARTS = ("fuzz", "faults", "load", "security")


# Servers ------------------------------------------------------------------------------------
class Server:
    """``python -m ps_server --bind HOST:PORT ARGS`` logging to a file; ``prefix`` goes
    before the command (``ip netns exec NS`` for an emulated host)."""

    def __init__(self, args: list[str], log: Path, port: int = 0, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> None:
        self.args, self.log, self.host, self.env, self.prefix = args, log, host, env, prefix
        self.port = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.start(env)

    def start(self, env: dict[str, str] | None = None) -> None:
        """(Re)start on the same port, appending to the log; waits until it serves."""
        with self.log.open("ab") as out:
            offset = out.tell()
            self.proc = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "ps_server", "--bind",
                 f"{self.host}:{self.port}", *self.args], cwd=ROOT, stdout=out,
                stderr=subprocess.STDOUT, env={**process_env(), **(env or {})},
                start_new_session=True)
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            text = self.log.read_bytes()[offset:].decode(errors="replace")
            if match := READY.search(text):
                self.port = int(match.group(1))
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"parameter server did not start:\n{self.text()[-3000:]}")

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def memory_mb(self) -> dict[str, float]:
        """VmRSS and VmHWM (peak) of the server process, in MB."""
        values = {}
        with open(f"/proc/{self.proc.pid}/status") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    values["rss_mb" if key == "VmRSS" else "peak_mb"] = \
                        round(int(rest.split()[0]) / 1024, 1)
        return values

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> tuple[int, int, int] | None:
        """SIGTERM, then the (closed, failed, accepted pushes) of its last summary line."""
        if self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        found = SUMMARY.findall(self.text())
        return tuple(map(int, found[-1])) if found else None


@contextmanager
def servers(work: Path, *specs: tuple[str, list[str], dict[str, Any]]) -> Iterator[list[Server]]:
    """Start one :class:`Server` per ``(name, args, keywords)``; kill them all at exit."""
    started: list[Server] = []
    try:
        for name, args, kw in specs:
            started.append(Server(args, work / f"{name}.log", **kw))
        yield started
    finally:
        for server in started:
            server.kill()


# Deterministic pushes and their exact sums ----------------------------------------------------
def push_pairs(seed: int, tensor: str, round: int, worker: int, numel: int = NUMEL,
               pairs: int = PAIRS) -> tuple[np.ndarray, np.ndarray]:
    """Worker ``worker``'s pairs for ``round``: distinct indices, small integer values, so
    sums are exact in float32 whatever the order and a push counted twice shows."""
    rng = np.random.default_rng([seed, zlib.crc32(tensor.encode()), round, worker])
    idx = np.sort(rng.choice(numel, pairs, replace=False)).astype(np.int64)
    return idx, rng.integers(-8, 9, pairs).astype(np.float32)


def exact_sum(seed: int, tensor: str, round: int, workers: int, numel: int = NUMEL,
              pairs: int = PAIRS) -> tuple[np.ndarray, np.ndarray]:
    """The union of every worker's indices and the sums there (what mode ``union``
    answers)."""
    dense = np.zeros(numel, np.float32)
    seen = np.zeros(numel, bool)
    for w in range(workers):
        idx, val = push_pairs(seed, tensor, round, w, numel, pairs)
        dense[idx] += val
        seen[idx] = True
    support = np.flatnonzero(seen)
    return support, dense[support]


def is_exact(got: tuple[Any, Any], want: tuple[np.ndarray, np.ndarray]) -> bool:
    idx, val = (np.asarray(x) for x in got)
    return np.array_equal(idx, want[0]) and np.array_equal(val, want[1])


def digest(got: tuple[Any, Any]) -> int:
    idx, val = (np.ascontiguousarray(np.asarray(x)) for x in got)
    return zlib.crc32(val.tobytes(), zlib.crc32(idx.tobytes()))


# Fault trials ------------------------------------------------------------------------------
TENSORS = ("job/a", "job/b")


class Progress:
    """Rounds finished by worker 0, for faults aimed at a round."""

    def __init__(self) -> None:
        self.round = -1
        self.changed = threading.Condition()

    def advance(self, round: int) -> None:
        with self.changed:
            self.round = round
            self.changed.notify_all()

    def wait_for(self, round: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.round >= round, timeout)


def train(address: str, worker: int, rounds: int, seed: int, progress: Progress | None = None,
          workers: int = 2, **client: Any) -> dict[str, Any]:
    """Both tensors started, then finished, every round (as the optimizer does). Returns
    per applied round the digest of each tensor's aggregate and whether it was exact, and
    the error that stopped it, if any."""
    import torch

    from hvd_compress.comm.ps_client import PSClient, PSError

    kw = {"timeout": 60.0, "retry_timeout": 60.0, "connect_timeout": 30.0, **client}
    c = PSClient(address, worker, workers=workers, **kw)
    applied, error = [], None
    began = time.monotonic()
    try:
        for r in range(rounds):
            pending = [c.start(t, r, NUMEL, *map(torch.from_numpy,
                                                 push_pairs(seed, t, r, worker)))
                       for t in TENSORS]
            row = []
            for t, p in zip(TENSORS, pending):
                got = c.finish(p)
                row.append((digest(got), is_exact(got, exact_sum(seed, t, r, workers))))
            applied.append(row)
            if progress is not None and worker == 0:
                progress.advance(r)
    except PSError as err:
        error = {"code": err.code, "tensor": err.tensor, "round": err.round,
                 "message": str(err)[:400], "after_s": round(time.monotonic() - began, 2)}
    finally:
        c.close()
    return {"applied": applied, "error": error}


def judge(results: list[dict[str, Any] | None], rounds: int) -> tuple[str, str]:
    """A trial's outcome: ``exact`` (everyone finished, all exact and identical),
    ``stopped`` (every surviving worker stopped with an error, everything applied exact and
    identical), or a failure: ``wrong-sum``, ``diverged``, ``hung``, ``partial-stop``."""
    alive = [r for r in results if r is not None]
    if any(r.get("hung") for r in alive):
        return "hung", "a worker did not finish within the trial's time limit"
    for r in alive:
        for row in r["applied"]:
            if not all(ok for _, ok in row):
                return "wrong-sum", f"an applied aggregate was not the exact sum: {row}"
    common = min(len(r["applied"]) for r in alive)
    for i in range(common):
        if len({tuple(d for d, _ in r["applied"][i]) for r in alive}) > 1:
            return "diverged", f"workers applied different aggregates in round {i}"
    finished = [len(r["applied"]) == rounds and r["error"] is None for r in alive]
    if all(finished):
        return "exact", ""
    if not any(finished):
        errors = sorted({f"{r['error']['code']} at round {r['error']['round']}"
                         for r in alive if r["error"]})
        return "stopped", "; ".join(errors)
    return "partial-stop", "some workers finished while others stopped"


def run_threads(jobs: list[Callable[[], dict[str, Any]]], limit: float
                ) -> list[dict[str, Any]]:
    """Run ``jobs`` in threads; one still running after ``limit`` s is marked hung."""
    out: list[dict[str, Any] | None] = [None] * len(jobs)

    def run(i: int) -> None:
        out[i] = jobs[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, limit))
    return [r if r is not None else {"hung": True, "applied": [], "error": None} for r in out]


def _tally(name: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    failed = sum(n for k, n in counts.items() if k not in ("exact", "stopped"))
    print(f"  {name:<28} {len(trials)} trials: "
          + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
          + (f"  <-- {failed} FAILED" if failed else ""), flush=True)
    return {"trials": trials, "tally": counts, "failed": failed}


def worker_kill_trial(work: Path, seed: int, rounds: int) -> dict[str, Any]:
    """Worker 1 is a process SIGKILLed after a random number of rounds plus a random
    delay (often mid-push or mid-pull); worker 0 must stop with one clear error."""
    rng = random.Random(seed)
    deadline = 3.0
    with servers(work, ("wk", ["--workers", "2", "--deadline", str(deadline)], {})) as (srv,):
        victim = subprocess.Popen(
            [sys.executable, "-m", "hvd_compress.bench.reliability", "_worker", srv.address,
             "1", str(rounds), str(seed)], cwd=ROOT, env=process_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        if victim.stdout.readline().strip() != "ready":  # its imports take seconds
            raise RuntimeError("the worker process failed to start")
        victim.stdin.write("go\n")
        victim.stdin.flush()
        progress = Progress()
        box: list[dict[str, Any]] = []
        thread = threading.Thread(target=lambda: box.append(
            train(srv.address, 0, rounds, seed, progress)), daemon=True)
        thread.start()
        at = rng.randint(3, rounds // 2)
        progress.wait_for(at, 120)
        time.sleep(rng.uniform(0, 0.02))
        victim.kill()
        killed = time.monotonic()
        victim.wait()
        thread.join(deadline + 60)
        result = box[0] if box else {"hung": True, "applied": [], "error": None}
    outcome, detail = judge([result], rounds)
    if outcome == "exact":
        outcome, detail = "wrong-sum", "worker 0 finished although worker 1 was killed"
    error = result.get("error") or {}
    return {"seed": seed, "killed_after_round": at, "outcome": outcome, "detail": detail,
            "error_code": error.get("code"),
            "error_s_after_kill": round(time.monotonic() - killed, 2) if error else None,
            "names_worker_1": "worker 1 did not push" in error.get("message", "")}


def worker_main(argv: list[str]) -> None:
    """``_worker ADDRESS WORKER ROUNDS SEED``: one worker of :func:`train` as a process;
    prints ``ready`` once imported and starts when a line comes on its standard input."""
    import torch  # noqa: F401 (the import that takes seconds, before ready)

    address, worker, rounds, seed = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    print("ready", flush=True)
    sys.stdin.readline()
    print(json.dumps(train(address, worker, rounds, seed)), flush=True)


def server_kill_trial(work: Path, seed: int, rounds: int, fault: str | None) -> dict[str, Any]:
    """The server dies (SIGKILL from here at a random round, or by itself at ``fault`` =
    ``STEP:N``) and is restarted on its port 1 s later from its checkpoint."""
    rng = random.Random(seed)
    args = ["--workers", "2", "--deadline", "30", "--checkpoint-dir", str(work / "ckpt"),
            "--checkpoint-every", "5"]
    with servers(work, ("sk", args, {"env": {"HVD_COMPRESS_PS_FAULT": fault} if fault
                                     else None})) as (srv,):
        progress = Progress()
        stop = threading.Event()
        restarts = [0]
        at = rng.randint(2, rounds - 3)

        def killer() -> None:
            if fault is None and progress.wait_for(at, 120):
                time.sleep(rng.uniform(0, 0.01))
                srv.signal(signal.SIGKILL)
            while not stop.is_set():
                if not srv.alive():
                    srv.proc.wait()
                    time.sleep(1.0)
                    srv.start()
                    restarts[0] += 1
                stop.wait(0.05)

        watcher = threading.Thread(target=killer, daemon=True)
        watcher.start()
        results = run_threads([lambda w=w: train(srv.address, w, rounds, seed, progress)
                               for w in range(2)], 240)
        stop.set()
        watcher.join()
        resumed = srv.text().count("resumed from")
    outcome, detail = judge(results, rounds)
    if not restarts[0]:
        outcome, detail = "not-reached", "the server was never killed"
    return {"seed": seed, "fault": fault or f"SIGKILL after round {at}", "outcome": outcome,
            "detail": detail, "restarts": restarts[0], "resumed": resumed}


def freeze_trial(work: Path, seed: int, rounds: int) -> dict[str, Any]:
    """The server is stopped (SIGSTOP) for 1.5 to 3 times its 2 s deadline at a random
    round, then continued."""
    rng = random.Random(seed)
    deadline = 2.0
    with servers(work, ("fr", ["--workers", "2", "--deadline", str(deadline)], {})) as (srv,):
        progress = Progress()
        at, frozen = rng.randint(2, rounds - 3), rng.uniform(1.5, 3.0) * deadline

        def freezer() -> None:
            if progress.wait_for(at, 120):
                srv.signal(signal.SIGSTOP)
                time.sleep(frozen)
                srv.signal(signal.SIGCONT)

        threading.Thread(target=freezer, daemon=True).start()
        results = run_threads([lambda w=w: train(srv.address, w, rounds, seed, progress)
                               for w in range(2)], 180)
        srv.signal(signal.SIGCONT)
        moved = "deadlines move by as much" in srv.text()
    outcome, detail = judge(results, rounds)
    return {"seed": seed, "frozen_s": round(frozen, 2), "after_round": at,
            "outcome": outcome, "detail": detail, "server_saw_freeze": moved}


def link_trials(work: Path, trials: int, rounds: int) -> list[dict[str, Any]]:
    """The server on an emulated host. Even trials: its link is a token bucket of 1 Mbit/s
    whose queue holds 2 ms (``tbf ... latency 2ms``), so bursts lose packets (counted by
    the kernel and reported); odd trials: its interface goes down for 1-4 s at a random
    round (a stalled link: every packet meanwhile is lost). (``netem`` would be the usual
    tool; this kernel has no ``sch_netem``, so the loss comes from the token bucket.)"""
    from hvd_compress.bench.hosts import INTERFACE, emulated_hosts, host_namespace

    out = []
    with emulated_hosts(1, "1gbit") as addresses:
        ns = host_namespace(0)

        def shape(*tbf: str) -> None:
            subprocess.run(["tc", "-n", ns, "qdisc", "change", "dev", INTERFACE, "root",
                            "tbf", *tbf], check=True, capture_output=True)

        def dropped() -> int:
            text = subprocess.run(["tc", "-n", ns, "-s", "qdisc", "show", "dev", INTERFACE],
                                  capture_output=True, text=True).stdout
            return sum(map(int, re.findall(r"dropped (\d+)", text)))

        for trial in range(trials):
            seed = 9000 + trial
            rng = random.Random(seed)
            kw = {"host": addresses[0], "prefix": ("ip", "netns", "exec", ns)}
            with servers(work, (f"net{trial}", ["--workers", "2", "--deadline", "5"], kw)
                         ) as (srv,):
                progress = Progress()
                drops = dropped()
                if trial % 2 == 0:
                    what = "tbf 1mbit, 2 ms queue (lossy)"
                    shape("rate", "1mbit", "burst", "2kb", "latency", "2ms")
                else:
                    at, stall = rng.randint(2, rounds - 3), rng.uniform(1.0, 4.0)
                    what = f"link down {stall:.1f} s after round {at}"

                    def staller(at: int = at, stall: float = stall,
                                progress: Progress = progress) -> None:
                        if progress.wait_for(at, 120):
                            subprocess.run(["ip", "-n", ns, "link", "set", INTERFACE, "down"],
                                           check=True)
                            time.sleep(stall)
                            subprocess.run(["ip", "-n", ns, "link", "set", INTERFACE, "up"],
                                           check=True)

                    threading.Thread(target=staller, daemon=True).start()
                results = run_threads(
                    [partial(train, srv.address, w, rounds, seed, progress, timeout=30.0,
                             retry_timeout=30.0) for w in range(2)], 240)
                drops = dropped() - drops
                shape("rate", "1gbit", "burst", "500kb", "latency", "100ms")
            outcome, detail = judge(results, rounds)
            out.append({"seed": seed, "link": what, "outcome": outcome, "detail": detail,
                        "packets_dropped": drops})
    return out


def faults(work: Path, trials: int, rounds: int) -> dict[str, Any]:
    from ps_server.checkpoint import FAULT_STEPS

    print("faults (2 workers x 2 tensors, integer-valued pushes):", flush=True)
    report: dict[str, Any] = {}
    report["worker_kill"] = _tally("worker SIGKILL mid-round", [
        worker_kill_trial(_fresh(work, f"wk{i}"), 100 + i, rounds) for i in range(trials)])
    report["server_kill_random"] = _tally("server SIGKILL + restart", [
        server_kill_trial(_fresh(work, f"sk{i}"), 200 + i, rounds, None)
        for i in range(trials)])
    for step in FAULT_STEPS:
        rng = random.Random(step)
        top = 4 if step.startswith("snapshot") else 25
        report[f"server_kill_at_{step}"] = _tally(f"server killed at {step}", [
            server_kill_trial(_fresh(work, f"{step}{i}"), 300 + i, rounds,
                              f"{step}:{rng.randint(2, top)}") for i in range(trials)])
    report["freeze"] = _tally("server SIGSTOP > deadline", [
        freeze_trial(_fresh(work, f"fr{i}"), 400 + i, rounds) for i in range(trials)])
    if os.geteuid() == 0:
        report["link"] = _tally("lossy / stalled link",
                                link_trials(_fresh(work, "net"), trials, rounds))
    else:
        print("  link trials skipped: they need root (network namespaces)", flush=True)
    return report


def _fresh(work: Path, name: str) -> Path:
    path = work / name
    path.mkdir(parents=True, exist_ok=True)
    return path


# Load --------------------------------------------------------------------------------------
def load_worker_main(argv: list[str]) -> None:
    """``_load ADDRESSES FIRST COUNT WORKERS ROUNDS SEED GO``: worker ids
    FIRST..FIRST+COUNT-1 of a WORKERS-worker job, one thread and one PSClient each. Prints
    ``ready`` once set up, starts when the file GO exists (so no process's start-up is
    counted in another's round times), then prints one JSON line with the round times (ms)
    and the number of rounds that were not exact."""
    import torch

    from hvd_compress.comm.ps_client import PSClient, PSError

    addresses, go = argv[0], Path(argv[6])
    first, count, workers, rounds, seed = map(int, argv[1:6])
    numel, pairs = 20000, 32
    sums: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    lock = threading.Lock()

    def expected(r: int) -> tuple[np.ndarray, np.ndarray]:
        with lock:
            if r not in sums:
                sums[r] = exact_sum(seed, "load/w", r, workers, numel, pairs)
                sums.pop(r - 4, None)
            return sums[r]

    clients = {w: PSClient(addresses, w, workers=workers, timeout=300, retry_timeout=60)
               for w in range(first, first + count)}
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)

    def run(worker: int) -> dict[str, Any]:
        client = clients[worker]
        times, wrong, error = [], 0, None
        try:
            for r in range(rounds):
                idx, val = push_pairs(seed, "load/w", r, worker, numel, pairs)
                began = time.perf_counter()
                got = client.push_pull("load/w", r, numel, torch.from_numpy(idx),
                                       torch.from_numpy(val))
                times.append(round((time.perf_counter() - began) * 1e3, 2))
                wrong += not is_exact(got, expected(r))
        except PSError as err:
            error = str(err)[:300]
        finally:
            client.close()
        return {"times": times, "wrong": wrong, "error": error}

    began = time.monotonic()
    with ThreadPoolExecutor(count) as pool:
        results = list(pool.map(run, range(first, first + count)))
    print(json.dumps({"seconds": time.monotonic() - began,
                      "times": [t for r in results for t in r["times"]],
                      "wrong": sum(r["wrong"] for r in results),
                      "errors": [r["error"] for r in results if r["error"]]}), flush=True)


def load(work: Path, worker_counts: list[int], rounds: int, processes: int = 4
         ) -> dict[str, Any]:
    print(f"load (2 shards, {rounds} rounds, {processes} client processes):", flush=True)
    report = {}
    for workers in worker_counts:
        args = ["--workers", str(workers), "--deadline", "120"]
        with servers(work, *[(f"load{workers}-{s}", [*args, "--shard", f"{s}/2"], {})
                             for s in range(2)]) as shards:
            start_mem = [s.memory_mb() for s in shards]
            spec = "grpc://" + ",".join(s.address for s in shards)
            per = -(-workers // processes)
            go = work / f"go{workers}"
            procs = [subprocess.Popen(
                [sys.executable, "-m", "hvd_compress.bench.reliability", "_load", spec,
                 str(first), str(min(per, workers - first)), str(workers), str(rounds), "5",
                 str(go)], cwd=ROOT, env=process_env(), stdout=subprocess.PIPE, text=True)
                for first in range(0, workers, per)]
            for proc in procs:
                if proc.stdout.readline().strip() != "ready":
                    raise RuntimeError("a load client process failed to start")
            go.touch()
            outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
            wall = max(o["seconds"] for o in outs)
            end_mem = [s.memory_mb() for s in shards]
            summaries = [s.stop() for s in shards]
        times = np.array([t for o in outs for t in o["times"]])
        accepted = [None if s is None else s[2] for s in summaries]
        row = {"workers": workers, "rounds": rounds, "wall_s": round(wall, 1),
               "worker_rounds": int(times.size),
               "not_exact": sum(o["wrong"] for o in outs),
               "errors": [e for o in outs for e in o["errors"]][:5],
               "pushes_accepted": accepted, "pushes_expected": workers * rounds,
               "rounds_failed": [None if s is None else s[1] for s in summaries],
               "rss_start": start_mem, "rss_end": end_mem,
               "round_ms": {f"p{q}": round(float(np.percentile(times, q)), 1)
                            for q in (50, 90, 99)} if times.size else {}}
        row["ok"] = (row["not_exact"] == 0 and not row["errors"] and
                     row["worker_rounds"] == workers * rounds and
                     accepted == [workers * rounds] * 2)
        report[str(workers)] = row
        print(f"  {workers} workers: {row['worker_rounds']} worker-rounds in {wall:.0f} s, "
              f"{row['not_exact']} not exact, accepted pushes {accepted} (expected "
              f"{workers * rounds} each), RSS MB start {[m['rss_mb'] for m in start_mem]} "
              f"end {[m['rss_mb'] for m in end_mem]}, round ms {row['round_ms']}"
              + ("" if row["ok"] else "  <-- FAILED"), flush=True)
    return report


# Fuzz --------------------------------------------------------------------------------------
FUZZ_WORKERS = 2
_METHODS = ("Push", "Pull")


def _with_crc(body: bytes | bytearray) -> bytes:
    return bytes(body[:-4]) + struct.pack("<I", zlib.crc32(bytes(body[:-4])))


def expected_invalid(method: str, data: bytes) -> bool:
    """Whether a request must be refused whatever the server's state: the reference
    decoder refuses it, its kind is not the method's, a pull carries pairs, or its
    worker or shard is outside this 2-worker, 1-shard job. (A frame that passes all this
    may rightly be accepted: a rewritten value is still a valid push.)"""
    if method not in _METHODS:
        return True
    try:
        frame = decode_frame(data)
    except ValueError:
        return True
    kind = Kind.PUSH if method == "Push" else Kind.PULL
    return (frame.kind is not kind or (method == "Pull" and frame.count > 0)
            or frame.worker >= FUZZ_WORKERS or frame.shards != 1 or frame.shard != 0)


def fuzz_case(rng: np.random.Generator, i: int) -> tuple[str, bytes, str]:
    """Request ``i``: (method, bytes, how it was made). Broken frames of tensor
    ``fz/guarded`` never pass the CRC, so it must stay untouched."""
    tensor = "fz/guarded" if i % 3 == 0 else f"fz/t{i % 4}"
    round, worker = int(rng.integers(0, 4)), int(rng.integers(0, FUZZ_WORKERS))
    if rng.random() < 0.5:
        n = int(rng.integers(0, 40))
        idx = np.sort(rng.choice(1000, n, replace=False))
        base = encode_frame(Kind.PUSH, tensor, 0, 1, round, worker, 1000, idx,
                            rng.integers(-3, 4, n).astype(np.float32))
        method = "Push"
    else:
        base = encode_frame(Kind.PULL, tensor, 0, 1, round, worker, 1000)
        method = "Pull"
    data = bytearray(base)
    how = int(rng.integers(0, 7)) if tensor != "fz/guarded" else int(rng.integers(0, 3))
    if how == 0:  # flipped bytes, CRC not fixed
        for at in rng.integers(0, len(data), int(rng.integers(1, 4))):
            data[at] ^= int(rng.integers(1, 256))
        return method, bytes(data), "flipped"
    if how == 1:
        return method, bytes(data[: int(rng.integers(0, len(data)))]), "truncated"
    if how == 2:
        return method, bytes(data + rng.bytes(int(rng.integers(1, 64)))), "extended"
    if how == 3:  # a header field rewritten, CRC recomputed: the field checks must hold
        at = int(rng.integers(4, HEADER_BYTES))
        data[at] = int(rng.integers(0, 256))
        return method, _with_crc(data), "header+crc"
    if how == 4:  # body bytes rewritten, CRC recomputed
        for at in rng.integers(HEADER_BYTES, len(data) - 4 if len(data) > HEADER_BYTES + 4
                               else len(data), int(rng.integers(1, 4))):
            data[at] = int(rng.integers(0, 256))
        return method, _with_crc(data), "body+crc"
    if how == 5:
        return ("Pull" if method == "Push" else "Push"), bytes(data), "wrong-rpc"
    if rng.random() < 0.5:
        return method, rng.bytes(int(rng.integers(0, 300))), "random"
    return str(rng.choice(["Get", "push", "Delete", ""])), bytes(data), "no-such-method"


def fuzz(work: Path, requests: int, threads: int = 8) -> dict[str, Any]:
    import grpc
    import torch

    from hvd_compress.comm.ps_client import PSClient

    print(f"fuzz ({requests:,} requests, {threads} client threads):", flush=True)
    args = ["--workers", str(FUZZ_WORKERS), "--deadline", "2", "--idle-timeout", "600"]
    counts: dict[str, int] = {}
    by_how: dict[str, dict[str, int]] = {}
    accepted_invalid: list[str] = []
    crashes, hangs = 0, 0
    lock = threading.Lock()
    with servers(work, ("fuzz", args, {})) as (srv,):
        mem_start = srv.memory_mb()
        began = time.monotonic()

        def client_thread(t: int, lo: int, hi: int) -> None:
            nonlocal hangs
            with grpc.insecure_channel(srv.address) as channel:
                calls = {m: channel.unary_unary(f"/{GRPC_SERVICE}/{m}")
                         for m in ("Push", "Pull", "Get", "push", "Delete", "")}
                for i in range(lo + t, hi, threads):
                    method, data, how = fuzz_case(np.random.default_rng([11, i]), i)
                    try:
                        calls[method](data, timeout=10)
                        code = "OK"
                    except grpc.RpcError as err:
                        code = err.code().name
                    with lock:
                        counts[code] = counts.get(code, 0) + 1
                        row = by_how.setdefault(how, {})
                        row[code] = row.get(code, 0) + 1
                        if code == "DEADLINE_EXCEEDED" and expected_invalid(method, data):
                            hangs += 1
                        if code == "OK" and expected_invalid(method, data):
                            accepted_invalid.append(f"{how} {method} {data[:64].hex()}")

        done = 0
        step = 5000
        while done < requests and not crashes:
            batch = min(step, requests - done)
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(partial(client_thread, lo=done, hi=done + batch),
                              range(threads)))
            done += batch
            if not srv.alive():
                crashes += 1
        elapsed = time.monotonic() - began
        mem_end = srv.memory_mb()
        # State afterwards: the guarded tensor (only ever sent broken frames) and a fresh one
        clients = [PSClient(srv.address, w, workers=FUZZ_WORKERS, timeout=30)
                   for w in range(FUZZ_WORKERS)]
        clean = {}
        for tensor in ("fz/guarded", "after/fresh"):
            with ThreadPoolExecutor(FUZZ_WORKERS) as pool:
                jobs = [pool.submit(c.push_pull, tensor, 0, 1000,
                                    *map(torch.from_numpy,
                                         push_pairs(3, tensor, 0, w, 1000, 40)))
                        for w, c in enumerate(clients)]
                got = [j.result(timeout=60) for j in jobs]
            want = exact_sum(3, tensor, 0, FUZZ_WORKERS, 1000, 40)
            clean[tensor] = all(is_exact(g, want) for g in got)
        for c in clients:
            c.close()
        alive = srv.alive()
    report = {"requests": sum(counts.values()), "seconds": round(elapsed, 1),
              "codes": counts, "by_mutation": by_how, "crashes": crashes + (not alive),
              "hangs": hangs, "accepted_invalid": len(accepted_invalid),
              "accepted_invalid_examples": accepted_invalid[:5],
              "clean_round_exact": clean, "rss_start": mem_start, "rss_end": mem_end}
    report["ok"] = (not report["crashes"] and not hangs and not accepted_invalid
                    and all(clean.values()))
    print(f"  {report['requests']:,} requests in {elapsed:.0f} s: crashes "
          f"{report['crashes']}, hangs {hangs}, accepted invalid {len(accepted_invalid)}; "
          f"codes {counts}; clean rounds exact {clean}; RSS MB {mem_start['rss_mb']} -> "
          f"{mem_end['rss_mb']}" + ("" if report["ok"] else "  <-- FAILED"), flush=True)
    return report


# Security ----------------------------------------------------------------------------------
def _code(call: Callable[[], Any]) -> str:
    """The gRPC status name a call ends with; a push's answer when it succeeds
    (``OK accepted`` or ``OK duplicate``)."""
    import grpc

    try:
        reply = call()
    except grpc.RpcError as err:
        return err.code().name
    return f"OK {reply.decode()}" if reply in (b"accepted", b"duplicate") else "OK"


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A throw-away EC key and self-signed certificate for ``localhost`` and 127.0.0.1,
    valid one day: ``(key, certificate)`` PEM files ``NAME.key`` and ``NAME.pem``."""
    key, cert = directory / f"{name}.key", directory / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True,
                   capture_output=True)
    return key, cert


def impostor_main(argv: list[str]) -> None:
    """``_impostor ADDRESS TOKEN WORKER TENSOR ROUND``: a process of its own pushing as
    ``WORKER`` with its own client. Prints ``ready`` once imported, pushes when a line
    comes on stdin, then prints ``OK`` or the error's gRPC status name."""
    import torch

    from hvd_compress.comm.ps_client import PSClient, PSError

    address, token, worker, tensor, round = argv
    client = PSClient(address, int(worker), token=token, workers=2, timeout=20,
                      retry_timeout=5)
    print("ready", flush=True)
    sys.stdin.readline()
    try:
        client.push_pull(tensor, int(round), NUMEL, *map(torch.from_numpy, push_pairs(
            77, tensor, int(round), int(worker))))
        print("OK", flush=True)
    except PSError as err:
        print(err.code, flush=True)
    finally:
        client.close()


def impersonation(srv: Server, clients: list[Any], round: int) -> dict[str, Any]:
    """Round ``round`` of ``sec/w``: worker 0 pushes, then another process and a raw call
    without identity push as worker 1 (bound to ``clients[1]``), then worker 1 pushes."""
    import grpc
    import torch

    out: dict[str, Any] = {}
    tensor = "sec/w"
    other = subprocess.Popen([sys.executable, "-m", "hvd_compress.bench.reliability",
                              "_impostor", srv.address, "s3cret-token", "1", tensor,
                              str(round)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True, env=process_env(), cwd=ROOT)
    try:
        ready = other.stdout.readline().strip()  # imports done: the deadline is not spent
        first = clients[0].start(tensor, round, NUMEL, *map(torch.from_numpy,
                                                            push_pairs(1, tensor, round, 0)))
        answer, _ = other.communicate("go\n", timeout=60)
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()
    out["impersonation_other_process"] = (answer.strip() if ready == "ready" else
                                          f"the other process failed ({other.returncode})")
    raw = encode_frame(Kind.PUSH, tensor, 0, 1, round, 1, NUMEL,
                       *push_pairs(99, tensor, round, 1))
    with grpc.insecure_channel(srv.address) as channel:
        out["impersonation_without_identity"] = _code(lambda: channel.unary_unary(
            f"/{GRPC_SERVICE}/Push")(raw, timeout=10, metadata=token_metadata("s3cret-token")))
    second = clients[1].push_pull(tensor, round, NUMEL, *map(torch.from_numpy,
                                                             push_pairs(1, tensor, round, 1)))
    want = exact_sum(1, tensor, round, 2)
    out[f"round_{round}_exact_after_impersonation"] = [
        is_exact(clients[0].finish(first), want), is_exact(second, want)]
    text = srv.text()
    out["impersonation_refused_unread"] = bool(re.search(
        r"WARNING rejected push from \S+ before reading it: worker 1 of session 'sec' .*"
        r"first seen from \S+", text))
    return out


def security(work: Path) -> dict[str, Any]:
    import grpc
    import torch

    from hvd_compress.comm.ps_client import PSClient, PSError

    print("security:", flush=True)
    token = work / "token"
    token.write_text("s3cret-token")
    out: dict[str, Any] = {}
    args = ["--workers", "2", "--deadline", "5", "--token-file", str(token)]
    with servers(work, ("sec", args, {})) as (srv,):
        push = encode_frame(Kind.PUSH, "sec/w", 0, 1, 0, 0, NUMEL,
                            *push_pairs(1, "sec/w", 0, 0))
        with grpc.insecure_channel(srv.address) as channel:
            call = channel.unary_unary(f"/{GRPC_SERVICE}/Push")
            out["no_token"] = _code(lambda: call(push, timeout=10))
            out["wrong_token"] = _code(lambda: call(push, timeout=10,
                                                    metadata=token_metadata("guess")))
        clients = [PSClient(srv.address, w, token="s3cret-token", workers=2, timeout=20)
                   for w in range(2)]

        def round_of(r: int, tensor: str = "sec/w") -> list[bool]:
            with ThreadPoolExecutor(2) as pool:
                jobs = [pool.submit(c.push_pull, tensor, r, NUMEL,
                                    *map(torch.from_numpy, push_pairs(1, tensor, r, w)))
                        for w, c in enumerate(clients)]
                got = [j.result(timeout=60) for j in jobs]
            return [is_exact(g, exact_sum(1, tensor, r, 2)) for g in got]

        out["round_0_exact"] = round_of(0)
        with grpc.insecure_channel(srv.address) as channel:
            call = channel.unary_unary(f"/{GRPC_SERVICE}/Push")
            meta = token_metadata("s3cret-token")
            out["replay_closed_round"] = _code(lambda: call(push, timeout=10, metadata=meta))
            out["round_1_exact_after_replay"] = round_of(1)
            out.update(impersonation(srv, clients, 2))
            # A second, different push for (worker 0, round 0) of a session no client
            # holds, from calls without identity (the content check catches them)
            pushes = [encode_frame(Kind.PUSH, "raw/w", 0, 1, 0, 0, NUMEL,
                                   *push_pairs(seed, "raw/w", 0, 0)) for seed in (1, 99)]
            out["conflicting_push_first_push"] = _code(
                lambda: call(pushes[0], timeout=10, metadata=meta))
            out["conflicting_push_second_sender"] = _code(
                lambda: call(pushes[1], timeout=10, metadata=meta))
            pull = encode_frame(Kind.PULL, "raw/w", 0, 1, 0, 0, NUMEL)
            out["conflicting_push_first_sender"] = _code(lambda: channel.unary_unary(
                f"/{GRPC_SERVICE}/Pull")(pull, timeout=10, metadata=meta))
            bad_worker = encode_frame(Kind.PUSH, "sec/w", 0, 1, 3, 7, NUMEL,
                                      *push_pairs(1, "sec/w", 3, 0))
            out["worker_id_out_of_range"] = _code(
                lambda: call(bad_worker, timeout=10, metadata=meta))
        out["conflict_logged_warning"] = bool(re.search(r"WARNING .*(conflict|different)",
                                                        srv.text(), re.IGNORECASE))
        for c in clients:
            c.close()
        # Eight 100 MB unauthenticated pushes at once
        before = srv.memory_mb()
        big = bytes(100 << 20)

        def send_big() -> str:
            with grpc.insecure_channel(srv.address, options=[
                    ("grpc.max_send_message_length", 256 << 20)]) as channel:
                return _code(lambda: channel.unary_unary(f"/{GRPC_SERVICE}/Push")(
                    big, timeout=120))

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: send_big(), range(8)))
        after = srv.memory_mb()
        out["unauthenticated_8x100MB"] = {"codes": sorted(set(codes)),
                                          "peak_mb_before": before["peak_mb"],
                                          "peak_mb_after": after["peak_mb"],
                                          "peak_growth_mb": round(after["peak_mb"] -
                                                                  before["peak_mb"], 1)}
    # TLS misconfiguration, both ways
    key, cert = self_signed(work, "server")
    _, other_cert = self_signed(work, "other")
    tls_args = ["--workers", "1", "--tls-cert", str(cert), "--tls-key", str(key)]
    with servers(work, ("tls", tls_args, {}), ("plain", ["--workers", "1"], {})) as (tls, plain):
        cases = {"wrong_ca": (f"grpcs://localhost:{tls.port}", other_cert.read_bytes()),
                 "tls_to_plain_server": (f"grpcs://localhost:{plain.port}", cert.read_bytes()),
                 "plain_to_tls_server": (f"grpc://localhost:{tls.port}", None),
                 "right_ca": (f"grpcs://localhost:{tls.port}", cert.read_bytes())}
        for name, (address, ca) in cases.items():
            client = PSClient(address, 0, root_certificates=ca, workers=1, timeout=30,
                              connect_timeout=30, retry_timeout=30)
            began = time.monotonic()
            try:
                client.push_pull("tls/w", 0, 10, torch.tensor([1]), torch.tensor([1.0]))
                result = "OK"
            except PSError as err:
                result = f"{err.code}: {err.detail[:160]}"
            client.close()
            out[f"tls_{name}"] = {"result": result,
                                  "seconds": round(time.monotonic() - began, 2)}
    expect = {"no_token": "UNAUTHENTICATED", "wrong_token": "UNAUTHENTICATED",
              "replay_closed_round": "PERMISSION_DENIED",  # worker 0 is bound
              "conflicting_push_first_push": "OK accepted",
              "conflicting_push_second_sender": "ALREADY_EXISTS",
              "conflicting_push_first_sender": "ABORTED",
              "impersonation_other_process": "PERMISSION_DENIED",
              "impersonation_without_identity": "PERMISSION_DENIED",
              "worker_id_out_of_range": "INVALID_ARGUMENT"}
    problems = [f"{k}: {out[k]} (expected {v})" for k, v in expect.items() if out[k] != v]
    if not all(out["round_0_exact"] + out["round_1_exact_after_replay"] +
               out["round_2_exact_after_impersonation"]):
        problems.append("a round was not exact")
    if not out["impersonation_refused_unread"]:
        problems.append("the other process's push was not refused unread, logged at WARNING "
                        "with the bound worker's first peer")
    if not out["conflict_logged_warning"]:
        problems.append("the conflicting push was not logged at WARNING")
    big = out["unauthenticated_8x100MB"]
    if big["codes"] != ["UNAUTHENTICATED"] or big["peak_growth_mb"] > 100:
        problems.append(f"unauthenticated large pushes: {big}")
    if out["tls_right_ca"]["result"] != "OK":
        problems.append(f"TLS with the right CA failed: {out['tls_right_ca']}")
    for name in ("wrong_ca", "tls_to_plain_server", "plain_to_tls_server"):
        case = out[f"tls_{name}"]
        if case["result"] == "OK" or case["seconds"] > 10:
            problems.append(f"TLS {name}: {case}")
    out["problems"] = problems
    out["ok"] = not problems
    for key, value in out.items():
        if key not in ("problems", "ok"):
            print(f"  {key}: {value}", flush=True)
    print("  " + ("all as expected" if not problems else "FAILED: " + "; ".join(problems)),
          flush=True)
    return out


# Command line ------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        worker_main(argv[1:])
        return 0
    if argv[:1] == ["_load"]:
        load_worker_main(argv[1:])
        return 0
    if argv[:1] == ["_impostor"]:
        impostor_main(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m hvd_compress.bench.reliability",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("parts", nargs="*", default=["all"], choices=(*PARTS, "all"),
                   metavar="PART", help=f"one or more of {', '.join(PARTS)}, or all (default)")
    p.add_argument("--json", type=Path, required=True, metavar="OUT",
                   help="write every figure and trial here")
    p.add_argument("--requests", type=int, default=100_000, help="fuzz requests")
    p.add_argument("--trials", type=int, default=10, help="trials of each fault")
    p.add_argument("--fault-rounds", type=int, default=30, help="rounds of a fault trial")
    p.add_argument("--workers", default="64,128", help="load: worker counts, comma-separated")
    p.add_argument("--rounds", type=int, default=1000, help="load: rounds")
    args = p.parse_args(argv)
    logging.getLogger("hvd_compress.ps_client").setLevel(logging.ERROR)  # retries expected
    parts = PARTS if "all" in args.parts else tuple(dict.fromkeys(args.parts))
    report: dict[str, Any] = {"command": " ".join(sys.argv), "started": time.strftime(
        "%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="hvdc-reliability-") as tmp:
        work = Path(tmp)
        for part in parts:
            began = time.monotonic()
            if part == "fuzz":
                report[part] = fuzz(_fresh(work, part), args.requests)
            elif part == "faults":
                report[part] = faults(_fresh(work, part), args.trials, args.fault_rounds)
            elif part == "load":
                report[part] = load(_fresh(work, part),
                                    [int(n) for n in args.workers.split(",")], args.rounds)
            else:
                report[part] = security(_fresh(work, part))
            report[f"{part}_seconds"] = round(time.monotonic() - began, 1)
            args.json.write_text(json.dumps(report, indent=1, default=str))
    report["load_average_end"] = os.getloadavg()
    args.json.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
