"""Every codec on CUDA against the CPU codecs, bit for bit where the math allows it.

The tests marked ``gpu`` are skipped without CUDA (``tests/conftest.py``). Three routes
code the same input: ``cuda`` (the schemes' torch code on a CUDA tensor, the Triton kernels
disabled: they are checked against the CPU in ``tests/test_triton_kernels.py``), ``torch`` (the
same code on the CPU, :func:`hvd_compress.native.disabled`) and ``native`` (the CPU with
the native kernels of :mod:`hvd_compress.native`, where a scheme has them: 1-bit, QSGD,
TernGrad). What holds, and what cannot by construction:

* Wire packing (bits, b-bit codes, trits) and every decode are exact: a payload decodes to
  the same floats on every route, whichever route encoded it.
* fp16, bf16 and majority-vote payloads are exact for finite inputs. For a NaN only the
  NaN-ness is compared: the CUDA and CPU conversions write different NaN bit patterns.
* QSGD and TernGrad draw uniforms: ``torch.rand`` on CUDA (Philox) and on the CPU
  (mt19937) give other numbers, and the native kernels a counter-based hash. So every
  route here is fed the same draws: the native kernels' own, reproduced in numpy by
  :func:`native_draws` (checked against the kernels by a test that runs on every machine)
  and handed to the torch code through ``torch.rand``. With them, max-norm QSGD and
  unclipped TernGrad payloads are exact.
* 1-bit's scale, QSGD's 2-norm and TernGrad's clipping bound are float64 sums over a
  bucket, rounded to float32 once; CUDA's reduction adds in another order than ATen's CPU
  kernels and the native kernels' eight lanes. The float64 sums can differ in their last
  bits, and their float32 roundings only where they straddle a rounding boundary (about
  2^-29 per scale). So those scales are asserted within one unit in the last place, and
  the codes equal in every bucket whose scales are equal (1-bit's signs everywhere).
* With CUDA's own generator the draws are CUDA's: encoding is then reproducible from the
  seed, and every decoded value is one of the two grid points around its input.
* Sparse selection (top-k, DGC, random-k, threshold) picks the same pairs on CUDA.

PowerSGD is not here: its products go through cuBLAS and cuSOLVER on CUDA and through
MKL/LAPACK on the CPU, which are not bit-exact with each other (its CUDA exchange runs in
``tests/test_gpu_device.py``, and ``scripts/gpu_check.sh`` times it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from hvd_compress import Compression, native, wire
from hvd_compress import triton as gpu
from hvd_compress.comm.ops import AllReduce
from hvd_compress.schemes.base import ExchangeContext
from hvd_compress.schemes.dense import HalfPayload
from hvd_compress.schemes.packed import PackedScheme
from hvd_compress.schemes.qsgd import QSGD
from hvd_compress.schemes.terngrad import TernGrad
from tests.test_kernels import assert_scales_agree, code_bytes, gradient

CUDA, CPU = torch.device("cuda"), torch.device("cpu")
ROUTES = ("cuda", "torch", "native")

CODECS = [
    HalfPayload(torch.float16), Compression.bf16, Compression.vote(),
    Compression.onebit(), Compression.onebit(bucket_size=64), Compression.onebit(bucket_size=8),
    *(Compression.qsgd(bits=b) for b in range(2, 9)),
    Compression.qsgd(bits=4, bucket_size=51), Compression.qsgd(bits=3, bucket_size=50),
    Compression.qsgd(bits=5, bucket_size=64, norm="l2"), Compression.qsgd(bits=2, norm="l2"),
    Compression.terngrad(), Compression.terngrad(bucket_size=16),
    Compression.terngrad(bucket_size=30, clip=None),
]
LENGTHS = [0, 1, 7, 63, 65, 1000, 100_003, (1 << 20) + 3]


def codec_id(scheme: PackedScheme) -> str:
    return f"{scheme.name}:{scheme.bucket_size}" if isinstance(scheme, HalfPayload) \
        else repr(scheme)


def randomised(scheme: PackedScheme) -> bool:
    return isinstance(scheme, QSGD | TernGrad)


def float64_stats(scheme: PackedScheme) -> bool:
    """Whether the scheme's scales are float64 sums (one ulp apart across devices)."""
    return scheme.name == "onebit" or (isinstance(scheme, QSGD) and scheme.norm == "l2") \
        or (isinstance(scheme, TernGrad) and scheme.clip is not None)


