"""The Triton kernels (:mod:`hvd_compress.triton`) against the CPU codecs, bit for bit.

Where CUDA is not available the kernels run in Triton's interpreter on CPU tensors (here and
in CI); on a CUDA machine they run compiled on the GPU, and the tests are marked ``gpu``
(``pytest -m gpu`` in scripts/gpu_check.sh). Triton takes ``TRITON_INTERPRET`` into
account when ``triton.language`` is imported (its library functions are jitted then) and
when each kernel is decorated, so this module sets it before anything imports Triton; if
Triton was imported before without it, the interpreted tests skip, saying so.

The reference is the native C++ kernel where built (else the torch code fed the native
kernels' draws, :func:`tests.test_gpu_codecs.native_draws`), with the kernel keyed by the
same seed. Sizes include ragged last buckets and packing groups and sizes that are no
multiple of a block; the interpreter is slow, so tensors stay small.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

CUDA_HERE = torch.cuda.is_available()
TRITON_BEFORE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA_HERE:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="triton is not installed (scripts/install.sh installs "
                    "it with the test tools)")

from hvd_compress import Compression, native  # noqa: E402
from hvd_compress import triton as gpu  # noqa: E402
from hvd_compress.comm.ops import sum_pairs  # noqa: E402
from hvd_compress.schemes.dense import HalfPayload  # noqa: E402
from hvd_compress.schemes.packed import PackedScheme  # noqa: E402
from hvd_compress.schemes.qsgd import QSGD  # noqa: E402
from hvd_compress.schemes.terngrad import TernGrad  # noqa: E402
from hvd_compress.schemes.topk import largest  # noqa: E402
from tests.test_gpu_codecs import (  # noqa: E402
    assert_payloads_agree,
    codec_id,
    generator,
)
from tests.test_gpu_codecs import encode as cpu_encode  # noqa: E402
from tests.test_kernels import gradient  # noqa: E402

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton")
WHERE = [pytest.param("cuda", marks=pytest.mark.gpu)] if CUDA_HERE else [pytest.param(
    "interpreter", marks=pytest.mark.skipif(
        TRITON_BEFORE, reason="Triton was imported before this module set TRITON_INTERPRET=1: "
        "run tests/test_triton_kernels.py in a process of its own"))]

PACKED = [
    Compression.onebit(bucket_size=64), Compression.onebit(bucket_size=8),
    Compression.qsgd(bits=4, bucket_size=51), Compression.qsgd(bits=2, bucket_size=64),
    Compression.qsgd(bits=3, bucket_size=50), Compression.qsgd(bits=8, bucket_size=64),
    Compression.qsgd(bits=5, bucket_size=64, norm="l2"),
    Compression.terngrad(bucket_size=30), Compression.terngrad(bucket_size=16, clip=None),
    Compression.terngrad(bucket_size=40, clip=1.7),
]
SIZES = [1, 13, 1100]
"""A single element, a ragged group, and a size past a 1024-element block with ragged last
buckets (smaller for buckets under 32 elements: a program per bucket is slow in the
interpreter)."""


@pytest.fixture(params=WHERE)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Where the kernels run: the interpreter on the CPU, or compiled on CUDA."""
    return CPU if request.param == "interpreter" else torch.device("cuda")


def options(scheme: PackedScheme) -> dict[str, object]:
    if isinstance(scheme, QSGD):
        return {"bits": scheme.bits, "l2": scheme.norm == "l2"}
    if isinstance(scheme, TernGrad):
        return {"clip": scheme.clip}
    return {}


