"""Each scheme's math, in one process: exact decodes, unbiasedness, variance bounds."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from hvd_compress import Compression, Policy, native
from hvd_compress.schemes.base import ExchangeContext
from hvd_compress.schemes.packed import PackedScheme
from tests.threaded import make_pipelines, on_threads

PACKED = [Compression.onebit(bucket_size=64), Compression.qsgd(bits=3, bucket_size=50),
          Compression.qsgd(bits=8), Compression.terngrad(bucket_size=30), Compression.bf16]


def draws(scheme: PackedScheme, x: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` independent encode/decode round trips of ``x``."""
    out = []
    for i in range(count):
        gen = ExchangeContext("t", 0, 1, i).generator("test", x.device)
        out.append(scheme.decode(scheme.encode(x, gen), x.numel()))
    return torch.stack(out)


@pytest.mark.parametrize("scheme", PACKED, ids=repr)
@pytest.mark.parametrize("n", [1, 7, 63, 64, 65, 1000])
def test_payload_size_is_exact_and_decode_keeps_length(scheme: PackedScheme, n: int) -> None:
    x = torch.randn(n)
    payload = scheme.encode(x, torch.Generator().manual_seed(0))
    assert payload.dtype == torch.uint8 and payload.numel() == scheme.chunk_bytes(n)
    assert scheme.decode(payload, n).shape == (n,)


def test_onebit_decodes_to_signs_times_bucket_mean_magnitude() -> None:
    scheme = Compression.onebit(bucket_size=8)
    x = torch.randn(21)
    decoded = scheme.decode(scheme.encode(x, torch.Generator()), 21)
    for start in range(0, 21, 8):
        bucket = x[start:start + 8]
        expected = torch.where(bucket >= 0, 1.0, -1.0) * bucket.abs().mean()
        torch.testing.assert_close(decoded[start:start + 8], expected)
    assert Compression.onebit().compression_rate(torch.Size([4096, 4096])) > 31


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("scheme", [Compression.qsgd(bits=4, bucket_size=16),
                                    Compression.qsgd(bits=2, bucket_size=16, norm="l2"),
                                    Compression.terngrad(bucket_size=16, clip=None)],
                         ids=repr)
def test_stochastic_schemes_are_unbiased(scheme: PackedScheme, path: str) -> None:
    """On the CPU kernels and on the torch code that other devices run."""
    # Seeded: where an element rounds up in only a few of the draws, their standard error
    # understates the spread and the bound below can fail by chance (tests/test_kernels.py
    # checks the kernels' rounding frequencies on many elements).
    x = torch.randn(64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.1, 3, 64)
    count = 4000
    with native.disabled() if path == "torch" else contextlib.nullcontext():
        assert native.active(x) == (path == "native")
        samples = draws(scheme, x, count)
    mean, std = samples.mean(0), samples.std(0)
    # Each element's mean is within 5 standard errors of the input (a 1-in-1.7M event
    # per element for a Gaussian mean; the decode distributions here are bounded).
    bound = 5 * std / math.sqrt(count) + 1e-5 * x.abs()  # + float rounding of the mean
    assert ((mean - x).abs() <= bound).all(), float(((mean - x).abs() - bound).max())
    assert samples.var(0).sum() > 0  # really stochastic


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("norm", ["l2", "max"])
def test_qsgd_variance_within_the_papers_bound(bits: int, norm: str) -> None:
    d = 128
    scheme = Compression.qsgd(bits=bits, bucket_size=d, norm=norm)
    s = scheme.levels
    x = torch.randn(d)
    assert native.active(x)
    samples = draws(scheme, x, 1000)
    variance = (samples - x).square().sum(1).mean()
    bound = min(d / s**2, math.sqrt(d) / s) * x.square().sum()
    assert variance <= bound, (float(variance), float(bound))


def test_terngrad_clip_bounds_the_scale() -> None:
    scheme = Compression.terngrad(bucket_size=100, clip=2.5, error_feedback=True)
    x = torch.randn(100)
    x[7] = 50.0  # an outlier the clip removes
    decoded = scheme.decode(scheme.encode(x, torch.Generator().manual_seed(1)), 100)
    assert decoded.abs().max() < 50 * 0.5


