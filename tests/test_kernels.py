"""The native CPU kernels (:mod:`hvd_compress.native`): codecs against the schemes' torch code,
and the sparse kernels' guards against malformed input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hvd_compress import Compression, native
from hvd_compress.native import buffers
from hvd_compress.native import sparse as native_sparse
from hvd_compress.schemes.base import ExchangeContext
from hvd_compress.schemes.packed import PackedScheme
from hvd_compress.sparse_wire import varint_decode

CODECS = [
    Compression.onebit(), Compression.onebit(bucket_size=64), Compression.onebit(bucket_size=8),
    *(Compression.qsgd(bits=b) for b in range(2, 9)),
    Compression.qsgd(bits=4, bucket_size=51), Compression.qsgd(bits=3, bucket_size=50),
    Compression.qsgd(bits=5, bucket_size=64, norm="l2"), Compression.qsgd(bits=2, norm="l2"),
    Compression.terngrad(), Compression.terngrad(bucket_size=16),
    Compression.terngrad(bucket_size=30, clip=2.5, error_feedback=True),
]
LENGTHS = [0, 1, 7, 63, 64, 65, 1000, 100_003]  # the last is coded by several threads


def gradient(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * torch.rand(n, generator=gen).square()


def generator(step: int = 0) -> torch.Generator:
    return ExchangeContext("w", 0, 1, step).generator("encode", torch.device("cpu"))


def torch_encode(scheme: PackedScheme, x: torch.Tensor, step: int = 0) -> torch.Tensor:
    with native.disabled():
        return scheme.encode(x, generator(step))


def torch_decode(scheme: PackedScheme, payload: torch.Tensor, n: int) -> torch.Tensor:
    with native.disabled():
        return scheme.decode(payload, n)


def code_bytes(scheme: PackedScheme, n: int) -> int:
    buckets = (n + scheme.bucket_size - 1) // scheme.bucket_size
    return scheme.chunk_bytes(n) - 4 * buckets


def test_kernels_are_built_and_used() -> None:
    assert native.library() is not None, "the native kernels failed to build"
    assert native.active(torch.zeros(1))
    with native.disabled():
        assert not native.active(torch.zeros(1))
    assert native.active(torch.zeros(1))


@pytest.mark.parametrize("scheme", CODECS, ids=repr)
@pytest.mark.parametrize("n", LENGTHS)
def test_both_paths_decode_every_payload_alike(scheme: PackedScheme, n: int) -> None:
    x = gradient(n)
    for payload in (torch_encode(scheme, x), scheme.encode(x, generator())):
        assert payload.numel() == scheme.chunk_bytes(n)
        assert torch.equal(scheme.decode(payload, n), torch_decode(scheme, payload, n))


def assert_scales_agree(fast: torch.Tensor, reference: torch.Tensor) -> None:
    """The float32 scales of two payloads equal, or one unit in the last place apart.

    Both codecs reduce a bucket in float64 and round once to float32, but in different
    orders: the native kernel in 8 lanes, ATen in the order of its vector width (which
    changes with the CPU). The float64 sums differ in their last bits for some buckets (9
    of 49 at 100,003 elements, varying with the kernels), and their float32 roundings
    differ only where the two straddle a rounding boundary (about 2^-29 per scale; no
    difference seen under ATen's default, AVX2 and AVX-512 kernels). That is the tightest
    bound that holds on every CPU."""
    a, b = fast.view(torch.int32), reference.view(torch.int32)  # one sign: ulps apart
    assert bool(((a - b).abs() <= 1).all()), (a - b).abs().max()


@pytest.mark.parametrize("scheme", CODECS, ids=repr)
@pytest.mark.parametrize("n", LENGTHS)
def test_scales_match_and_codes_are_valid(scheme: PackedScheme, n: int) -> None:
    """Codes equal for onebit (deterministic), and its scales (:func:`assert_scales_agree`);
    for the stochastic schemes the scales agree and every decoded value is one of the two
    grid points around its input."""
    x = gradient(n)
    fast, reference = scheme.encode(x, generator()), torch_encode(scheme, x)
    cut = code_bytes(scheme, n)
    assert_scales_agree(fast[cut:].clone().view(torch.float32),
                        reference[cut:].clone().view(torch.float32))
    if scheme.name == "onebit":
        assert torch.equal(fast[:cut], reference[:cut])
        return
    scales = fast[cut:].clone().view(torch.float32).repeat_interleave(scheme.bucket_size)[:n]
    step = scales / scheme.levels if scheme.name == "qsgd" else scales
    decoded = scheme.decode(fast, n)
    if scheme.name == "terngrad" and scheme.clip is not None:
        x = torch.maximum(torch.minimum(x, scales), -scales)  # within the clipped range
    assert bool((decoded * x >= 0).all())  # no sign flips
    assert bool(((decoded - x).abs() <= step * (1 + 1e-6)).all())


@pytest.mark.parametrize("scheme", [Compression.qsgd(), Compression.terngrad()], ids=repr)
def test_draws_are_seeded_and_independent_of_threads(scheme: PackedScheme) -> None:
    x = gradient(300_000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = scheme.encode(x, generator())
        torch.set_num_threads(2)
        assert torch.equal(scheme.encode(x, generator()), single)
    finally:
        torch.set_num_threads(threads)
    assert not torch.equal(scheme.encode(x, generator(step=1)), single)


@pytest.mark.parametrize("scheme", [Compression.onebit(bucket_size=8), Compression.qsgd(bits=3,
                                    bucket_size=8), Compression.terngrad(bucket_size=10)],
                         ids=repr)
def test_non_finite_buckets_decode_alike(scheme: PackedScheme) -> None:
    x = gradient(40)
    x[3], x[17], x[30] = float("nan"), float("inf"), float("-inf")
    for payload in (torch_encode(scheme, x), scheme.encode(x, generator())):
        torch.testing.assert_close(scheme.decode(payload, 40), torch_decode(scheme, payload, 40),
                                   rtol=0, atol=0, equal_nan=True)
    if scheme.name == "onebit":
        assert torch.equal(scheme.encode(x, generator()), torch_encode(scheme, x))


def test_decode_accepts_a_section_at_any_offset() -> None:
    scheme = Compression.qsgd(bits=4, bucket_size=5)
    x = gradient(23)
    payload = scheme.encode(x, generator())
    shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]
    assert torch.equal(scheme.decode(shifted, 23), scheme.decode(payload, 23))


def test_large_buffers_are_recycled_once_released() -> None:
    numel = (buffers.POOL_MIN_BYTES >> 2) + 3
    first = native.empty(numel, torch.float32)
    address = first.data_ptr()
    view = first[5:].view(torch.uint8)
    del first
    held = native.empty(numel, torch.float32)  # a view still holds the first block
    assert held.data_ptr() != address
    held.fill_(2.0)
    assert float(held.sum()) == 2.0 * numel
    del view
    assert native.empty(numel + 1, torch.float32).data_ptr() == address  # same 2 MiB size
    assert buffers.pooled_bytes() >= 2 * buffers.BLOCK_ROUND
    small = native.empty(10, torch.float16)
    assert small.shape == (10,) and small.dtype == torch.float16
    assert native.empty(numel, torch.float32, "meta").device.type == "meta"


@pytest.mark.parametrize("frac", [0.5, 0.01, 0.001, 0.999])
@pytest.mark.parametrize("scheme", [Compression.qsgd(bits=8), Compression.terngrad(clip=None)],
                         ids=repr)
def test_rounding_frequencies_are_unbiased(scheme: PackedScheme, frac: float) -> None:
    """Over 2M elements of 8 steps, the share rounded up is the fraction to within 5 sigma."""
    n, steps = 1 << 18, 8
    grid = 1 / scheme.levels if scheme.name == "qsgd" else 1.0
    level = 10 if scheme.name == "qsgd" else 0
    x = torch.full((n,), (level + frac) * grid)
    x[:: scheme.bucket_size] = 1.0  # each bucket's scale
    rest = torch.ones(n, dtype=torch.bool)
    rest[:: scheme.bucket_size] = False
    up = 0
    for step in range(steps):
        decoded = scheme.decode(scheme.encode(x, generator(step)), n)[rest]
        up += int((decoded > x[rest]).sum())
    total = steps * int(rest.sum())
    target = float(x[1]) / grid - level  # the fraction as float32 holds it
    assert abs(up / total - target) <= 5 * (target * (1 - target) / total) ** 0.5


def test_native_varint_encoder_stops_at_its_buffer():
    """The encoder writes into 5 bytes per index; indices whose gaps would need longer
    varints (not increasing, or too far apart) raise instead of writing past the buffer."""
    for bad in ([7, 3], [5, 5], [0, 1, 2, -4], [2**40, 2**41, 2**42]):
        with pytest.raises(ValueError, match="strictly increasing"):
            native_sparse.varint_encode_indices(np.array(bad))
    encoded = native_sparse.varint_encode_indices(np.array([0, 127, 2**32 - 1]))
    assert np.array_equal(varint_decode(encoded, 3).astype(np.int64),
                          [0, 126, 2**32 - 1 - 127 - 1])


def test_native_merge_refuses_decreasing_indices():
    """The merge's block accumulator is indexed relative to the block: an index before the
    block (a list that decreases) raises instead of writing outside it."""
    ones = np.ones(2, np.float32)
    merged = native_sparse.merge_sum([(np.array([1, 9000]), ones), (np.array([9000, 20000]),
                                                                    ones)])
    assert merged is not None
    assert np.array_equal(merged[0], [1, 9000, 20000])
    assert np.array_equal(merged[1], [1, 2, 1])
    with pytest.raises(ValueError, match="increasing"):
        native_sparse.merge_sum([(np.array([20000, 3]), ones)])