def triton_encode(scheme: PackedScheme, x: torch.Tensor, device: torch.device,
                  residual: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel's payload (and new residual) for ``x`` on the CPU, keyed as the native
    kernel is by :func:`tests.test_gpu_codecs.encode`; results on the CPU."""
    seed = torch.tensor([native.seed(generator(CPU))], dtype=torch.int64, device=device)
    payload, new = gpu.kernels("packed").encode(
        scheme.name, x.to(device), scheme.bucket_size, seed=seed,
        residual=None if residual is None else residual.to(device), **options(scheme))
    return payload.cpu(), None if new is None else new.cpu()


def reference(scheme: PackedScheme, x: torch.Tensor) -> torch.Tensor:
    return cpu_encode("native" if native.available() else "torch", scheme, x)


def cpu_decode(scheme: PackedScheme, payload: torch.Tensor, n: int) -> torch.Tensor:
    return scheme.decode(payload, n)  # the native kernel where built, else the torch code


def edge_values(n: int) -> torch.Tensor:
    """A gradient with a zero bucket, negative zeros, infinities and a NaN."""
    x = gradient(n, seed=5)
    x[:64] = 0.0
    x[64:80] = -0.0
    x[100], x[200], x[300], x[301] = float("inf"), float("-inf"), float("nan"), 1e-40
    return x


@pytest.mark.parametrize("scheme", PACKED, ids=codec_id)
def test_packed_encode_and_decode_match_the_cpu_codec(device: torch.device,
                                                      scheme: PackedScheme) -> None:
    for n in SIZES if scheme.bucket_size >= 32 else [1, 13, 301]:
        x = gradient(n, seed=n)
        want = reference(scheme, x)
        got, _ = triton_encode(scheme, x, device)
        assert got.numel() == scheme.chunk_bytes(n)
        assert_payloads_agree(scheme, got, want, n)
        decoded = gpu.kernels("packed").decode(scheme.name, want.to(device), n,
                                               scheme.bucket_size, getattr(scheme, "bits", 1))
        assert torch.equal(decoded.cpu(), cpu_decode(scheme, want, n)), n


@pytest.mark.parametrize("scheme", [PACKED[0], PACKED[2], PACKED[6], PACKED[7]], ids=codec_id)
def test_error_feedback_is_fused_exactly(device: torch.device, scheme: PackedScheme) -> None:
    """With a residual the kernel codes ``g + e`` and returns ``(g + e) - decode(payload)``:
    the CPU codec's payload of ``g + e`` and the same residual, bit for bit."""
    n = 1000
    g, e = gradient(n, seed=1), gradient(n, seed=2) / 8
    x = g + e
    want = reference(scheme, x)
    got, residual = triton_encode(scheme, g, device, residual=e)
    assert_payloads_agree(scheme, got, want, n)
    assert residual is not None
    assert torch.equal(residual, x - cpu_decode(scheme, want, n))


@pytest.mark.parametrize("scheme", [PACKED[1], PACKED[2], PACKED[4], PACKED[7], PACKED[8]],
                         ids=codec_id)
def test_edge_values_code_as_on_the_cpu(device: torch.device, scheme: PackedScheme) -> None:
    """Zeros, negative zeros, infinities, a NaN and a subnormal: the same payload bytes as
    the CPU codec (a NaN scale has the same bits too: its sign is cleared by the integer
    maximum or it comes from the same float64 sum), and the same decoded values."""
    n = 331
    x = edge_values(n)
    want = reference(scheme, x)
    got, _ = triton_encode(scheme, x, device)
    assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
    decoded = gpu.kernels("packed").decode(scheme.name, got.to(device), n, scheme.bucket_size,
                                           getattr(scheme, "bits", 1)).cpu()
    torch.testing.assert_close(decoded, cpu_decode(scheme, want, n), rtol=0, atol=0,
                               equal_nan=True)


def test_draws_follow_the_seed(device: torch.device) -> None:
    scheme = Compression.qsgd(bits=4, bucket_size=64)
    x = gradient(500).to(device)
    run = gpu.kernels("packed").encode

    def payload(seed: int) -> torch.Tensor:
        key = torch.tensor([seed], dtype=torch.int64, device=device)
        return run("qsgd", x, 64, bits=4, seed=key)[0]
    assert torch.equal(payload(7), payload(7))
    assert not torch.equal(payload(7), payload(8))
    assert scheme.chunk_bytes(500) == payload(7).numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_casts_and_residual(device: torch.device, dtype: torch.dtype) -> None:
    """The payload is ``x.to(dtype)``'s bytes for finite values and infinities (ties to
    even included), a NaN stays NaN, and the fused residual is ``x - float(payload)``."""
    n = 1500
    g, e = gradient(n, seed=3) * 1e3, gradient(n, seed=4)
    g[0], g[1], g[2], g[3] = 70000.0, -0.0, float("inf"), float("nan")
    g[4] = 1.0 + 2.0**-8  # a bfloat16 tie: rounds to even
    g[5] = 1.0 + 3 * 2.0**-8
    payload, _ = gpu.kernels("cast").encode(g.to(device), dtype)
    want = g.to(dtype)
    got = payload.cpu().view(dtype)
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    assert bool(got[~finite].isnan().all())
    x = g + e
    payload, residual = gpu.kernels("cast").encode(g.to(device), dtype, e.to(device))
    assert residual is not None
    got = payload.cpu().view(dtype)
    finite = ~x.isnan()
    assert torch.equal(got[finite].view(torch.int16), x.to(dtype)[finite].view(torch.int16))
    torch.testing.assert_close(residual.cpu(), x - got.float(), rtol=0, atol=0, equal_nan=True)
    scheme = HalfPayload(dtype)
    assert torch.equal(scheme.decode(payload.cpu(), n)[finite], got.float()[finite])


def test_candidates_are_nonzero_of_the_threshold(device: torch.device) -> None:
    sparse = gpu.kernels("sparse")
    for n in (1, 1023, 3001):
        m = gradient(n, seed=n).abs()
        m[n // 2] = float("nan")
        threshold = m.nan_to_num(0).quantile(0.9) if n > 1 else m[0]
        got = sparse.candidates(m.to(device), threshold.to(device)).cpu()
        assert torch.equal(got, (m >= threshold).nonzero().view(-1)), n
    assert sparse.candidates(torch.zeros(0, device=device), torch.tensor(0.0)).numel() == 0


def test_sampled_top_k_selects_torch_topk(device: torch.device) -> None:
    """:func:`largest` with the kernel's compaction (its sampled-threshold path, taken
    above 4 x 65536 entries) picks torch.topk's set: recall 1."""
    n, k = (1 << 18) + 5, 300
    m = torch.randperm(n, generator=torch.Generator().manual_seed(0)).float()
    sparse = gpu.kernels("sparse")
    picks = torch.randint(0, n, (1 << 16,), generator=torch.Generator().manual_seed(1))
    threshold = m[picks].topk(-(-2 * k * (1 << 16) // n)).values.min()
    kept = sparse.candidates(m.to(device), threshold.to(device)).cpu()
    assert k <= kept.numel() < 4 * k
    chosen = kept[m[kept].topk(k).indices]
    assert set(chosen.tolist()) == set(m.topk(k).indices.tolist())
    if device.type == "cuda":  # the scheme's own route on CUDA
        got = largest(m.to(device), k, torch.Generator().manual_seed(1)).cpu()
        assert set(got.tolist()) == set(m.topk(k).indices.tolist())


def test_gather_scales_as_torch(device: torch.device) -> None:
    x = gradient(5000, seed=9)
    idx = torch.randperm(5000, generator=torch.Generator().manual_seed(2))[:777]
    sparse = gpu.kernels("sparse")
    assert torch.equal(sparse.gather(x.to(device), idx.to(device)).cpu(), x[idx])
    factor = 5000 / 777
    assert torch.equal(sparse.gather(x.to(device), idx.to(device), factor).cpu(),
                       x[idx] * factor)


def test_segment_sum_is_sum_pairs_in_rank_order(device: torch.device) -> None:
    """Three ranks' overlapping pairs (one in float16): the CPU's ``sum_pairs`` exactly,
    whose additions at an index go in rank order; another order would round otherwise."""
    n = 4099
    gen = torch.Generator().manual_seed(4)
    parts = []
    for rank in range(3):
        idx = torch.randperm(n, generator=gen)[:1500 + 300 * rank]
        val = torch.randn(idx.numel(), generator=gen) * 10 ** rank
        parts.append((idx, val.half() if rank == 1 else val))
    want = sum_pairs(n, parts, CPU)
    got = gpu.kernels("sparse").segment_sum(
        n, [(i.to(device), v.to(device)) for i, v in parts], device).cpu()
    assert torch.equal(got, want)
    reversed_sum = sum_pairs(n, parts[::-1], CPU)
    assert not torch.equal(reversed_sum, want)  # the order matters, so the test can fail


def test_cpu_tensors_never_take_triton() -> None:
    assert not gpu.active(torch.zeros(3))
    assert not gpu.active(CPU)


def test_a_failing_kernel_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_state", {"reason": None, "checked": True, "warned": False})

    def broken() -> None:
        raise RuntimeError("PTX assembly failed\nmore")
    with pytest.warns(gpu.TritonFallbackWarning, match="PTX assembly failed") as caught:
        assert gpu.call(broken) is None
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gpu.call(broken) is None  # no second warning
    assert not gpu.available() and "PTX assembly failed" in (gpu.reason() or "")


def test_missing_triton_is_said_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_state", {"reason": "triton not installed (test)",
                                        "checked": True, "warned": False})
    cuda = torch.device("cuda")
    with pytest.warns(gpu.TritonFallbackWarning, match="triton not installed") as caught:
        assert not gpu.active(cuda)
        assert not gpu.active(cuda)
    assert len(caught) == 1
    with gpu.disabled():
        monkeypatch.setattr(gpu, "_state", {"reason": None, "checked": True, "warned": False})
        assert not gpu.active(cuda)


def test_bench_table_runs_every_row(device: torch.device) -> None:
    """``bench kernels --device cuda``'s Triton table (here on the interpreter, tiny sizes:
    the code, not the figures): a row per codec with both routes timed, outputs that agree
    between the routes (recall 1 for top-k), and GRACE said to be missing where it is."""
    from hvd_compress.bench import kernels

    n = 1024
    rows = kernels.run_triton([n], 1, device.type)
    assert [r["scheme"] for r in rows] == list(kernels.TRITON_CODECS)
    for row in rows:
        assert row["route"] == "triton" and row["seconds"] > 0 and row["torch_seconds"] > 0
        assert row["speedup_vs_torch"] == pytest.approx(row["torch_seconds"] / row["seconds"])
    assert rows[-1]["recall"] == 1.0
    x = gradient(n, seed=6).to(device)
    residual = (gradient(n, seed=7) / 16).to(device)
    for spec in ("onebit+ef", "fp16+ef", "randomk:ratio=0.01", "bf16"):
        kernel = kernels.make_triton_kernel(spec, x, residual)
        got, want = kernel.triton(), kernel.torch()
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        for a, b in zip(got, want):  # type: ignore[arg-type]
            assert torch.equal(a, b), spec
    if kernels.grace_status() is not None:
        assert "GRACE not timed" in kernels.triton_title(1, device.type)
        assert all(r["grace_seconds"] is None for r in rows)


COMPILE_FOR_HOPPER = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hvd_compress.triton import cast, packed, sparse

F, U8 = "*fp32", "*u8"
STATS = dict(g_ptr=F, e_ptr=F, seed_ptr="*i64", clip_ptr="*fp64", scale_ptr=F, bound_ptr=F,
             key_ptr="*i32", n="i32", bucket="i32")
FUSED = dict(g_ptr=F, e_ptr=F, r_ptr=F, seed_ptr="*i64", clip_ptr="*fp64", scale_ptr=F,
             out_ptr=U8, n="i32", nbytes="i32", plane_bytes="i32", bucket="i32", levels="i32")
PACK = dict(g_ptr=F, e_ptr=F, r_ptr=F, scale_ptr=F, bound_ptr=F, key_ptr="*i32", out_ptr=U8,
            n="i32", nbytes="i32", plane_bytes="i32", bucket="i32", levels="i32")
DECODE = dict(in_ptr=U8, scale_ptr=F, out_ptr=F, n="i32", plane_bytes="i32", bucket="i32",
              levels="i32")
CAST = dict(g_ptr=F, e_ptr=F, h_ptr="*i16", r_ptr=F, n="i32")
KERNELS = [
    *((packed._stats, STATS, dict(CODEC=c, L2=l2, CLIP=clip, HAS_RES=r, BLOCK=1024, CHUNKS=2))
      for c, l2, clip, r in [(0, 0, 0, 1), (1, 1, 0, 0), (1, 0, 0, 1), (2, 0, 1, 1)]),
    *((packed._pack, PACK, dict(CODEC=c, BITS=b, GROUP=g, PLANES=p, HAS_RES=r, BLOCK=256))
      for c, b, g, p, r in [(1, 4, 2, 0, 1), (1, 3, 8, 1, 0), (2, 0, 5, 0, 1)]),
    *((packed._encode_fused, FUSED, dict(CODEC=c, L2=l2, CLIP=0, BITS=b, GROUP=g, PLANES=p,
                                         HAS_RES=r, BLOCK=1024, CHUNKS=2, PACK_BLOCK=256,
                                         PACK_CHUNKS=1))
      for c, l2, b, g, p, r in [(0, 0, 1, 8, 0, 1), (1, 0, 4, 2, 0, 1), (1, 1, 5, 8, 1, 0)]),
    *((packed._decode, DECODE, dict(CODEC=c, BITS=b, GROUP=g, PLANES=p, BLOCK=1024))
      for c, b, g, p in [(0, 1, 8, 0), (1, 5, 8, 1), (2, 0, 5, 0)]),
    *((cast._cast, CAST, dict(BF16=bf, HAS_RES=1, BLOCK=1024)) for bf in (0, 1)),
    (sparse._count, dict(m_ptr=F, thr_ptr=F, counts_ptr="*i64", n="i32"), dict(BLOCK=1024)),
    (sparse._compact, dict(m_ptr=F, thr_ptr=F, offsets_ptr="*i64", out_ptr="*i64", n="i32"),
     dict(BLOCK=1024)),
    (sparse._gather, dict(x_ptr=F, i_ptr="*i64", out_ptr=F, k="i32", factor="fp32"),
     dict(SCALE=1, BLOCK=1024)),
    (sparse._add_pairs, dict(total_ptr=F, i_ptr="*i64", v_ptr="*fp16", k="i32"),
     dict(BLOCK=1024)),
]
found = []
for fn, types, consts in KERNELS:
    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types[n] for n in names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(names.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"enable_fp_fusion": False})
    ops = set(re.findall(r"\b(?:fma|div|sqrt|rcp|ex2|lg2)\.[a-z0-9.]+", compiled.asm["ptx"]))
    found.append({"kernel": fn.__name__, "cubin": len(compiled.asm["cubin"]), "ops": sorted(ops)})
json.dump(found, sys.stdout)
'''


@pytest.mark.multiprocess
def test_kernels_compile_for_hopper_without_contractions() -> None:
    """The compiled route, without a GPU: every kernel family compiles through Triton's
    own ptxas for sm_90 (the H200), and its PTX has no fused multiply-add and no
    approximate division, reciprocal or square root (what bit-exactness needs)."""
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_HOPPER], capture_output=True,
                          text=True, timeout=600, env=env, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert {k["kernel"] for k in found} == {"_stats", "_pack", "_encode_fused", "_decode",
                                            "_cast", "_count", "_compact", "_gather",
                                            "_add_pairs"}
    for kernel in found:
        assert kernel["cubin"] > 0, kernel
        for op in kernel["ops"]:
            assert not op.startswith(("fma", "rcp", "ex2", "lg2")) and "approx" not in op \
                and "full" not in op, kernel
    divisions = {op for k in found for op in k["ops"] if op.startswith(("div.", "sqrt."))}
    assert {"div.rn.f32", "div.rn.f64", "sqrt.rn.f64"} <= divisions


def test_no_triton_env_closes_the_route_silently(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu, "_state", {"reason": None, "checked": True, "warned": False})
    monkeypatch.setenv(gpu.DISABLE_ENV, "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not gpu.active(torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_HERE, reason="needs CUDA")
@pytest.mark.parametrize("scheme", [Compression.onebit(), Compression.qsgd(bits=4),
                                    Compression.terngrad(), Compression.qsgd(bits=3, norm="l2"),
                                    HalfPayload(torch.bfloat16), HalfPayload(torch.float16)],
                         ids=codec_id)
def test_schemes_take_the_triton_route_on_cuda(scheme: PackedScheme) -> None:
    """On CUDA a scheme's encode is the Triton kernel's, keyed from the CUDA generator (no
    warning), and every route decodes its payload to the same values."""
    cuda = torch.device("cuda")
    n = 100_003
    x = gradient(n, seed=11)
    with warnings.catch_warnings():
        warnings.simplefilter("error", gpu.TritonFallbackWarning)
        payload = scheme.encode(x.to(cuda), generator(cuda))
    if isinstance(scheme, HalfPayload):
        want, _ = gpu.kernels("cast").encode(x.to(cuda), scheme.dtype)
    else:
        seed = gpu.seed_tensor(generator(cuda), cuda)
        want, _ = gpu.kernels("packed").encode(scheme.name, x.to(cuda), scheme.bucket_size,
                                               seed=seed, **options(scheme))
    assert torch.equal(payload, want)
    decoded = scheme.decode(payload, n).cpu()
    assert torch.equal(decoded, cpu_decode(scheme, payload.cpu(), n))
    with gpu.disabled():
        assert torch.equal(scheme.decode(payload, n).cpu(), decoded)
