"""The fused error-feedback path of the packed codecs on the CPU (``schemes/packed.py``'s
``fused_allreduce`` and the ``subtract``/``reduce`` kernels of ``native/codecs.cpp``)
against the unfused reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import Compression
from hvd_compress.native import tensors as kernels
from hvd_compress.schemes import packed
from hvd_compress.schemes.base import write_scaled
from hvd_compress.schemes.packed import PackedScheme
from tests.threaded import make_pipelines, on_threads

pytestmark = pytest.mark.skipif(not kernels.active(torch.zeros(1)),
                                reason="native kernels unavailable")

CODECS = [Compression.onebit(bucket_size=64), Compression.onebit(),
          Compression.qsgd(bits=3, bucket_size=56, error_feedback=True),
          Compression.qsgd(bits=4, bucket_size=64, norm="l2", error_feedback=True),
          Compression.terngrad(bucket_size=40, error_feedback=True),
          Compression.terngrad(bucket_size=64, clip=2.5)]
SIZES = [1, 7, 64, 1000, 4099, 70001]


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit for bit (signed zeros included), NaN where the other is NaN: a NaN's sign
    and payload are not defined by the arithmetic (x86 takes the first operand's, and
    torch's vector kernels may order the operands otherwise)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    if a.dtype != torch.float32:
        assert torch.equal(a, b)
        return
    nan = a.isnan()
    assert torch.equal(nan, b.isnan())
    assert torch.equal(a.contiguous().view(torch.int32)[~nan],
                       b.contiguous().view(torch.int32)[~nan])


def values(n: int, seed: int, special: bool = False) -> torch.Tensor:
    """Gradient-like values; ``special``: with zeros, a zero bucket, infinities and NaN."""
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-2
    if special and n >= 8:
        x[: min(n, 64)] = 0.0
        x[n // 3] = float("inf")
        x[n // 2] = -float("inf")
        x[-1] = float("nan")
        x[n // 5] = -0.0
    return x


def options(codec: PackedScheme, seed: int) -> tuple:
    return codec.encode_options(torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}-{c.bucket_size}")
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("special", [False, True])
def test_reduce_then_encode_is_encode_then_decode_and_subtract(codec: PackedScheme, n: int,
                                                               special: bool) -> None:
    """The reducing rank's step: sum, residual, re-encoding and the new residual."""
    sent = codec.encode(values(n, n, special), torch.Generator().manual_seed(1))
    residual = values(n, n + 1, special)
    total = codec.decode(sent, n) + residual
    reference = codec.encode(total, torch.Generator().manual_seed(3))
    expected = total.clone().sub_(codec.decode(reference, n))
    payload = torch.empty(codec.chunk_bytes(n), dtype=torch.uint8)
    got = kernels.reduce(codec.kernel, [sent], n, codec.bucket_size, residual, payload,
                         *options(codec, 3))
    assert torch.equal(payload, reference)
    assert_same(got, expected)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}-{c.bucket_size}")
@pytest.mark.parametrize("n", SIZES)
def test_subtract_and_reduce_are_decode_then_torch_arithmetic(codec: PackedScheme,
                                                              n: int) -> None:
    payloads = [codec.encode(values(n, 10 * n + r, special=r == 1),
                             torch.Generator().manual_seed(r)) for r in range(4)]
    x = values(n, 99)
    assert_same(kernels.subtract(codec.kernel, payloads[0], x.clone(), codec.bucket_size,
                                 *codec.decode_options()),
                x - codec.decode(payloads[0], n))
    residual = values(n, 7, special=True)
    for count in (1, 2, 4):
        total = codec.decode(payloads[0], n).clone()
        for p in payloads[1:count]:
            total += codec.decode(p, n)
        got = kernels.reduce(codec.kernel, payloads[:count], n, codec.bucket_size, None, None,
                             *options(codec, 0))
        assert_same(got, total)
        got = kernels.reduce(codec.kernel, payloads[:count], n, codec.bucket_size, residual,
                             None, *options(codec, 0))
        assert_same(got, total + residual)


