"""What a parameter-server shard holds and writes as its tensor count grows, in-process.

For 50 and 2,000 tensors (4,400 elements each, top-k mode, 2 workers pushing 44 pairs,
checkpoints on): the bytes the store holds, the process's RSS, the journal record of one
round of one tensor and its median push-to-answer time, a full snapshot's size and time,
and what is left after the session expires. Run as ``python scripts/ps_memory.py``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from hvd_compress.sparse_wire import Kind, encode_frame
from ps_server.service import ShardService
from ps_server.store import ShardStore

NUMEL, PAIRS, WORKERS = 4400, 44, 2


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def measure(tensors: int) -> str:
    clock = [0.0]
    store = ShardStore(WORKERS, 0, 1, "topk", 60.0, clock=lambda: clock[0],
                       idle_timeout=3600.0)
    directory = Path(tempfile.mkdtemp())
    service = ShardService(store, str(directory), checkpoint_every=10**9)
    service.restore()
    rng = np.random.default_rng(0)
    start = rss_mb()

    def one_round(name: str, r: int) -> float:
        began = time.perf_counter()
        for w in range(WORKERS):
            idx = np.sort(rng.choice(NUMEL, PAIRS, replace=False))
            service.push(encode_frame(Kind.PUSH, name, 0, 1, r, w, NUMEL, idx,
                                      rng.standard_normal(PAIRS).astype(np.float32)), "m")
        service.pull(encode_frame(Kind.PULL, name, 0, 1, r, 0, NUMEL), "m", 5.0)
        return time.perf_counter() - began

    for t in range(tensors):
        one_round(f"job/t{t}", 0)
    held, grown = store.held_bytes(), rss_mb() - start
    written, writes = service.journal_bytes, service.writes
    seconds = statistics.median(one_round("job/t0", r) for r in range(1, 51))
    record = (service.journal_bytes - written) / (service.writes - writes)
    began = time.perf_counter()
    service.save_checkpoint()
    snapshot_s = time.perf_counter() - began
    snapshot_b = (directory / "shard-0-of-1.npz").stat().st_size
    before_expiry = rss_mb()
    clock[0] = 4000.0
    service.tick()
    service.close()
    return (f"{tensors} tensors: store holds {held / 1e6:.1f} MB (RSS +{grown:.1f} MB); one "
            f"round of one tensor: median {seconds * 1e3:.2f} ms, journal record "
            f"{record:.0f} B; full snapshot {snapshot_b / 1e6:.2f} MB in "
            f"{snapshot_s * 1e3:.0f} ms; after the session expired: {len(store.tensors)} "
            f"tensors, {store.held_bytes()} B held, RSS {before_expiry - start:+.1f} -> "
            f"{rss_mb() - start:+.1f} MB from the start")


if __name__ == "__main__":
    for count in (50, 2000):
        print(measure(count), flush=True)
