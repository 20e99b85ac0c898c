"""PowerSGD's exchange alone, batched and per tensor, against DDP's ``powerSGD_hook``
alone, in one process and in turn: ``bench overhead``'s "alone" measurement
(``overhead.own_costs``, 5 turns of 20 steps: one backward pass's gradients of each
model, handed over again every step; process CPU per step, median of the turns, after
``OWN_WARMUP`` untimed steps), with the per-tensor path (``batch_tensors = False``, the
code before the batched one) timed beside the batched one, both forms (``alternate`` at
twice the rank).

    python docs/results/powersgd-batched/side_by_side.py --models transformer,cnn,mlp8m \\
        --json docs/results/powersgd-batched/side-by-side.json
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import torch

from hvd_compress.bench import overhead
from hvd_compress.bench.cluster_rank import MODELS

PER_TENSOR = "-per-tensor"
STEPS, REPEATS = 20, 5
_scheme = overhead._scheme


def _either(system: str, rank: int, start: int) -> Any:
    """``bench overhead``'s scheme for ``system``; with :data:`PER_TENSOR`, unbatched."""
    scheme = _scheme(system.removesuffix(PER_TENSOR), rank, start)
    scheme.batch_tensors = not system.endswith(PER_TENSOR)
    return scheme


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="transformer,cnn,mlp8m")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    overhead.ALONE = ("hook", "ours", f"ours{PER_TENSOR}", "alternate",
                      f"alternate{PER_TENSOR}")
    overhead._scheme = _either
    rows = []
    with overhead.one_rank_world():
        for name in args.models.split(","):
            load = os.getloadavg()[0]
            cpu = overhead.own_costs(MODELS[name], STEPS, REPEATS, 4, 2)
            ratios = {k: v / cpu["hook"] for k, v in cpu.items() if k != "hook"}
            rows.append({"model": name, "cpu_s": cpu, "over_hook": ratios,
                         "load_before": load, "load_after": os.getloadavg()[0]})
            print(name, {k: f"{1000 * v:.2f} ms" for k, v in cpu.items()},
                  {k: f"{v:.2f}" for k, v in ratios.items()},
                  f"load {load:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": STEPS, "repeats": REPEATS, "rank": 4,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