@pytest.mark.parametrize("codec", CODECS[:3], ids=lambda c: f"{c.name}-{c.bucket_size}")
def test_kernels_give_the_same_bits_on_any_thread_count(codec: PackedScheme) -> None:
    n = 300_007  # above the kernels' parallel threshold
    x = values(n, 1, special=True)
    payloads = [codec.encode(values(n, s), torch.Generator().manual_seed(s)) for s in (1, 2)]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            payload = torch.empty(codec.chunk_bytes(n), dtype=torch.uint8)
            residual = kernels.reduce(codec.kernel, payloads, n, codec.bucket_size, x,
                                      payload, *options(codec, 5))
            total = kernels.reduce(codec.kernel, payloads, n, codec.bucket_size, x, None,
                                   *options(codec, 5))
            results.append((payload, residual, total))
    finally:
        torch.set_num_threads(before)
    for payload, residual, total in results[1:]:
        assert torch.equal(payload, results[0][0])
        assert_same(residual, results[0][1])
        assert_same(total, results[0][2])


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}-{c.bucket_size}")
@pytest.mark.parametrize("special", [False, True])
def test_kept_payloads_write_and_total_as_the_decoded_tensor(codec: PackedScheme,
                                                             special: bool) -> None:
    """A :class:`~hvd_compress.schemes.packed.PackedContribution` (the fused path's
    aggregate) writes what the decoded tensor writes, bit for bit, and its total is the
    decoded values' sum (non-finite exactly when one of them is)."""
    sizes = [4099, 0, 1000, 7]
    shape = torch.Size([sum(sizes)])
    payloads = [codec.encode(values(n, n, special), torch.Generator().manual_seed(n))
                for n in sizes]
    kept = packed.PackedContribution(codec, codec.kernel, payloads, sizes, shape)
    decoded = torch.cat([codec.decode(p, n) for p, n in zip(payloads, sizes)])
    assert_same(kept.materialize(), decoded)
    for scale in (1.0, 0.5, 1 / 3, 0.1, 3e37):
        expected = write_scaled(decoded, torch.full(shape, 7.0), scale)
        assert_same(kept.write(torch.full(shape, 7.0), scale), expected)
        half = kept.write(torch.zeros(shape, dtype=torch.float16), scale)  # not decoded into
        assert_same(half.float(), write_scaled(decoded, torch.zeros_like(half), scale).float())
    got = kept.total()
    assert got.dtype == torch.float32 and got.shape == ()
    assert bool(got.isfinite()) == bool(decoded.isfinite().all())
    if not special:
        want = decoded.double().sum()
        assert abs(float(got) - float(want)) <= 1e-6 * float(decoded.abs().double().sum())


MODEL = {"w": (37, 53), "b": (7,), "zero": (130,), "big": (81, 1003)}


def train(codec: PackedScheme, size: int, steps: int = 4, into: bool = False) -> list[tuple]:
    """Every rank's aggregates, residuals and scheme state after each step, the tensors
    submitted one by one (no fusion buffer). ``into``: averaged, written into float32
    buffers of their own (the optimizer's way), else summed and returned."""
    pipes = make_pipelines(codec, size, bucket_bytes=None, average=into)

    def work(rank: int) -> list[tuple]:
        gen = torch.Generator().manual_seed(rank)
        out = []
        for _ in range(steps):
            grads = {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in
                     MODEL.items()}
            grads["zero"].zero_()
            if into:
                for name, grad in grads.items():
                    pipes[rank].submit(name, grad)
                result = pipes[rank].wait({name: torch.full(grad.shape, 7.0)
                                           for name, grad in grads.items()})
            else:
                result = pipes[rank].reduce(grads)
            state = pipes[rank].state_dict()
            out.append((result, state["residuals"], state["scheme_state"]))
        return out

    return on_threads(size, work)


@pytest.mark.parametrize("into", [False, True], ids=["returned", "into"])
@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("codec", [CODECS[0], CODECS[2], CODECS[5]],
                         ids=lambda c: f"{c.name}-{c.bucket_size}")
def test_fused_training_steps_are_bit_identical_to_the_reference(
        codec: PackedScheme, size: int, into: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fused_allreduce = packed.fused_allreduce

    def counted(*args: object) -> object:
        calls.append(args[1])
        return (yield from fused_allreduce(*args))

    monkeypatch.setattr(packed, "fused_allreduce", counted)
    fused = train(codec, size, into=into)
    assert calls and set(calls) == {codec.kernel}
    monkeypatch.setattr(packed, "FUSED", False)
    reference = train(codec, size, into=into)
    assert len(calls) == len(MODEL) * 4 * size  # the reference took the unfused path
    for rank_fused, rank_reference in zip(fused, reference):
        for (agg, res, st), (agg_r, res_r, st_r) in zip(rank_fused, rank_reference):
            assert agg.keys() == agg_r.keys()
            for name in agg:
                assert_same(agg[name], agg_r[name])
            assert res.keys() == res_r.keys()
            for name in res:
                assert_same(res[name], res_r[name])
            assert st.keys() == st_r.keys()
            for name in st:
                assert st[name].keys() == st_r[name].keys()
                for key in st[name]:
                    assert_same(st[name][key], st_r[name][key])


@pytest.mark.parametrize("size", [1, 2])
def test_kept_aggregate_whose_sum_overflows_passes_the_finite_check(size: int) -> None:
    """The kept aggregate's total rounds a float64 sum beyond float32's range to infinity;
    the pipeline then looks at the decoded values, all finite, and the step goes on."""
    pipes = make_pipelines(Compression.onebit(bucket_size=64), size)
    big = torch.full((4, 64), 3e38 / size)
    out = on_threads(size, lambda r: pipes[r].reduce({"w": big.clone()})["w"])
    assert torch.isfinite(out[0]).all() and float(out[0].double().sum()) > 3.4e38
    for rank_out in out:
        assert torch.equal(rank_out, out[0])