def generator(device: torch.device, step: int = 0) -> torch.Generator:
    return ExchangeContext("w", 0, 1, step).generator("encode", device)


def native_draws(seed: int, n: int, bucket_size: int) -> torch.Tensor:
    """The uniforms the native kernels draw for ``n`` elements in buckets of
    ``bucket_size`` with key ``seed`` (``codecs.cpp``: element ``j`` of bucket ``b`` draws
    ``mix32(j ^ k_b) >> 8`` times 2^-24, ``k_b`` the top half of splitmix64's ``b``-th
    output from ``seed``)."""
    j = np.arange(n, dtype=np.int64)
    bucket = (j // bucket_size).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + (bucket + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h = (j % bucket_size).astype(np.uint32) ^ ((z ^ (z >> np.uint64(31)))
                                                   >> np.uint64(32)).astype(np.uint32)
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x7FEB352D)
        h ^= h >> np.uint32(15)
        h *= np.uint32(0x846CA68B)
        h ^= h >> np.uint32(16)
    return torch.from_numpy((h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24))


@contextlib.contextmanager
def fed(draws: torch.Tensor | None) -> Iterator[None]:
    """Within the block ``torch.rand`` returns ``draws`` (on the device asked for)."""
    if draws is None:
        yield
        return
    real = torch.rand

    def rand(*size: object, device: torch.device | None = None, **_: object) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        assert tuple(shape) == tuple(draws.shape), (shape, draws.shape)
        return draws.to(device)

    torch.rand = rand
    try:
        yield
    finally:
        torch.rand = real


def require(route: str) -> None:
    if route == "native" and not native.available():
        pytest.skip("the native kernels are unavailable here (see the loader's warning)")


def encode(route: str, scheme: PackedScheme, x: torch.Tensor) -> torch.Tensor:
    """``x`` (CPU) encoded by ``route``, with the native kernels' draws fed to the torch
    code; the payload on the CPU."""
    require(route)
    if route == "native":
        return scheme.encode(x, generator(CPU))
    draws = native_draws(native.seed(generator(CPU)), x.numel(), scheme.bucket_size) \
        if randomised(scheme) else None
    device = CUDA if route == "cuda" else CPU
    with native.disabled(), gpu.disabled(), fed(draws):
        return scheme.encode(x.to(device), generator(device)).cpu()


def decode(route: str, scheme: PackedScheme, payload: torch.Tensor, n: int) -> torch.Tensor:
    require(route)
    if route == "native":
        return scheme.decode(payload, n)
    with native.disabled(), gpu.disabled():
        return scheme.decode(payload.to(CUDA if route == "cuda" else CPU), n).cpu()


def codes(scheme: PackedScheme, payload: torch.Tensor, n: int) -> torch.Tensor:
    """The per-element codes of a payload with scales (1-bit, QSGD, TernGrad)."""
    section = payload[:code_bytes(scheme, n)]
    if scheme.name == "onebit":
        return wire.unpack_bits(section, n)
    if isinstance(scheme, QSGD):
        return wire.unpack_codes(section, n, scheme.bits)
    return wire.unpack_trits(section, n)


