"""The ``fuzz`` campaign: generated broken requests, none accepted that should not be
(see :mod:`hvd_compress.bench.reliability`)."""

from __future__ import annotations

import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from hvd_compress.bench.reliability.common import (
    exact_sum,
    is_exact,
    push_pairs,
    servers,
)
from hvd_compress.ps_protocol import GRPC_SERVICE
from hvd_compress.sparse_wire import HEADER_BYTES, Kind, decode_frame, encode_frame

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


