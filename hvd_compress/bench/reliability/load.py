"""The ``load`` campaign: many workers over 2 shards, every sum exact and every push
counted once (see :mod:`hvd_compress.bench.reliability`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from hvd_compress.bench.launch import ROOT, process_env
from hvd_compress.bench.reliability.common import (
    exact_sum,
    is_exact,
    push_pairs,
    servers,
)


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


