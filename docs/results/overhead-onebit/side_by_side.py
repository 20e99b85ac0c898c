"""1-bit's exchange alone, fused and unfused, against DDP's ``powerSGD_hook`` alone, in one
process and in turn: ``bench overhead``'s "alone" measurement (its ``own_costs``: one
backward pass's gradients of each model, handed over again every step; process CPU per
step, median of the turns, after ``OWN_WARMUP`` untimed steps), with the unfused reference
path of ``hvd_compress.schemes.packed`` (``FUSED = False``) timed beside the fused one.

    python docs/results/overhead-onebit/side_by_side.py --models mlp8m,transformer \\
        --json docs/results/overhead-onebit/side-by-side.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
from torch import nn

from hvd_compress.bench import overhead
from hvd_compress.bench.cluster_rank import MODELS
from hvd_compress.schemes import packed

_EXCHANGES = overhead._exchanges


def exchanges(model: nn.Module, rank: int, start: int) -> dict[str, Callable[[], None]]:
    """``bench overhead``'s exchanges of the hook and 1-bit, and a second 1-bit pipeline
    run on the unfused path."""
    steps = _EXCHANGES(model, rank, start)
    reference = _EXCHANGES(model, rank, start)["onebit"]

    def unfused() -> None:
        packed.FUSED = False
        try:
            reference()
        finally:
            packed.FUSED = True

    return {"hook": steps["hook"], "refill": steps["refill"], "onebit_fused": steps["onebit"],
            "onebit_unfused": unfused}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp8m,mlp-deep,cnn,transformer,mlp-narrow")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    overhead.ALONE = ("hook", "onebit")
    overhead._exchanges = exchanges
    rows = []
    with overhead.one_rank_world():
        for name in args.models.split(","):
            cpu = overhead.own_costs(MODELS[name], args.steps, args.repeats, 4, 2)
            row = {"model": name, "alone_cpu_s": cpu,
                   "fused/hook": cpu["onebit_fused"] / cpu["hook"],
                   "unfused/hook": cpu["onebit_unfused"] / cpu["hook"],
                   "fused/unfused": cpu["onebit_fused"] / cpu["onebit_unfused"]}
            rows.append(row)
            print(f"{name}: hook {1e3 * cpu['hook']:.1f} ms, 1-bit unfused "
                  f"{1e3 * cpu['onebit_unfused']:.1f} ms ({row['unfused/hook']:.2f}x), fused "
                  f"{1e3 * cpu['onebit_fused']:.1f} ms ({row['fused/hook']:.2f}x); "
                  f"fused/unfused {row['fused/unfused']:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"steps": args.steps, "repeats": args.repeats, "rows": rows}, out,
                      indent=1)


if __name__ == "__main__":
    main()
