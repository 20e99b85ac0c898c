"""What the reliability campaigns share: server processes, deterministic pushes with
their exact sums, a training loop of real clients and the judgement of a trial."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import numpy as np

from hvd_compress.bench.launch import ROOT, process_env

READY = re.compile(r"serving shard \d+/\d+ on \S+:(\d+) ")
SUMMARY = re.compile(r"stopped: (\d+) rounds closed, (\d+) failed; (\d+) pushes accepted")
NUMEL, PAIRS = 4000, 64
"""The fault and security trials' tensors: 4,000 elements, 64 pairs per push."""


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


def tally(name: str, trials: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for t in trials:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    failed = sum(n for k, n in counts.items() if k not in ("exact", "stopped"))
    print(f"  {name:<28} {len(trials)} trials: "
          + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
          + (f"  <-- {failed} FAILED" if failed else ""), flush=True)
    return {"trials": trials, "tally": counts, "failed": failed}



def fresh(work: Path, name: str) -> Path:
    path = work / name
    path.mkdir(parents=True, exist_ok=True)
    return path

