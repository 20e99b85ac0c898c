"""The aggregate frame sized by writing its varint section once
(:func:`hvd_compress.native.round.varint_section` and :func:`~hvd_compress.native.round.
assemble_frame`) is, byte for byte, the delta+varint section and the frame that the numpy
coding and :func:`hvd_compress.sparse_wire.encode_frame` give, and the server picks the
same index coding as before, including at the varint/bitmap boundary."""

from __future__ import annotations

import numpy as np
import pytest

from hvd_compress import native
from hvd_compress.native import round as native_round
from hvd_compress.sparse_wire import IndexCoding, Kind, ValueDType, decode_frame, encode_frame
from ps_server.rounds import Finished, encode_aggregate

pytestmark = pytest.mark.skipif(not native.available(), reason="native kernels not built")


def _numpy_varints(indices: np.ndarray) -> bytes:
    """The delta+varint section, one varint at a time (the format's definition)."""
    out = bytearray()
    prev = -1
    for i in indices.tolist():
        gap = i - prev - 1
        prev = i
        while gap >= 0x80:
            out.append((gap & 0x7F) | 0x80)
            gap >>= 7
        out.append(gap)
    return bytes(out)


def _gapped(rng: np.random.Generator, count: int, bits: int) -> np.ndarray:
    """``count`` increasing indices whose gaps take up to ``bits`` bits."""
    gaps = rng.integers(0, 1 << bits, count, dtype=np.int64)
    return np.cumsum(gaps + 1) - 1


@pytest.mark.parametrize("count", [0, 1, 2, 31, 32, 33, 64, 65, 1000, 40_000])
@pytest.mark.parametrize("bits", [1, 7, 8, 14, 15, 21, 28, 34])
def test_the_written_section_is_the_numpy_coding(count, bits):
    """Gaps of one to five bytes, in and out of the 32-gap vector blocks, and blocks that
    fall back one varint at a time (a gap of three bytes or more)."""
    rng = np.random.default_rng(count * 100 + bits)
    indices = _gapped(rng, count, bits)
    section = native_round.varint_section(indices)
    assert section.tobytes() == _numpy_varints(indices)


def test_a_section_stays_valid_until_the_next_call_and_the_scratch_grows():
    rng = np.random.default_rng(5)
    small, large = _gapped(rng, 100, 10), _gapped(rng, 50_000, 12)
    first = native_round.varint_section(small).tobytes()
    assert native_round.varint_section(large).tobytes() == _numpy_varints(large)
    assert native_round.varint_section(small).tobytes() == first


@pytest.mark.parametrize("count", [0, 1, 33, 5000])
def test_an_assembled_frame_is_encode_frames_bytes(count):
    rng = np.random.default_rng(count)
    numel = 1 << 20
    indices = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    values = rng.standard_normal(count).astype(np.float32)
    reference = encode_frame(Kind.AGGREGATE, "t/a", 0, 1, 3, 0, numel, indices, values)
    finished = Finished(3, indices, values)
    assert encode_aggregate("t/a", 0, 1, finished, 0, numel, ValueDType.FP32) == reference
    frame = decode_frame(reference)
    assert frame.coding is IndexCoding.VARINT
    np.testing.assert_array_equal(frame.indices, indices)


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_the_coding_at_the_varint_and_bitmap_boundary_is_encode_frames(extra):
    """At as many pairs as the bitmap has bytes (every gap one byte), the varint section
    ties the bitmap and wins the tie; a pair more, the bitmap wins; both as
    encode_frame chooses."""
    numel = 8 * 4096
    count = numel // 8 + extra
    rng = np.random.default_rng(extra + 1)
    indices = np.sort(rng.choice(1 << 12, count, replace=False)) if count <= 4096 else None
    if indices is None:
        indices = np.arange(count, dtype=np.int64)
    indices = indices.astype(np.int64)
    values = rng.standard_normal(count).astype(np.float32)
    reference = encode_frame(Kind.AGGREGATE, "t/b", 0, 1, 1, 0, numel, indices, values)
    finished = Finished(1, indices, values)
    assert encode_aggregate("t/b", 0, 1, finished, 0, numel, ValueDType.FP32) == reference
    expected = IndexCoding.BITMAP if extra > 0 else IndexCoding.VARINT
    assert decode_frame(reference).coding is expected