def assert_payloads_agree(scheme: PackedScheme, got: torch.Tensor, want: torch.Tensor,
                          n: int) -> None:
    """Equal bytes; for float64 statistics, scales within one ulp and the codes equal in
    every bucket whose scales are equal (see the module docstring)."""
    assert got.dtype == want.dtype == torch.uint8 and got.numel() == want.numel()
    if not float64_stats(scheme) or torch.equal(got, want):
        assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
        return
    cut = code_bytes(scheme, n)
    got_scales, want_scales = got[cut:].clone().view(torch.float32), \
        want[cut:].clone().view(torch.float32)
    assert_scales_agree(got_scales, want_scales)
    same = got_scales.view(torch.int32) == want_scales.view(torch.int32)
    in_same = same.repeat_interleave(scheme.bucket_size)[:n]
    if scheme.name == "onebit":  # signs do not depend on the scale
        in_same[:] = True
    assert torch.equal(codes(scheme, got, n)[in_same], codes(scheme, want, n)[in_same])


def test_native_draws_reproduce_the_native_kernels() -> None:
    """The oracle of the randomised tests, checked on any machine with the native kernels:
    the torch code fed :func:`native_draws` writes the native kernels' payload, byte for
    byte (so the same draws fed on CUDA test CUDA against both CPU routes)."""
    require("native")
    for scheme in [c for c in CODECS if randomised(c)]:
        for n in (1, 65, 100_003):
            x = gradient(n)
            assert torch.equal(encode("torch", scheme, x), encode("native", scheme, x)), \
                (scheme, n)


@pytest.mark.gpu
@pytest.mark.parametrize("n", LENGTHS)
def test_wire_packing_is_exact_on_cuda(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    bits = torch.rand(n, generator=gen) < 0.5
    assert torch.equal(wire.pack_bits(bits.to(CUDA)).cpu(), wire.pack_bits(bits))
    for width in range(1, 9):
        values = torch.randint(0, 1 << width, (n,), generator=gen, dtype=torch.uint8)
        packed = wire.pack_codes(values, width)
        assert torch.equal(wire.pack_codes(values.to(CUDA), width).cpu(), packed)
        assert torch.equal(wire.unpack_codes(packed.to(CUDA), n, width).cpu(), values)
    trits = torch.randint(-1, 2, (n,), generator=gen, dtype=torch.int8)
    packed = wire.pack_trits(trits)
    assert torch.equal(wire.pack_trits(trits.to(CUDA)).cpu(), packed)
    assert torch.equal(wire.unpack_trits(packed.to(CUDA), n).cpu(), trits)
    noise = torch.randint(0, 256, (wire.trits_nbytes(n),), generator=gen, dtype=torch.uint8)
    assert torch.equal(wire.unpack_trits(noise.to(CUDA), n).cpu(), wire.unpack_trits(noise, n))
    assert torch.equal(wire.unpack_bits(wire.pack_bits(bits).to(CUDA), n).cpu(), bits)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", CODECS, ids=codec_id)
@pytest.mark.parametrize("n", LENGTHS)
def test_cuda_encodes_as_both_cpu_routes(scheme: PackedScheme, n: int) -> None:
    x = gradient(n)
    on_cuda = encode("cuda", scheme, x)
    assert on_cuda.numel() == scheme.chunk_bytes(n)
    assert_payloads_agree(scheme, on_cuda, encode("torch", scheme, x), n)
    if native.available():
        assert_payloads_agree(scheme, on_cuda, encode("native", scheme, x), n)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", CODECS, ids=codec_id)
@pytest.mark.parametrize("n", LENGTHS)
def test_every_payload_decodes_alike_on_every_route(scheme: PackedScheme, n: int) -> None:
    x = gradient(n)
    routes = [r for r in ROUTES if r != "native" or native.available()]
    for made_by in routes:
        payload = encode(made_by, scheme, x)
        reference = decode("torch", scheme, payload, n)
        for route in routes:
            assert torch.equal(decode(route, scheme, payload, n), reference), (made_by, route)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [HalfPayload(torch.float16), Compression.bf16,
                                    Compression.vote(), Compression.onebit(bucket_size=8),
                                    Compression.qsgd(bits=3, bucket_size=8),
                                    Compression.terngrad(bucket_size=10)], ids=codec_id)
