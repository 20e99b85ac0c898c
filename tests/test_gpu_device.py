"""Device correctness: every scheme's encode/decode and a pipeline step on a device give the
CPU's torch code's results (the native kernels disabled), bit for bit where the arithmetic
is the same, and leave every result and state on the tensors' device.

Parametrized over ``"cpu"`` and, where CUDA is available, ``"cuda"`` (marked ``gpu``). On
the CPU the comparison is the native kernels against the torch code; on CUDA it is CUDA's
torch code against the CPU's. Inputs are dyadic rationals of distinct magnitudes, so sums,
means and casts are exact or rounded the same way everywhere and top-k has no ties; QSGD and
TernGrad, whose draws differ by device, get inputs on which every draw decides the same.
PowerSGD's QR and products differ in rounding between devices and are compared within a
tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from hvd_compress import Compression, Pipeline, Policy, native
from hvd_compress.comm.staging import pairs_to_host, staging_buffer
from hvd_compress.comm.threads import ThreadGroup
from hvd_compress.schemes.base import ExchangeContext
from hvd_compress.schemes.dense import HalfPayload
from hvd_compress.schemes.packed import PackedScheme
from tests.threaded import on_threads

DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])]

SHAPES = {"w": (48, 64), "v": (3000,), "b": (48,)}


def distinct(numel: int, seed: int) -> torch.Tensor:
    """``numel`` values ``+-(j + 1) / 256`` of distinct magnitudes, random signs, shuffled."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = (torch.randperm(numel, generator=gen) + 1).float() / 256
    sign = torch.randint(0, 2, (numel,), generator=gen).float().mul_(2).sub_(1)
    return magnitude * sign


def on_grid(numel: int, bucket: int, levels: int, seed: int) -> torch.Tensor:
    """Integers in ``[-levels, levels]`` times 1/16, each bucket reaching ``levels``: QSGD's
    (max-norm) scaled values are then whole numbers, and its rounding draws change nothing."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels + 1, (numel,), generator=gen).float() / 16
    x[::bucket] = levels / 16
    return x


def ternary(numel: int, bucket: int, seed: int) -> torch.Tensor:
    """Values in {-0.5, 0, 0.5}, each bucket holding 0.5: TernGrad keeps each with
    probability 0 or 1, whatever it draws."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (numel,), generator=gen).float() / 2
    x[::bucket] = 0.5
    return x


CODECS: dict[str, tuple[Callable[[], PackedScheme], Callable[[int], torch.Tensor]]] = {
    "onebit": (lambda: Compression.onebit(bucket_size=64), lambda n: distinct(n, 1)),
    "fp16": (lambda: HalfPayload(torch.float16), lambda n: distinct(n, 2)),
    "bf16": (lambda: Compression.bf16, lambda n: distinct(n, 3)),
    "vote": (lambda: Compression.vote(), lambda n: distinct(n, 4)),
    "qsgd": (lambda: Compression.qsgd(bits=4, bucket_size=64), lambda n: on_grid(n, 64, 7, 5)),
    "qsgd-l2-decode": (lambda: Compression.qsgd(bits=4, bucket_size=64, norm="l2"),
                       lambda n: distinct(n, 6)),
    "terngrad": (lambda: Compression.terngrad(bucket_size=64, clip=None),
                 lambda n: ternary(n, 64, 7)),
    "terngrad-clip-decode": (lambda: Compression.terngrad(bucket_size=64),
                             lambda n: distinct(n, 8)),
}
"""Packed codecs and inputs on which their encodings agree across devices; the
``-decode`` ones draw differently by device, so only their decoding is compared."""


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CODECS))
def test_packed_codecs_agree_with_the_cpus_torch_code(device: str, name: str) -> None:
    make, data = CODECS[name]
    codec = make()
    x = data(1000)  # not a multiple of the buckets: the short last bucket too
    ctx = ExchangeContext("t", 0, 1, 0)
    payload = codec.encode(x.to(device), ctx.generator("encode", torch.device(device)))
    assert payload.device.type == device and payload.dtype == torch.uint8
    assert payload.numel() == codec.chunk_bytes(1000)
    with native.disabled():
        expected = codec.encode(x, ctx.generator("encode", torch.device("cpu")))
        decoded_here = codec.decode(payload.cpu(), 1000)
    decoded = codec.decode(payload, 1000)
    assert decoded.device.type == device and decoded.dtype == torch.float32
    assert torch.equal(bits(decoded), bits(decoded_here)), name
    if not name.endswith("-decode"):
        assert torch.equal(bits(payload), bits(expected)), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_flagged_vote_decodes_to_nan_on_the_device(device: str) -> None:
    vote = Compression.vote()
    x = distinct(100, 9).to(device)
    x[7] = float("inf")
    payload = vote.encode(x, torch.Generator(device=device))
    assert torch.isnan(vote.decode(payload, 100)).all()
    ok = vote.encode(distinct(100, 10).to(device), torch.Generator(device=device))
    assert torch.isnan(vote.reduce([ok, payload], 100)).all()
    assert not torch.isnan(vote.reduce([ok, ok], 100)).any()


