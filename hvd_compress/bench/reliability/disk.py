"""The ``disk`` campaign: the server's checkpoint disk fills up, then space comes back
(see :mod:`hvd_compress.bench.reliability`).

One server (2 workers, mode union) keeps its checkpoint on a small tmpfs. Per fault, a
file fills the tmpfs up to :data:`KEEP` bytes while 2 workers (threads, each with the real
gRPC client) push both tensors every round; the journal soon cannot grow. Measured: the
time from the server's first failed write (its log line) to health ``NOT_SERVING`` (seen by
a poller) and to each worker's error, and whether that error names the cause; then the
file is deleted, and measured is the time until health is ``SERVING`` again. The workers go
on from the round each had not finished; every aggregate they apply must be the exact sum
and the same on both. At the end the journal must hold every round of both tensors once,
each with its exact sum: no round lost, none counted twice.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from hvd_compress.bench.reliability.common import (
    NUMEL,
    TENSORS,
    Server,
    digest,
    exact_sum,
    is_exact,
    push_pairs,
)

WORKERS = 2
KEEP = 96 << 10
"""Bytes left free on the tmpfs when a fault starts (a round of both tensors journals
about 3 KB)."""
LIMIT_S = 10.0
"""A fault passes when its health change and both workers' errors come this soon after
the failed write, and health is SERVING again this soon after space is freed."""
TMPFS = "4m"


def disk_faults(work: Path, faults: int, seed: int = 600) -> dict[str, Any]:
    """``faults`` full-disk episodes against one server on a tmpfs; skipped without root."""
    if os.geteuid() != 0:
        print("  disk faults skipped: they need root to mount tmpfs", flush=True)
        return {"skipped": "needs root to mount tmpfs"}
    mount = work / "disk"
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS}", "tmpfs", str(mount)],
                   check=True)
    try:
        return _campaign(work, mount, faults, seed)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _campaign(work: Path, mount: Path, faults: int, seed: int) -> dict[str, Any]:
    ckpt = mount / "ckpt"
    srv = Server(["--workers", str(WORKERS), "--checkpoint-dir", str(ckpt), "--deadline",
                  "60", "--checkpoint-every", "1000000"], work / "server.log")
    trials: list[dict[str, Any]] = []
    rounds = [0] * WORKERS
    clients = _clients(srv.address)
    try:
        for i in range(faults):
            trial = _fault(srv, mount, seed, rounds, clients)
            trials.append(trial)
            rounds = trial.pop("next_rounds")
            print(f"  fault {i + 1}: {_line(trial)}", flush=True)
        journal = _journal_check(ckpt, seed, min(rounds))
    finally:
        for client in clients:
            client.close()
        srv.stop()
        srv.kill()
    passed = sum(t["ok"] for t in trials)
    report = {"faults": faults, "passed": passed, "trials": trials, "journal": journal,
              "tmpfs": TMPFS, "keep_bytes": KEEP}
    for key in ("to_not_serving_s", "to_client_error_s", "to_serving_s"):
        values = [t[key] for t in trials if t.get(key) is not None]
        if values:
            report[key] = {"min": min(values), "max": max(values)}
    verdict = journal["problem"] or "every one once, exact"
    print(f"  {passed}/{faults} faults surfaced within {LIMIT_S:g} s and recovered; journal: "
          f"{journal['rounds']} rounds of each tensor, {verdict}", flush=True)
    return report


def _line(trial: dict[str, Any]) -> str:
    return (f"{'ok' if trial['ok'] else 'FAILED'}: NOT_SERVING after "
            f"{trial.get('to_not_serving_s')} s, client errors after "
            f"{trial.get('to_client_error_s')} s (cause named: {trial['cause_named']}), "
            f"SERVING {trial.get('to_serving_s')} s after space was freed"
            + (f"; {trial['problem']}" if trial["problem"] else ""))


def _clients(address: str) -> list[Any]:
    """One client per worker for the whole campaign: each stays its worker's process
    (:mod:`ps_server.identity`), as in a job that waits out the fault."""
    from hvd_compress.comm.ps_client import PSClient

    return [PSClient(address, w, workers=WORKERS, timeout=60.0, retry_timeout=60.0,
                     connect_timeout=30.0) for w in range(WORKERS)]


def _fault(srv: Server, mount: Path, seed: int, rounds: list[int], clients: list[Any]
           ) -> dict[str, Any]:
    """One episode: fill, train until the workers stop, free, train 3 more rounds."""
    from ps_server.healthcheck import check

    offset = len(srv.text())
    filler = mount / "filler"
    _fill(filler, KEEP)
    health = _HealthPoller(srv.address, check)
    results = _run_workers(clients, seed, rounds, until_error=True)
    failed_at = _first_failure(srv.text()[offset:])
    errors = [r["error"] for r in results]
    trial: dict[str, Any] = {"rounds_before": [r["next"] for r in results],
                             "cause_named": all(e is not None and "No space left" in e["message"]
                                                for e in errors),
                             "problem": ""}
    freed = time.time()
    filler.unlink()
    serving = health.wait_for("SERVING", LIMIT_S * 3)
    health.stop()
    if failed_at is not None:
        if health.first_not_serving is not None:
            trial["to_not_serving_s"] = round(health.first_not_serving - failed_at, 2)
        if all(e is not None for e in errors):
            trial["to_client_error_s"] = round(max(e["at"] for e in errors) - failed_at, 2)
    if serving is not None:
        trial["to_serving_s"] = round(serving - freed, 2)
    after = _run_workers(clients, seed, [r["next"] for r in results], extra=3)
    trial["next_rounds"] = [r["next"] for r in after]
    trial["error_sample"] = errors[0]["message"][:300] if errors[0] else None
    trial["problem"] = _problem(trial, failed_at, results + after)
    trial["ok"] = not trial["problem"]
    return trial


def _problem(trial: dict[str, Any], failed_at: float | None,
             results: list[dict[str, Any]]) -> str:
    if failed_at is None:
        return "no failed write in the server's log"
    for key in ("to_not_serving_s", "to_client_error_s", "to_serving_s"):
        if trial.get(key) is None or trial[key] > LIMIT_S:
            return f"{key} missing or over {LIMIT_S:g} s"
    if not trial["cause_named"]:
        return "a worker's error does not name the cause"
    if any(not ok for r in results for *_, ok in r["applied"]):
        return "an applied aggregate was not the exact sum"
    seen: dict[tuple[int, str], set[int]] = {}
    for r in results:
        for round, tensor, value, _ in r["applied"]:
            seen.setdefault((round, tensor), set()).add(value)
    if any(len(values) > 1 for values in seen.values()):
        return "the workers applied different aggregates"
    if any(r["error"] is not None for r in results[WORKERS:]):
        return "a worker failed after recovery"
    return ""


def _fill(path: Path, keep: int) -> None:
    """Write zeros to ``path`` until ``keep`` bytes are left on its file system."""
    chunk = b"\0" * (64 << 10)
    with open(path, "ab") as f:
        while shutil.disk_usage(path.parent).free > keep + len(chunk):
            f.write(chunk)
            f.flush()


def _first_failure(log: str) -> float | None:
    """The Unix time of the first failed checkpoint write in ``log`` (the server's lines
    start with the local time, to the millisecond)."""
    for line in log.splitlines():
        if " ERROR " in line and "write failed" in line:
            stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            return stamp.timestamp()
    return None


class _HealthPoller:
    """Polls the server's health every 50 ms from a thread; notes the first time it was
    NOT_SERVING and each status change."""

    def __init__(self, address: str, check: Any) -> None:
        self.first_not_serving: float | None = None
        self.status = "?"
        self.changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(address, check),
                                        daemon=True)
        self._thread.start()

    def _poll(self, address: str, check: Any) -> None:
        while not self._stop.wait(0.05):
            try:
                status = check(address, timeout=2.0)
            except Exception as err:  # an unreachable server is a status like any other here
                status = type(err).__name__
            with self.changed:
                if status == "NOT_SERVING" and self.first_not_serving is None:
                    self.first_not_serving = time.time()
                self.status = status
                self.changed.notify_all()

    def wait_for(self, status: str, timeout: float) -> float | None:
        """The time ``status`` was seen after a NOT_SERVING, or None after ``timeout``."""
        with self.changed:
            ok = self.changed.wait_for(lambda: self.first_not_serving is not None
                                       and self.status == status, timeout)
            return time.time() if ok else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _run_workers(clients: list[Any], seed: int, first: list[int], until_error: bool = False,
                 extra: int = 0) -> list[dict[str, Any]]:
    """Both workers from their round ``first[w]``: until one fails (``until_error``, at
    most 2,000 rounds) or for ``extra`` rounds past the furthest of them."""
    end = max(first) + (2000 if until_error else extra)
    out: list[dict[str, Any]] = [{} for _ in range(WORKERS)]
    threads = [threading.Thread(target=lambda w=w: out.__setitem__(
        w, _worker(clients[w], w, seed, first[w], end)), daemon=True) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _worker(client: Any, worker: int, seed: int, first: int, end: int) -> dict[str, Any]:
    """Rounds ``first`` to ``end`` of both tensors (started together, as the optimizer
    does); what was applied and the error that stopped it."""
    import torch

    from hvd_compress.comm.ps_client import PSError

    applied, error, r = [], None, first
    try:
        for r in range(first, end):
            pending = [client.start(t, r, NUMEL, *map(torch.from_numpy,
                                                      push_pairs(seed, t, r, worker)))
                       for t in TENSORS]
            for t, p in zip(TENSORS, pending):
                got = client.finish(p)
                applied.append((r, t, digest(got), is_exact(got, exact_sum(seed, t, r,
                                                                          WORKERS))))
        r = end
    except PSError as err:
        error = {"code": err.code, "round": err.round, "message": str(err), "at": time.time()}
    return {"applied": applied, "error": error, "next": r}


def _journal_check(ckpt: Path, seed: int, rounds: int) -> dict[str, Any]:
    """Whether the journal holds rounds 0 to ``rounds - 1`` of each tensor once, each the
    exact sum."""
    from ps_server import checkpoint

    config = {"workers": WORKERS, "shard": 0, "shards": 1, "mode": "union"}
    path = checkpoint.journal_path(checkpoint.path_for(ckpt, 0, 1), 1)
    changes, torn = checkpoint.read_journal(path, config)
    problem = "" if not torn else f"{torn} torn bytes"
    for tensor in TENSORS:
        mine = [c for c in changes if c.tensor == tensor]
        got = [c.round for c in mine]
        if len(got) < rounds or got != list(range(len(got))):
            problem = f"{tensor}: journaled rounds {got}, expected 0, 1, ... {rounds - 1}"
            break
        failed = [c for c in mine if c.error is not None]
        if failed:
            problem = f"{tensor}: round {failed[0].round} failed: {failed[0].error[:200]}"
            break
        if not all(is_exact((c.indices, c.values), exact_sum(seed, tensor, c.round, WORKERS))
                   for c in mine):
            problem = f"{tensor}: a journaled sum is not exact"
            break
    return {"rounds": rounds, "records": len(changes), "torn_bytes": torn,
            "problem": problem}