@pytest.mark.parametrize("size", [1, 2])
def test_powersgd_recovers_a_low_rank_matrix_exactly(size: int) -> None:
    rank = 3
    gen = torch.Generator().manual_seed(size)  # some draws are too ill-conditioned for 1e-4
    u = torch.randn(40, rank, generator=gen)
    matrices = [u @ torch.randn(rank, 30, generator=gen) for _ in range(size)]  # shared span
    pipes = make_pipelines(Compression.powersgd(rank=rank, start_iter=0), size)
    out = on_threads(size, lambda r: pipes[r].reduce({"m": matrices[r]})["m"])
    torch.testing.assert_close(out[0], sum(matrices), rtol=1e-4, atol=1e-4)


def test_powersgd_policy_and_warm_start() -> None:
    scheme = Compression.powersgd(rank=4, start_iter=0)
    policy = Policy(min_numel=1)
    assert policy.compresses(scheme, torch.Size([256, 256]))  # rate 32
    assert not policy.compresses(scheme, torch.Size([8, 8]))  # rate 1: dense
    assert not policy.compresses(scheme, torch.Size([4096]))  # 1-D: dense
    pipes = make_pipelines(scheme, 1)
    pipes[0].reduce({"m": torch.randn(64, 32)})
    q = pipes[0].scheme_state("m")["q"]
    assert q.shape == (32, 4)
    pipes[0].reduce({"m": torch.randn(64, 32)})
    assert not torch.equal(pipes[0].scheme_state("m")["q"], q)  # updated, carried over


@pytest.mark.parametrize("size", [1, 3])
def test_alternating_powersgd_is_exact_on_low_rank_sums_after_one_step(size: int) -> None:
    """``alternate=True``: step 0 projects on a random right basis (not exact); from step 1
    the basis is the sum's own column space (then row space), so a sum of rank <= r is
    recovered exactly at every step. Payloads alternate n r and m r floats, one round of
    one fused collective per step."""
    rank, n, m = 3, 40, 30
    gen = torch.Generator().manual_seed(7)
    u, v = torch.randn(n, rank, generator=gen), torch.randn(rank, m, generator=gen)
    scheme = Compression.parse(f"powersgd:rank={rank},start_iter=0,alternate=True")
    pipes = make_pipelines(scheme, size)
    for step in range(5):
        coeffs = [torch.randn(rank, rank, generator=gen) for _ in range(size)]
        matrices = [u @ c @ v for c in coeffs]  # every step's sum spans u's and v's spaces
        for pipe in pipes:
            pipe.feedback.load_state_dict({})  # judge the projection alone, not the feedback
        out = on_threads(size, lambda r, ms=matrices: pipes[r].reduce({"m": ms[r]})["m"])
        stats = pipes[0].last_step
        assert stats.payload_bytes == 4 * rank * (n if step % 2 == 0 else m), step
        assert stats.collectives == 1, step
        if step > 0:
            torch.testing.assert_close(out[0], sum(matrices), rtol=1e-4, atol=1e-4)
        for other in out[1:]:
            assert torch.equal(other, out[0])
    with pytest.raises(ValueError, match="needs warm_start=True"):
        Compression.powersgd(alternate=True, warm_start=False)


@pytest.mark.parametrize("spec", ["onebit:bucket_size=32", "powersgd:rank=1,start_iter=2",
                                  "powersgd:rank=2,start_iter=1,alternate=True",
                                  "qsgd:bits=2,bucket_size=32,error_feedback=True",
                                  "terngrad:bucket_size=32,clip=2.5,error_feedback=True"])
def test_error_feedback_loses_nothing(spec: str) -> None:
    """Over T steps on 2 ranks: sum of aggregates + every residual == sum of gradients."""
    size, steps = 2, 8
    pipes = make_pipelines(Compression.parse(spec), size)
    grads = [[torch.randn(24, 20) for _ in range(steps)] for _ in range(size)]
    applied = torch.zeros(24, 20)
    for t in range(steps):
        out = on_threads(size, lambda r, t=t: pipes[r].reduce({"w": grads[r][t]})["w"])
        applied += out[0]
    kept = sum(p.feedback.get("w") for p in pipes)
    chunks = [p.scheme_state("w").get("chunk_residual") for p in pipes]
    if chunks[0] is not None:
        kept = kept + torch.cat(chunks).view(24, 20)
    expected = sum(g for rank in grads for g in rank)
    torch.testing.assert_close(applied + kept, expected, rtol=1e-4, atol=1e-4)