def test_non_finite_inputs_decode_alike(scheme: PackedScheme) -> None:
    """NaN and infinities: the decoded values agree on every route (NaN where NaN); the
    payload bytes are not compared, as NaN bit patterns differ between the devices."""
    x = gradient(40)
    x[3], x[17], x[30] = float("nan"), float("inf"), float("-inf")
    routes = [r for r in ROUTES if r != "native" or native.available()]
    decoded = {r: decode(r, scheme, encode(r, scheme, x), 40) for r in routes}
    for route in routes[1:]:
        torch.testing.assert_close(decoded[route], decoded["cuda"], rtol=0, atol=0,
                                   equal_nan=True, msg=route)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [c for c in CODECS if randomised(c)], ids=codec_id)
def test_cuda_draws_are_seeded_and_on_the_grid(scheme: PackedScheme) -> None:
    """With CUDA's own generator: the same seed gives the same payload, another step
    another one; the scales agree with the CPU's, and each decoded value is one of the two
    grid points around its input, with its sign."""
    n = 300_001
    x = gradient(n)
    xc = x.to(CUDA)
    with native.disabled():
        first = scheme.encode(xc, generator(CUDA))
        assert torch.equal(scheme.encode(xc, generator(CUDA)), first)
        assert not torch.equal(scheme.encode(xc, generator(CUDA, step=1)), first)
        decoded = scheme.decode(first, n).cpu()
    first = first.cpu()
    cut = code_bytes(scheme, n)
    scales = first[cut:].clone().view(torch.float32)
    cpu_scales = encode("torch", scheme, x)[cut:].clone().view(torch.float32)
    if float64_stats(scheme):
        assert_scales_agree(scales, cpu_scales)
    else:
        assert torch.equal(scales, cpu_scales)
    per_element = scales.repeat_interleave(scheme.bucket_size)[:n]
    step = per_element / scheme.levels if isinstance(scheme, QSGD) else per_element
    if isinstance(scheme, TernGrad) and scheme.clip is not None:
        x = torch.maximum(torch.minimum(x, per_element), -per_element)
    assert bool((decoded * x >= 0).all())
    assert bool(((decoded - x).abs() <= step * (1 + 1e-6)).all())


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::hvd_compress.schemes.threshold.ThresholdCapWarning")
@pytest.mark.parametrize("spec", ["topk:ratio=0.001", "topk:ratio=0.001,values=fp16",
                                  "dgc:ratio=0.001", "randomk:ratio=0.01",
                                  "threshold:tau=2.5,max_ratio=0.1",
                                  "threshold:tau=0.5,max_ratio=0.001"])
def test_sparse_selection_is_the_same_on_cuda(spec: str) -> None:
    """The pairs a sparse scheme sends (its first request), as index-sorted sets: the same
    on CUDA as on the CPU (random-k all-reduces the values at indices that every rank
    draws on the CPU: those values). 1 M elements take the sampled-threshold paths (top-k,
    DGC), and the last threshold setting its cap (the largest of those over tau)."""
    n = (1 << 20) + 7
    x = gradient(n, seed=3)
    sent = {}
    for name, device in (("cpu", CPU), ("cuda", CUDA)):
        scheme = Compression.parse(spec)
        ctx = ExchangeContext("w", 0, 1, step=100)
        request = next(scheme.exchange(x.to(device), {}, ctx))
        if isinstance(request, AllReduce):  # random-k: indices drawn on the CPU, values
            sent[name] = (torch.zeros(0), request.tensor.cpu())
            continue
        order = request.indices.argsort()
        sent[name] = (request.indices[order].cpu(), request.values[order].cpu())
    assert torch.equal(sent["cuda"][0], sent["cpu"][0])
    assert torch.equal(sent["cuda"][1], sent["cpu"][1])
