"""Bit-exact layouts and round trips of every packed format, odd lengths included."""

from __future__ import annotations

import pytest
import torch

from hvd_compress import wire

LENGTHS = [0, 1, 5, 7, 8, 9, 31, 1000, 1001]


@pytest.mark.parametrize("n", LENGTHS)
def test_bits_round_trip(n: int) -> None:
    bits = torch.rand(n) < 0.5
    packed = wire.pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == wire.bits_nbytes(n) == (n + 7) // 8
    assert torch.equal(wire.unpack_bits(packed, n), bits)


def test_bits_layout_is_lsb_first() -> None:
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert wire.pack_bits(bits).tolist() == [0b1000_0001, 0b0000_0001]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", LENGTHS)
def test_codes_round_trip(bits: int, n: int) -> None:
    codes = torch.randint(0, 2**bits, (n,), dtype=torch.uint8)
    packed = wire.pack_codes(codes, bits)
    assert packed.numel() == wire.codes_nbytes(n, bits)
    assert torch.equal(wire.unpack_codes(packed, n, bits), codes)


def test_codes_layouts() -> None:
    # 4-bit codes: two per byte, the first in the low nibble.
    assert wire.pack_codes(torch.tensor([1, 2, 15]), 4).tolist() == [0x21, 0x0F]
    # 3-bit codes: bit planes. Codes 5 (101), 2 (010): plane 0 = [1, 0], plane 1 = [0, 1],
    # plane 2 = [1, 0].
    assert wire.pack_codes(torch.tensor([5, 2]), 3).tolist() == [0b01, 0b10, 0b01]
    # Exact sizes: ceil(n * b / 8) when b divides 8, b * ceil(n / 8) otherwise.
    assert wire.codes_nbytes(1001, 4) == 501 and wire.codes_nbytes(1001, 3) == 3 * 126


@pytest.mark.parametrize("n", LENGTHS)
def test_trits_round_trip(n: int) -> None:
    trits = torch.randint(-1, 2, (n,), dtype=torch.int8)
    packed = wire.pack_trits(trits)
    assert packed.numel() == wire.trits_nbytes(n) == (n + 4) // 5
    assert torch.equal(wire.unpack_trits(packed, n), trits)


def test_trits_layout_is_base_three() -> None:
    # Digits t + 1 = [0, 1, 2, 2, 1] weighted 1, 3, 9, 27, 81.
    assert wire.pack_trits(torch.tensor([-1, 0, 1, 1, 0])).tolist() == [0 + 3 + 18 + 54 + 81]


def test_floats_round_trip_from_any_offset() -> None:
    values = torch.randn(7)
    payload = torch.cat([torch.zeros(3, dtype=torch.uint8), wire.floats_to_bytes(values)])
    assert torch.equal(wire.bytes_to_floats(payload[3:]), values)


def test_size_mismatch_is_reported() -> None:
    with pytest.raises(ValueError, match="expected 2"):
        wire.unpack_bits(torch.zeros(3, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match=r"1\.\.8"):
        wire.pack_codes(torch.zeros(4), 9)
