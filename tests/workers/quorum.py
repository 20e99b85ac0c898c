"""One worker of tests/test_ps_quorum*.py: top-k through a parameter server with a quorum.

Gradients are integer-valued, so every sum, aggregate and residual is exact in float32
and the conservation law ``sum of gradients == sum of aggregates + residual`` (summed
over workers) can be checked with ``==``. Run as a script
(``python -m tests.workers.quorum ADDRESS RANK SIZE STEPS OUT``) or call :func:`run`.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hvd_compress.bench.stragglers import SparseOnly
from hvd_compress.comm.parameter_server import (
    DEFAULT_PARTIAL,
    ParameterServerCommunicator,
    skip_behind,
)
from hvd_compress.comm.ps_client import PSClient
from hvd_compress.comm.ps_transport.base import PartialSum
from hvd_compress.pipeline import Pipeline
from hvd_compress.schemes.topk import TopK

SHAPE = (64, 64)
RATIO = 0.05


class Recording(ParameterServerCommunicator):
    """Keeps, per round, the contributors and the pairs this worker had refused."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.rounds: list[tuple[int, int]] = []  # (contributors, refused pairs)

    def wait(self, handle: Any) -> Any:
        result = super().wait(handle)
        if isinstance(result, PartialSum):
            refused = 0 if result.refused is None else int(result.refused.sum())
            self.rounds.append((min(result.contributors), refused))
        else:
            self.rounds.append((self.size, 0))
        return result


def gradient(rank: int, step: int) -> torch.Tensor:
    """Worker ``rank``'s gradient at ``step``: integers in [-50, 50]."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(-50, 51, SHAPE, generator=gen).float()


def run(address: str, rank: int, size: int, steps: int,
        before_step: Callable[[int], None] = lambda step: None,
        skip: bool = False, partial: str = DEFAULT_PARTIAL) -> dict[str, Any]:
    """Train-free steps: each pushes ``gradient(rank, step)`` through top-k and the server
    at ``address`` (raw sums: no average; ``partial`` as the communicator takes it, by
    default its default). With ``skip``, the steps of rounds
    that closed without this worker compute nothing (no ``before_step``, no gradient:
    :func:`~hvd_compress.comm.parameter_server.skip_behind`) and exchange zeros. Returns
    the sum of the gradients computed, of aggregates, the residual, every aggregate's
    bytes (for replica identity), per round (contributors, refused pairs), and the steps
    skipped."""
    client = PSClient(address, rank, timeout=60, retry_timeout=60)
    comm = Recording(SparseOnly(rank, size), client, "quorum-test", partial=partial)
    pipeline = Pipeline(TopK(RATIO), comm, average=False)
    grads = torch.zeros(SHAPE)
    applied = torch.zeros(SHAPE)
    aggregates = []

    def exchange(g: torch.Tensor) -> None:
        total = pipeline.reduce({"w": g})["w"]
        applied.add_(total)
        aggregates.append(total.numpy().tobytes())

    skipped = 0

    def skip_step() -> None:
        nonlocal skipped
        skipped += 1
        exchange(torch.zeros(SHAPE))

    try:
        batches = skip_behind(range(steps), comm, skip_step) if skip else range(steps)
        for step in batches:
            before_step(step)
            g = gradient(rank, step)
            grads += g
            exchange(g)
    finally:
        client.close()
    residual = pipeline.feedback.get("w")
    return {"grads": grads.numpy(), "applied": applied.numpy(),
            "residual": np.zeros(SHAPE, np.float32) if residual is None else
            residual.numpy().reshape(SHAPE), "aggregates": aggregates,
            "rounds": comm.rounds, "skipped": skipped}


def run_in_threads(address: str, size: int, steps: int,
                   before_step: Callable[[int, int], None] = lambda rank, step: None,
                   skip: bool = False, partial: str = DEFAULT_PARTIAL
                   ) -> dict[int, dict[str, Any]]:
    """:func:`run` for ranks ``0..size-1``, each on its own thread (``before_step`` takes
    the rank and the step); each finished rank's result, by rank."""
    results: dict[int, dict[str, Any]] = {}

    def work(rank: int) -> None:
        results[rank] = run(address, rank, size, steps, lambda s: before_step(rank, s), skip,
                            partial)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def main(argv: list[str]) -> None:
    address, rank, size, steps, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    pause = float(argv[5]) if len(argv) > 5 else 0.0
    skip = len(argv) > 6 and argv[6] == "skip"

    def progress(step: int) -> None:
        print(f"step {step}", flush=True)
        time.sleep(pause)

    result = run(address, rank, size, steps, progress, skip)
    np.savez(out, grads=result["grads"], applied=result["applied"],
             residual=result["residual"], rounds=np.array(result["rounds"]),
             skipped=result["skipped"],
             aggregates=np.array([np.frombuffer(a, np.float32) for a in result["aggregates"]]))
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