def test_parse_rejects_unknown_names_and_options() -> None:
    assert Compression.parse("qsgd:bits=8,bucket_size=256").bits == 8
    assert Compression.parse("fp16") is Compression.fp16
    with pytest.raises(ValueError, match="unknown compression scheme 'zip'") as unknown:
        Compression.parse("zip")
    assert "choose from none, fp16, bf16, onebit, qsgd, terngrad, powersgd, topk, randomk, " \
        "dgc" in str(unknown.value)
    with pytest.raises(ValueError, match="takes no options"):
        Compression.parse("fp16:bits=3")
    with pytest.raises(ValueError, match=r"scheme 'onebit' has no option 'levels'.*"
                                         r"its options are bucket_size, loco_beta, start_iter$"):
        Compression.parse("onebit:levels=3")


def test_parse_lists_the_options_of_a_misspelt_one() -> None:
    with pytest.raises(ValueError) as err:
        Compression.parse("qsgd:bit=4")
    assert "no option 'bit'" in str(err.value)
    assert "its options are bits, bucket_size, norm, error_feedback, loco_beta" \
        in str(err.value)
    with pytest.raises(ValueError, match="ratio, momentum, clip_norm, warmup_steps, "
                                         "sample_ratio, values"):
        Compression.parse("dgc:ratios=0.1")


@pytest.mark.parametrize(("spec", "option", "value", "expected"), [
    ("qsgd:bits=abc", "bits", "'abc'", "an integer (int)"),
    ("qsgd:bits=4.0", "bits", "'4.0'", "an integer (int)"),
    ("qsgd:bits=True", "bits", "'True'", "an integer (int)"),
    ("qsgd:norm=2", "norm", "'2'", "a string (str)"),
    ("qsgd:error_feedback=maybe", "error_feedback", "'maybe'", "True or False (bool)"),
    ("topk:ratio=half", "ratio", "'half'", "a number (float)"),
    ("dgc:clip_norm=big", "clip_norm", "'big'", "a number (float) or None"),
    ("powersgd:warm_start=1", "warm_start", "'1'", "True or False (bool)"),
])
def test_parse_names_option_value_and_type_of_a_wrong_value(spec: str, option: str, value: str,
                                                            expected: str) -> None:
    with pytest.raises(ValueError) as err:
        Compression.parse(spec)
    message = str(err.value)
    assert f"option {option!r} must be {expected}, got {value}" in message, message
    assert spec in message


def test_parse_accepts_every_option_type() -> None:
    qsgd = Compression.parse("qsgd:bits=3,bucket_size=64,norm=l2,error_feedback=true")
    assert (qsgd.bits, qsgd.bucket_size, qsgd.norm, qsgd.error_feedback) == (3, 64, "l2", True)
    assert Compression.parse("qsgd:norm='max',error_feedback=False").norm == "max"
    dgc = Compression.parse("dgc:ratio=0.01,clip_norm=None,values=fp16,warmup_steps=5")
    assert (dgc.ratio, dgc.clip_norm, dgc.values, dgc.warmup_steps) == (0.01, None, "fp16", 5)
    assert Compression.parse("dgc:clip_norm=2").clip_norm == 2
    assert Compression.parse("topk:ratio=1").ratio == 1  # an int is a number
    assert Compression.parse(" QSGD : bits=8 ").bits == 8
    with pytest.raises(ValueError, match="'bits' is given twice"):
        Compression.parse("qsgd:bits=2,bits=4")
    with pytest.raises(ValueError, match="not key=value"):
        Compression.parse("qsgd:bits")
    with pytest.raises(ValueError, match=r"bits must be 2\.\.8"):  # the range: the scheme's own
        Compression.parse("qsgd:bits=9")


def test_ready_made_schemes_called_are_themselves() -> None:
    for scheme in (Compression.none, Compression.fp16, Compression.bf16):
        assert scheme() is scheme
    assert Compression.fp16().compress(torch.ones(2))[0].dtype == torch.float16
    assert repr(Compression.none()) == "Compression.none"
    with pytest.raises(TypeError, match=r"Compression\.fp16 takes no options, got bits=3"):
        Compression.fp16(bits=3)
    with pytest.raises(TypeError, match=r"Compression\.bf16 takes no options, got 2"):
        Compression.bf16(2)
