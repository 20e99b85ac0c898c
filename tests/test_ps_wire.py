"""The parameter server's framed sparse wire format (hvd_compress.sparse_wire)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from hvd_compress import native
from hvd_compress.sparse_wire import (
    HEADER_BYTES,
    IndexCoding,
    Kind,
    ValueDType,
    decode_frame,
    encode_frame,
    frame_bound,
    pairs_nbytes,
    split_frames,
    varint_decode,
    varint_encode,
    varint_nbytes,
)

pytestmark = pytest.mark.usefixtures("sparse_path")


def _frame(numel: int = 1000, indices=(0, 5, 999), dtype: str = "fp32", **kw) -> bytes:
    values = np.arange(1, len(indices) + 1, dtype=np.float32)
    return encode_frame(Kind.PUSH, "layer.weight", 1, 2, 7, 3, numel, np.array(indices),
                        values, dtype, **kw)


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_varint_roundtrip_edges():
    gaps = np.array([0, 1, 127, 128, 300, 16383, 16384, 2**32 - 1], dtype=np.uint64)
    encoded = varint_encode(gaps)
    assert encoded[:4].tolist() == [0, 1, 127, 0x80]  # 128 starts with a continued group
    assert encoded.size == varint_nbytes(gaps) == 1 + 1 + 1 + 2 + 2 + 2 + 3 + 5
    assert varint_decode(encoded, gaps.size).tolist() == gaps.tolist()


@pytest.mark.parametrize("coding", list(IndexCoding))
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_roundtrip_every_coding(coding, dtype):
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(5000, 300, replace=False))
    val = rng.standard_normal(300).astype(np.float32)
    frame = decode_frame(encode_frame(Kind.PUSH, "w", 0, 1, 2**40, 5, 5000, idx, val, dtype,
                                      coding))
    assert (frame.kind, frame.tensor, frame.round, frame.worker, frame.numel) == \
        (Kind.PUSH, "w", 2**40, 5, 5000)
    assert frame.coding is coding and frame.dtype is ValueDType.parse(dtype)
    dense = np.zeros(5000, np.float32)
    dense[frame.indices] = frame.values
    expected = np.zeros(5000, np.float32)
    expected[idx] = val.astype(frame.values.dtype)
    np.testing.assert_array_equal(dense, expected)


def test_coding_is_the_smallest():
    sparse = decode_frame(_frame(100_000, (3, 50_000)))
    assert sparse.coding is IndexCoding.VARINT
    half = decode_frame(_frame(1000, tuple(range(0, 1000, 2))))
    assert half.coding is IndexCoding.BITMAP
    full = decode_frame(_frame(100, tuple(range(100))))
    assert full.coding is IndexCoding.DENSE and full.count == 100
    empty = _frame(100, ())
    assert len(empty) == HEADER_BYTES + len("layer.weight") + 4


def test_topk_0p1_percent_fp16_is_800x_smaller_than_dense_fp32():
    numel = 4096 * 4096
    rng = np.random.default_rng(1)
    grad = rng.standard_normal(numel).astype(np.float32)
    k = numel // 1000
    idx = np.sort(np.argpartition(-np.abs(grad), k - 1)[:k])
    payload = encode_frame(Kind.PUSH, "fc.weight", 0, 1, 0, 0, numel, idx, grad[idx], "fp16")
    ratio = 4 * numel / len(payload)
    print(f"top-k 0.1% fp16 on 4096x4096: {len(payload)} bytes, {ratio:.0f}x smaller")
    assert ratio >= 800
    frame = decode_frame(payload)
    np.testing.assert_array_equal(frame.indices, idx)
    np.testing.assert_array_equal(frame.values, grad[idx].astype(np.float16))


def test_encoder_refuses_bad_input():
    with pytest.raises(ValueError, match="strictly increasing"):
        _frame(10, (3, 3))
    with pytest.raises(ValueError, match="strictly increasing"):
        _frame(10, (4, 2))
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        _frame(10, (10,))
    with pytest.raises(ValueError, match="fp32 or fp16"):
        _frame(dtype="bf16")


def _corrupt(frame: bytes, offset: int, fmt: str, value: int, trim: int = 0) -> bytes:
    """Overwrite a header field (and drop ``trim`` trailing body bytes), with a valid CRC."""
    body = bytearray(frame[: len(frame) - 4 - trim])
    struct.pack_into(fmt, body, offset, value)
    return _recrc(bytes(body))


@pytest.mark.parametrize("make, message", [
    (lambda f: f[:-1], "CRC mismatch"),
    (lambda f: f[:20], "truncated"),
    (lambda f: f[:-5] + bytes([f[-5] ^ 1]) + f[-4:], "CRC mismatch"),
    (lambda f: b"XXXX" + f[4:], "magic"),
    (lambda f: _corrupt(f, 4, "<B", 9), "version 9"),
    (lambda f: _corrupt(f, 5, "<B", 9), "unknown kind 9"),
    (lambda f: _corrupt(f, 6, "<B", 7), "unknown index coding"),
    (lambda f: _corrupt(f, 7, "<B", 5), "unknown value dtype"),
    (lambda f: _corrupt(f, 20, "<I", 2), "shard index 2"),
    (lambda f: _corrupt(f, 28, "<Q", 2**50), "exceeds the limit"),
    (lambda f: _corrupt(f, 28, "<Q", 2), "pairs in a shard of only 2"),
    (lambda f: _corrupt(f, 36, "<Q", 2), "header describes"),
    (lambda f: _corrupt(f, 36, "<Q", 2, trim=4), "varints, header says 2"),
    (lambda f: _corrupt(f, 36, "<Q", 2**40), "pairs in a shard"),
    (lambda f: _corrupt(f, 44, "<I", 2**31), "cannot hold"),
    (lambda f: _corrupt(f, 48, "<H", 0), "name length 0"),
    (lambda f: _recrc(f[:-4] + b"\0"), "header describes"),
], ids=["no-crc", "short", "bit-flip", "magic", "version", "kind", "coding", "dtype",
        "shard", "absurd-numel", "count>numel", "wrong-count", "wrong-count-sized",
        "absurd-count",
        "absurd-index-bytes", "name", "trailing"])
def test_decoder_rejects_malformed(make, message):
    with pytest.raises(ValueError, match=message):
        decode_frame(make(_frame()))


def test_decoder_rejects_out_of_range_indices():
    # The last varint gap is re-encoded so the index lands beyond numel = 1000.
    frame = _frame(1000, (0, 5, 999))
    name_end = HEADER_BYTES + len("layer.weight")
    index = varint_encode(np.array([0, 4, 1000], np.uint64)).tobytes()
    body = bytearray(frame[:name_end])
    struct.pack_into("<I", body, 44, len(index))
    bad = _recrc(bytes(body) + index + frame[name_end + 4 : -4])  # old section was 4 bytes
    with pytest.raises(ValueError, match=r"out of range|beyond numel"):
        decode_frame(bad)
    bitmap = _frame(1001, tuple(range(0, 1001, 2)))  # bitmap coding, padding bits zero
    assert decode_frame(bitmap).coding is IndexCoding.BITMAP
    body = bytearray(bitmap[:-4])
    body[name_end + 125] |= 0x80  # bit 1007, past numel
    with pytest.raises(ValueError, match="beyond numel"):
        decode_frame(_recrc(bytes(body)))


def test_decoder_rejects_non_canonical_varint():
    with pytest.raises(ValueError, match="non-canonical"):
        varint_decode(np.array([0x85, 0x00], np.uint8), 1)
    with pytest.raises(ValueError, match="inside a varint"):
        varint_decode(np.array([0x01, 0x85], np.uint8), 1)


@pytest.mark.parametrize("density", [0.001, 0.3, 1.0])
def test_pairs_nbytes_is_the_frame_minus_header_name_and_crc(density):
    rng = np.random.default_rng(5)
    numel = 10_000
    idx = rng.choice(numel, int(density * numel), replace=False)
    for dtype in ("fp32", "fp16"):
        frame = encode_frame(Kind.PUSH, "w", 0, 1, 0, 0, numel, np.sort(idx),
                             rng.standard_normal(idx.size), dtype)
        assert pairs_nbytes(idx, numel, dtype) == len(frame) - HEADER_BYTES - len("w") - 4


def test_frame_bound_holds_wherever_the_indices_lie_and_is_reached():
    # Top-k's sums on a torch.distributed group travel in slots of frame_bound bytes.
    rng = np.random.default_rng(7)
    for trial in range(600):
        numel = int(rng.integers(1, 400_000))
        count = int(rng.integers(0, min(numel, 2000) + 1))
        if trial % 3 == 0:
            idx = rng.choice(numel, count, replace=False)
        elif trial % 3 == 1:  # evenly spread: the largest gaps that fit
            idx = np.unique(np.linspace(0, numel - 1, count).astype(np.int64))
        else:  # one stride from 0, up to the end
            idx = np.arange(count) * int(rng.integers(1, 40_000))
            idx = idx[idx < numel]
        idx = np.sort(idx)
        for dtype in ("fp32", "fp16"):
            frame = encode_frame(Kind.PUSH, "12", 0, 1, 0, 3, numel, idx,
                                 rng.standard_normal(idx.size), dtype)
            assert len(frame) <= frame_bound("12", numel, idx.size, dtype), (numel, idx.size)
    # Every gap at 2**7 (two varint bytes each) uses all the room: the bound is met exactly.
    count = 1000
    idx = np.arange(count) * 129 + 128
    frame = encode_frame(Kind.PUSH, "w", 0, 1, 0, 0, 129 * count, idx, np.ones(count), "fp32")
    assert len(frame) == frame_bound("w", 129 * count, count, "fp32")
    # One more element of room cannot buy a third byte for any gap.
    assert frame_bound("w", 129 * count + 1, count, "fp32") == len(frame)
    with pytest.raises(ValueError, match="do not fit"):
        frame_bound("w", 5, 6, "fp32")


def test_split_frames_recovers_concatenated_frames():
    frames = [encode_frame(Kind.PUSH, f"t{w}", 0, 1, 3, w, 50, np.arange(w, 50, 7),
                           np.full(len(range(w, 50, 7)), float(w)), "fp16")
              for w in range(3)]
    decoded = split_frames(b"".join(frames))
    assert [f.worker for f in decoded] == [0, 1, 2]
    assert [f.tensor for f in decoded] == ["t0", "t1", "t2"]
    assert np.array_equal(decoded[2].indices, np.arange(2, 50, 7))
    with pytest.raises(ValueError, match="truncated"):
        split_frames(b"".join(frames)[:-3])
    with pytest.raises(ValueError, match="magic"):
        split_frames(frames[0] + b"XXXX" + frames[1][4:])


def test_native_and_numpy_frames_are_byte_identical():
    rng = np.random.default_rng(11)
    for numel, k in [(1, 1), (300, 7), (2**20, 1000), (2**31, 50)]:
        idx = np.sort(rng.choice(min(numel, 2**24), k, replace=False)) * (numel // 2**24 or 1)
        val = rng.standard_normal(k)
        frame = encode_frame(Kind.PUSH, "w", 0, 1, 0, 0, numel, idx, val, "fp16",
                             IndexCoding.VARINT)
        with native.disabled():
            assert encode_frame(Kind.PUSH, "w", 0, 1, 0, 0, numel, idx, val, "fp16",
                                IndexCoding.VARINT) == frame
        assert np.array_equal(decode_frame(frame).indices, idx)

