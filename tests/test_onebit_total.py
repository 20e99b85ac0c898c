"""1-bit's native total (``hvdc_onebit_total``, counted from the sign bits by popcount)
against the sum the code-unpacking kernel forms, reproduced here in Python: per bucket the
integer ``2 * ones - len`` times the bucket's scale, added in float64 bucket by bucket
within a tile, then tile by tile. Equal as doubles, bit for bit, for every length, bucket
size, thread count, padding bits and non-finite scales."""

from __future__ import annotations

import math
import struct

import pytest
import torch

from hvd_compress import wire
from hvd_compress.native import tensors as kernels

pytestmark = pytest.mark.skipif(not kernels.active(torch.zeros(1)),
                                reason="native kernels unavailable")

TILE_TARGET = 16384
"""``kTileTarget`` of native/codecs.cpp: a tile holds whole buckets, at least this many
elements."""


def reference_total(payload: bytes, n: int, bucket: int) -> float:
    """The float64 total of a 1-bit payload in the kernels' order of additions."""
    tile = bucket if bucket >= TILE_TARGET else bucket * -(-TILE_TARGET // bucket)
    bits_nbytes = (n + 7) // 8
    out = 0.0
    for e0 in range(0, n, tile):
        tile_sum = 0.0
        for b0 in range(e0, min(e0 + tile, n), bucket):
            length = min(bucket, n - b0)
            ones = sum((payload[(b0 + i) // 8] >> ((b0 + i) % 8)) & 1 for i in range(length))
            at = bits_nbytes + 4 * (b0 // bucket)
            scale = struct.unpack("<f", payload[at:at + 4])[0]
            tile_sum += float(2 * ones - length) * scale
        out += tile_sum
    return out


def random_payload(n: int, bucket: int, seed: int, special: bool) -> torch.Tensor:
    """Random sign bits (the padding bits past ``n`` random too, as a peer could send
    them) and random scales; ``special``: infinite, NaN and zero scales among them."""
    gen = torch.Generator().manual_seed(seed)
    buckets = -(-n // bucket)
    bits = torch.randint(0, 256, (wire.bits_nbytes(n),), generator=gen, dtype=torch.uint8)
    scales = torch.rand(buckets, generator=gen) * 10.0 ** torch.randint(-8, 8, (buckets,),
                                                                       generator=gen)
    if special and buckets >= 4:
        scales[1], scales[2], scales[3] = math.inf, math.nan, 0.0
    return torch.cat([bits, wire.floats_to_bytes(scales.float())])


@pytest.mark.parametrize("bucket", [8, 64, 2048, 32768])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 2047, 2049, 16385, 70001, 200003])
@pytest.mark.parametrize("special", [False, True])
def test_total_counts_bits_in_the_kernels_order(bucket: int, n: int, special: bool) -> None:
    payload = random_payload(n, bucket, n + bucket, special)
    want = reference_total(bytes(payload.numpy()), n, bucket)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = kernels.total("onebit", payload, n, bucket)
            if math.isnan(want):
                assert math.isnan(got)
            else:
                assert struct.pack("<d", got) == struct.pack("<d", want)
    finally:  # the process's other tests keep their thread count
        torch.set_num_threads(before)


def test_total_of_an_encoding_is_its_decoded_sum() -> None:
    """Through the codec: the total of a 1-bit payload is the float64 sum of its decoded
    values (exactly, here: few buckets of scales that add without rounding)."""
    from hvd_compress import Compression

    codec = Compression.onebit(bucket_size=64)
    x = torch.tensor([0.5, -0.25, 1.0, -1.0] * 40 + [2.0, -2.0, 3.0])
    payload = codec.encode(x, torch.Generator())
    decoded = codec.decode(payload, x.numel()).double()
    assert kernels.total("onebit", payload, x.numel(), 64) == float(decoded.sum())
