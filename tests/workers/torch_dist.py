"""One rank of tests/test_torch_dist.py: the pipeline over ``torch.distributed`` alone.

``python -m tests.workers.torch_dist OUT BACKEND SPECS_JSON`` with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set: every scheme of ``SPECS_JSON`` runs a few steps of
rank-specific gradients through :class:`~hvd_compress.pipeline.Pipeline` on a
:class:`~hvd_compress.comm.torch_dist.TorchDistCommunicator` of ``BACKEND`` (``gloo`` on CPU
tensors, ``nccl`` on this rank's GPU) with no fallback, and the aggregates are saved to
``OUT/rank<r>.pt``. Horovod and TensorFlow are made unimportable first, so this runs on a
machine that has torch alone (the GPU check's).
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
from typing import Any

BLOCKED = ("horovod", "tensorflow", "keras")

SHAPES = {"conv": (16, 3, 3, 3), "fc": (64, 96), "bias": (64,), "big": (300, 40)}
"""Backward order: the plan's buckets and the fused collectives follow it."""


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked: the torch.distributed path must not need it")


def gradients(step: int, rank: int, device: Any) -> dict[str, Any]:
    """This rank's gradients at ``step``: drawn on the CPU (the same numbers on every
    device), then moved."""
    import torch

    gen = torch.Generator().manual_seed(1000 * step + 17 * rank + 1)
    return {name: torch.randn(shape, generator=gen).to(device) for name, shape in SHAPES.items()}


def exchange_all(comm: Any, specs: list[str], device: Any, steps: int = 3
                 ) -> dict[str, list[dict[str, Any]]]:
    """Per scheme, each step's averaged aggregates (on the CPU) on this rank."""
    from hvd_compress import Compression, Pipeline, Policy

    out: dict[str, list[dict[str, Any]]] = {}
    for spec in specs:
        # Small buckets: several buckets, each fusing its members' rounds.
        pipeline = Pipeline(Compression.parse(spec), comm, Policy(min_numel=1, compress_1d=True),
                            bucket_bytes=40_000)
        pipeline.plan(list(SHAPES), [s for s in SHAPES.values()], device)
        rows = []
        for step in range(steps):
            for name, grad in gradients(step, comm.rank, device).items():
                pipeline.submit(name, grad)
            result = pipeline.wait()
            assert all(r.device == grad.device for r in result.values()), spec
            rows.append({name: r.cpu() for name, r in result.items()})
        out[spec] = rows
    return out


def main() -> None:
    sys.meta_path.insert(0, _Blocker())
    out_dir, backend, specs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    import torch
    import torch.distributed as dist

    from hvd_compress.comm.torch_dist import TorchDistCommunicator

    rank = int(os.environ["RANK"])
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    try:
        comm = TorchDistCommunicator()
        result = exchange_all(comm, specs, device)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not loaded, f"imported {loaded}"
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
