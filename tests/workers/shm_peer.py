"""Rank-side half of tests/test_hierarchy_shm.py's crash test: a local rank of a host of
``size`` that opens the shared-memory communicator (exchanging setup objects through files
in a directory, not Horovod), reports its segment name, then all-gathers until it fails.

Usage: ``python -m tests.workers.shm_peer DIR RANK SIZE``; prints ``ready`` once set up and
``error: <message>`` when a collective fails."""

from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any

import torch

from hvd_compress.comm import shm
from hvd_compress.comm.ops import AllGather


def file_exchange(directory: str, rank: int, size: int) -> Any:
    """An all-gather of picklable objects through files (one per call and rank)."""
    calls = [0]

    def exchange(obj: Any) -> list[Any]:
        calls[0] += 1
        path = os.path.join(directory, f"{calls[0]}.{{}}")
        with open(path.format(rank) + ".tmp", "wb") as f:
            pickle.dump(obj, f)
        os.rename(path.format(rank) + ".tmp", path.format(rank))
        deadline = time.monotonic() + 30
        while not all(os.path.exists(path.format(r)) for r in range(size)):
            if time.monotonic() > deadline:
                raise TimeoutError("peers did not arrive")
            time.sleep(0.01)
        out = []
        for r in range(size):
            with open(path.format(r), "rb") as f:
                out.append(pickle.load(f))
        return out

    return exchange


def main() -> None:
    directory, rank, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    comm = shm.open_host(rank, size, 0, file_exchange(directory, rank, size), required=True,
                         capacity=4096)
    assert comm is not None
    x = torch.full((3000,), float(rank))
    comm.wait(comm.start("first", AllGather("h", x)))
    print("ready", flush=True)
    try:
        while True:
            comm.wait(comm.start("loop", AllGather("h", x)))
    except RuntimeError as exc:
        print(f"error: {exc}", flush=True)


if __name__ == "__main__":
    main()