def _inputs(step: int, rank: int) -> dict[str, torch.Tensor]:
    return {name: distinct(torch.Size(shape).numel(), 100 * step + 10 * rank + i).view(shape)
            for i, (name, shape) in enumerate(SHAPES.items())}


def _run(spec: str, device: str, ranks: int = 2, steps: int = 2,
         torch_code: bool = False) -> list[dict[str, Any]]:
    """Each rank's aggregates of ``steps`` steps and its residuals/state afterwards, on a
    ThreadGroup; ``torch_code``: with the native kernels disabled (in every rank's
    thread: the switch is per thread)."""
    group = ThreadGroup(ranks, timeout=120)

    def rank_main(rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with native.disabled() if torch_code else _nothing():
            pipe = Pipeline(Compression.parse(spec), group.communicator(rank),
                            Policy(min_numel=1, compress_1d=True), bucket_bytes=8000)
            for step in range(steps):
                grads = {n: g.to(device) for n, g in _inputs(step, rank).items()}
                out[step] = pipe.reduce(grads)
            out["state"] = {n: pipe.scheme_state(n) for n in SHAPES}
            out["residual"] = {n: pipe.feedback.get(n) for n in SHAPES}
        return out

    return on_threads(ranks, rank_main)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


PIPELINE_SPECS = ["none", "fp16", "bf16", "onebit:bucket_size=64", "vote",
                  "topk:ratio=0.05", "topk:ratio=0.05,values=fp16", "randomk:ratio=0.05",
                  "threshold:tau=11.0,max_ratio=0.5", "dgc:ratio=0.05",
                  "powersgd:rank=2,start_iter=1",
                  "qsgd:bucket_size=64", "terngrad:bucket_size=64,error_feedback=True"]
APPROXIMATE = {"powersgd:rank=2,start_iter=1"}
"""QR and matrix products round differently by device."""
RANDOM = {"qsgd:bucket_size=64", "terngrad:bucket_size=64,error_feedback=True"}
"""Re-encoding a chunk's sum draws on the device's generator: only shapes, devices, finite
values and replicas are compared."""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", PIPELINE_SPECS)
def test_pipeline_steps_agree_with_the_cpus_torch_code(device: str, spec: str) -> None:
    got = _run(spec, device)
    expected = _run(spec, "cpu", torch_code=True)
    for rank in range(2):
        for step in range(2):
            for name, value in got[rank][step].items():
                where = f"{spec} rank {rank} step {step} {name}"
                ref = expected[rank][step][name]
                assert value.device.type == device and value.shape == ref.shape, where
                assert torch.isfinite(value).all(), where
                assert torch.equal(bits(value), bits(got[0][step][name])), \
                    f"{where}: replicas differ"
                if spec in APPROXIMATE:
                    torch.testing.assert_close(value.cpu(), ref, rtol=1e-4, atol=1e-5)
                elif spec not in RANDOM:
                    assert torch.equal(bits(value), bits(ref)), where
        kept = [t for st in got[rank]["state"].values() for t in st.values()]
        kept += [r for r in got[rank]["residual"].values() if r is not None]
        assert all(t.device.type == device for t in kept), spec


@pytest.mark.parametrize("device", DEVICES)
def test_device_pairs_reach_the_host_through_a_pinned_buffer(device: str) -> None:
    idx, val = pairs_to_host(torch.tensor([3, 1], device=device),
                             torch.tensor([0.5, -1.0], device=device), torch.float16)
    assert idx.tolist() == [3, 1] and val.tolist() == [0.5, -1.0]
    assert staging_buffer(16).is_pinned() == torch.cuda.is_available()


@pytest.mark.parametrize("device", DEVICES)
def test_a_checkpoint_loaded_on_the_cpu_goes_to_the_parameters_device(device: str) -> None:
    from hvd_compress.torch.optimizer import _on_devices

    state = {"version": 1, "residuals": {"w": torch.ones(3)},
             "scheme_state": {"w": {"q": torch.ones(3, 2)}}, "steps": {"w": 4}}
    moved = _on_devices(state, {"w": torch.device(device)})
    assert moved["residuals"]["w"].device.type == device
    assert moved["scheme_state"]["w"]["q"].device.type == device
    assert moved["steps"] == {"w": 4} and state["residuals"]["w"].device.type == "cpu"
