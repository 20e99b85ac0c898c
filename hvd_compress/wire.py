"""The wire format: how compressed gradients are laid out as bytes.

Every payload that crosses a process boundary is a flat ``torch.uint8`` tensor built by the
functions here, on the tensor's own device (no host round trip). Layouts are bit-exact and
documented so that another implementation could read them:

* **Bits** (:func:`pack_bits`): element ``i`` is bit ``i % 8`` (least significant first) of
  byte ``i // 8``; the last byte is zero-padded. ``ceil(n / 8)`` bytes.
* **Unsigned b-bit codes** (:func:`pack_codes`), ``1 <= b <= 8``: when ``b`` divides 8, byte
  ``j`` holds codes ``j*k .. j*k+k-1`` (``k = 8 // b``), code ``t`` of the byte in bits
  ``t*b .. t*b+b-1``; ``ceil(n / k)`` bytes. Otherwise the codes are stored as ``b`` bit
  planes, plane ``p`` (bit ``p`` of every code) packed with :func:`pack_bits`, planes in
  increasing ``p``; ``b * ceil(n / 8)`` bytes. Either way the size is exact and known from
  ``n`` and ``b`` alone (:func:`codes_nbytes`).
* **Trits** (:func:`pack_trits`): values in ``{-1, 0, 1}`` stored as digits ``t + 1`` in
  base 3, five per byte, element ``5j + d`` weighted ``3**d`` in byte ``j`` (``3**5 = 243 <=
  256``), so 1.6 bits per element; ``ceil(n / 5)`` bytes.
* **Floats** (:func:`floats_to_bytes`): IEEE-754 float32, little-endian (the native order
  of every platform torch supports).

The fused CPU kernels of :mod:`hvd_compress.native` (``codecs.cpp``) write and read the
same layouts for 1-bit, QSGD and TernGrad payloads; a change here must be made there too
(``tests/test_kernels.py`` compares the two).

Payloads made of several sections are concatenations in a fixed, documented order; each
scheme's docstring gives its order. The section sizes follow from the element count, so
collective payloads carry no header. Frames that travel outside Horovod (to the parameter
server) add a versioned header and a CRC.
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("hvd_compress's wire format assumes a little-endian host")

_BIT_WEIGHTS = [1 << i for i in range(8)]
_TRIT_WEIGHTS = [3**i for i in range(5)]


def _weights(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device)


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.numel()) % multiple
    if pad:
        x = torch.cat([x, x.new_zeros(pad)])
    return x


def bits_nbytes(n: int) -> int:
    """Bytes :func:`pack_bits` uses for ``n`` bits."""
    return (n + 7) // 8


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a flat bool (or 0/1 integer) tensor, 8 elements per byte, LSB first."""
    b = _pad_to(bits.reshape(-1).to(torch.uint8), 8).view(-1, 8)
    return (b * _weights(_BIT_WEIGHTS, b.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: the first ``n`` bits as a bool tensor."""
    _check_size("bits", packed, bits_nbytes(n))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts).bitwise_and_(1)
    return bits.view(-1)[:n].bool()


def codes_nbytes(n: int, bits: int) -> int:
    """Bytes :func:`pack_codes` uses for ``n`` codes of ``bits`` bits each."""
    _check_code_width(bits)
    if 8 % bits == 0:
        per_byte = 8 // bits
        return (n + per_byte - 1) // per_byte
    return bits * bits_nbytes(n)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned integer codes ``0 <= c < 2**bits`` (layout in the module docstring)."""
    _check_code_width(bits)
    c = codes.reshape(-1).to(torch.uint8)
    if 8 % bits == 0:
        per_byte = 8 // bits
        c = _pad_to(c, per_byte).view(-1, per_byte)
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=c.device)
        return (c << shifts).sum(dim=1, dtype=torch.uint8)
    planes = [pack_bits((c >> p) & 1) for p in range(bits)]
    return torch.cat(planes)


def unpack_codes(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: ``n`` codes as a uint8 tensor."""
    _check_size(f"{bits}-bit codes", packed, codes_nbytes(n, bits))
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        mask = (1 << bits) - 1
        codes = (packed.view(-1, 1) >> shifts).bitwise_and_(mask)
        return codes.view(-1)[:n]
    plane_bytes = bits_nbytes(n)
    codes = torch.zeros(n, dtype=torch.uint8, device=packed.device)
    for p in range(bits):
        plane = unpack_bits(packed[p * plane_bytes : (p + 1) * plane_bytes], n)
        codes |= plane.to(torch.uint8) << p
    return codes


def trits_nbytes(n: int) -> int:
    """Bytes :func:`pack_trits` uses for ``n`` trits."""
    return (n + 4) // 5


def pack_trits(trits: torch.Tensor) -> torch.Tensor:
    """Pack values in {-1, 0, 1}, five per byte in base 3 (1.6 bits per element)."""
    digits = _pad_to((trits.reshape(-1) + 1).to(torch.uint8), 5).view(-1, 5)
    # Padding zeros decode to -1 and are dropped by the element count on unpacking.
    return (digits * _weights(_TRIT_WEIGHTS, digits.device)).sum(dim=1, dtype=torch.uint8)


_TRIT_TABLES: dict[torch.device, torch.Tensor] = {}


def _trit_table(device: torch.device) -> torch.Tensor:
    table = _TRIT_TABLES.get(device)
    if table is None:
        byte = torch.arange(256, dtype=torch.int16)
        weights = torch.tensor(_TRIT_WEIGHTS, dtype=torch.int16)
        table = ((byte.view(-1, 1) // weights) % 3 - 1).to(torch.int8).to(device)
        _TRIT_TABLES[device] = table
    return table


def unpack_trits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_trits`: ``n`` values in {-1, 0, 1} as an int8 tensor.

    Bytes above 242 never come from :func:`pack_trits`; they decode to some trits rather
    than failing, as frames that cross process boundaries are checked by their CRC.
    """
    _check_size("trits", packed, trits_nbytes(n))
    return _trit_table(packed.device)[packed.long()].view(-1)[:n]


def floats_to_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 values as their little-endian bytes (4 per value)."""
    return x.reshape(-1).to(torch.float32).contiguous().view(torch.uint8)


def bytes_to_floats(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`floats_to_bytes`."""
    if b.numel() % 4:
        raise ValueError(f"malformed float section: {b.numel()} bytes is not a multiple of 4")
    if b.storage_offset() % 4 or not b.is_contiguous():
        b = b.clone()  # a section cut from a byte payload may start at any offset
    return b.view(torch.float32)


def split_sections(payload: torch.Tensor, sizes: list[int], what: str) -> list[torch.Tensor]:
    """Cut a payload into consecutive sections of the given byte sizes, checking the total."""
    _check_size(what, payload, sum(sizes))
    return list(torch.split(payload, sizes))


def _check_size(what: str, payload: torch.Tensor, expected: int) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1:
        raise ValueError(f"{what}: payload must be a flat uint8 tensor, got "
                         f"{payload.dtype} of shape {tuple(payload.shape)}")
    if payload.numel() != expected:
        raise ValueError(f"{what}: payload has {payload.numel()} bytes, expected {expected}")


def _check_code_width(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"code width must be 1..8 bits, got {bits}")
