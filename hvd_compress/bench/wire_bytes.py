"""Bytes on the wire per step, measured by running the exchange on in-process ranks.

Every rank is a :class:`~hvd_compress.Pipeline` on its own thread of a
:class:`~hvd_compress.comm.threads.ThreadGroup`, reducing random gradients of a reference
layer set once under the default :class:`~hvd_compress.Policy` (1-D and small tensors go
dense, as users get). The bytes are rank 0's :class:`~hvd_compress.StepStats`. Each row
also carries ``predicted_bytes``: what the policy and each scheme's ``payload_bytes()``
say the step should take (for top-k and DGC a nominal 4-byte index per pair; their frames
code indices as varints, so they measure smaller).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from hvd_compress import Compression, Pipeline, Policy, StepStats
from hvd_compress.bench import SCHEMES, SPARSE_SCHEMES
from hvd_compress.bench.report import Column, Row, Target, field
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.base import Scheme

Shapes = dict[str, tuple[int, ...]]


def resnet18_shapes() -> Shapes:
    """Parameter shapes of ResNet-18 (He et al. 2016) for 1000 classes: 11.7M floats."""
    shapes: Shapes = {"conv1.weight": (64, 3, 7, 7), "bn1.weight": (64,), "bn1.bias": (64,)}
    in_channels = 64
    for stage, channels in enumerate((64, 128, 256, 512), start=1):
        for block in range(2):
            prefix = f"layer{stage}.{block}"
            block_in = in_channels if block == 0 else channels
            convs = {"conv1": (channels, block_in, 3, 3), "conv2": (channels, channels, 3, 3)}
            if block_in != channels:
                convs["downsample"] = (channels, block_in, 1, 1)
            for conv, shape in convs.items():
                shapes[f"{prefix}.{conv}.weight"] = shape
                shapes[f"{prefix}.{conv}.bn.weight"] = (channels,)
                shapes[f"{prefix}.{conv}.bn.bias"] = (channels,)
        in_channels = channels
    shapes["fc.weight"] = (1000, 512)
    shapes["fc.bias"] = (1000,)
    return shapes


LAYER_SETS: dict[str, Shapes] = {
    "matrix": {"weight": (4096, 4096)},
    "resnet": resnet18_shapes(),
    # Small and fast, for tests: two tensors every scheme compresses, one PowerSGD leaves
    # dense (rank 2 of a 1024x2 matrix saves nothing), 1-D vectors and a tensor too small.
    "tiny": {"conv.weight": (16, 8, 3, 3), "bn.weight": (16,), "bn.bias": (16,),
             "proj.weight": (1024, 2), "embed.weight": (8, 8), "fc.weight": (100, 64),
             "fc.bias": (100,)},
}


def _versus_prediction(row: Row) -> str:
    excess = row["bytes"] - row["predicted_bytes"]
    return "exact" if excess == 0 else f"{excess:+,}"


COLUMNS = (
    Column("layers", field("layers")),
    Column("scheme", field("scheme")),
    Column("compressed", field("compressed_tensors")),
    Column("dense", field("dense_tensors")),
    Column("payload bytes", field("bytes", "{:,}")),
    Column("fp32 bytes", field("dense_bytes", "{:,}")),
    Column("ratio", field("ratio", "{:.3f}")),
    Column("vs predicted", _versus_prediction),
    Column("bytes per collective round",
           lambda row: " ".join(f"{k}={v:,}" for k, v in row["collective_bytes"].items())),
)

TARGETS = (
    Target({"layers": "matrix", "scheme": "onebit"}, "ratio", ">=", 31),
    Target({"layers": "matrix", "scheme": "qsgd:bits=4"}, "ratio", ">=", 7.5),
    Target({"layers": "matrix", "scheme": "powersgd:rank=4,start_iter=0"}, "ratio", ">=", 500),
    Target({"layers": "matrix", "scheme": "fp16"}, "ratio", "==", 2),
    Target({"layers": "matrix", "scheme": "topk:ratio=0.001,values=fp16"}, "ratio", ">=", 800),
)

def title(ranks: int) -> str:
    return (f"Bytes per step of rank 0 of {ranks} (default Policy: 1-D and small tensors go "
            "dense; the matrix rows are the codecs' pure ratios)")


def predicted_bytes(scheme: Scheme, policy: Policy, shapes: Shapes) -> int:
    """Bytes the policy and the scheme's ``payload_bytes()`` predict for one step."""
    sizes = (torch.Size(shape) for shape in shapes.values())
    return sum(scheme.payload_bytes(s) if policy.compresses(scheme, s) else 4 * s.numel()
               for s in sizes)


def measure_step(scheme: Scheme, policy: Policy, shapes: Shapes, ranks: int) -> StepStats:
    """Reduce one step of random gradients on ``ranks`` threads; rank 0's stats."""
    group = ThreadGroup(ranks)

    def rank_step(rank: int) -> StepStats:
        gen = torch.Generator().manual_seed(rank)
        grads = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
        pipeline = Pipeline(scheme, group.communicator(rank), policy=policy)
        pipeline.reduce(grads)
        return pipeline.last_step

    with ThreadPoolExecutor(max_workers=ranks) as pool:
        rank0, *_ = pool.map(rank_step, range(ranks))  # raises any rank's error
    return rank0


def run(layer_sets: Sequence[str], ranks: int) -> list[Row]:
    """One row per (layer set, scheme)."""
    policy = Policy()
    rows = []
    for layers in layer_sets:
        shapes = LAYER_SETS[layers]
        for spec in SCHEMES + SPARSE_SCHEMES:
            scheme = Compression.parse(spec)
            stats = measure_step(scheme, policy, shapes, ranks)
            predicted = predicted_bytes(scheme, policy, shapes)
            rows.append({
                "layers": layers, "scheme": spec, "ranks": ranks,
                "bytes": stats.payload_bytes, "dense_bytes": stats.dense_bytes,
                "ratio": stats.ratio, "predicted_bytes": predicted,
                "collective_bytes": dict(stats.collective_bytes),
                "compressed_tensors": stats.compressed_tensors,
                "dense_tensors": stats.dense_tensors,
            })
    return rows
