"""Framed sparse messages between workers and the parameter server.

One definition, used by :mod:`hvd_compress.comm.ps_transport` and :mod:`ps_server`. A frame
is a self-describing byte string (host memory, numpy arrays; it travels as gRPC ``bytes``
or an MPI message)::

    offset size  field
     0      4    magic  b"HVPS"
     4      1    format version (VERSION)
     5      1    kind: 1 push, 2 pull request, 3 aggregate, 4 selected aggregate (the
                 pairs a worker pushed outside it stay with that worker: Kind.SELECTED)
     6      1    index coding: 0 delta+varint, 1 bitmap, 2 dense
     7      1    value dtype: 0 float32, 1 float16
     8      4    worker id (u32); in aggregates SERVER_ID, or SERVER_ID - m for a round
                 that closed by quorum without m workers (1 <= m < 2**16, so the field
                 stays far above any worker id: ps_protocol.quorum_sender, missing_of)
    12      8    round (u64)
    20      4    shard index (u32)
    24      4    shard count (u32)
    28      8    numel: dense element count of the shard (u64, <= MAX_NUMEL)
    36      8    count: number of (index, value) pairs (u64, <= numel)
    44      4    index section bytes (u32)
    48      2    tensor name length L (u16, 1..MAX_NAME_BYTES)
    50      L    tensor name, UTF-8
            ...  index section, then value section (count values, little-endian)
    end-4   4    CRC32 (zlib) of every preceding byte

All integers are little-endian. Indices are local to the shard (``0 <= i < numel``) and
strictly increasing. The index section is coded by whichever makes the frame smallest:

* **delta+varint**: gaps ``g_0 = i_0``, ``g_j = i_j - i_{j-1} - 1``, each as unsigned LEB128
  (7 bits per byte, least significant group first, high bit set on all but the last byte,
  no redundant trailing zero groups).
* **bitmap**: bit ``i`` set iff index ``i`` is present, packed like
  :func:`hvd_compress.wire.pack_bits` (LSB first); ``ceil(numel / 8)`` bytes, padding
  bits zero.
* **dense**: no index section; ``count == numel`` values, index ``i`` holding value ``i``.

Pull requests carry no pairs (``count = 0``); their value dtype asks for the aggregate's.
:func:`decode_frame` checks every field against the bytes actually received and raises
:class:`ValueError` saying what is wrong, before allocating anything sized by the header.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from hvd_compress.native import sparse as native_sparse

MAGIC = b"HVPS"
VERSION = 1
SERVER_ID = 0xFFFFFFFF
MAX_NUMEL = 1 << 32
MAX_NAME_BYTES = 1024
_MAX_VARINT_BYTES = native_sparse.MAX_VARINT_BYTES

_HEADER = struct.Struct("<4sBBBBIQIIQQIH")
HEADER_BYTES = _HEADER.size
_CRC_BYTES = 4


class Kind(IntEnum):
    PUSH = 1
    PULL = 2
    AGGREGATE = 3
    SELECTED = 4
    """An aggregate of some of the round's indices only (the server's ``--mode gtopk``):
    each worker keeps the pairs it pushed at the others in its residual."""


class IndexCoding(IntEnum):
    VARINT = 0
    BITMAP = 1
    DENSE = 2


class ValueDType(IntEnum):
    FP32 = 0
    FP16 = 1

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY_DTYPES[self]

    @classmethod
    def parse(cls, name: str | ValueDType) -> ValueDType:
        """``"fp32"``/``"float32"`` or ``"fp16"``/``"float16"`` (or a member)."""
        if isinstance(name, ValueDType):
            return name
        aliases = {"fp32": cls.FP32, "float32": cls.FP32, "fp16": cls.FP16, "float16": cls.FP16}
        try:
            return aliases[name.lower()]
        except KeyError:
            raise ValueError(f"value dtype must be fp32 or fp16, got {name!r}") from None


_NUMPY_DTYPES = {ValueDType.FP32: np.dtype("<f4"), ValueDType.FP16: np.dtype("<f2")}
# Members as module names: reading an enum member off its class costs a few hundred ns on
# Python 3.11, several times per decoded frame.
_VARINT, _BITMAP, _DENSE = IndexCoding.VARINT, IndexCoding.BITMAP, IndexCoding.DENSE
_INT64 = np.dtype(np.int64)


@dataclass(frozen=True)
class Frame:
    """A decoded frame. ``indices`` are int64 and local to the shard; ``values`` keep the
    wire dtype (float32 or float16). Dense frames have ``indices = arange(numel)``."""

    kind: Kind
    tensor: str
    shard: int
    shards: int
    round: int
    worker: int
    numel: int
    indices: np.ndarray
    values: np.ndarray
    coding: IndexCoding
    dtype: ValueDType

    @property
    def count(self) -> int:
        return int(self.values.size)

    def where(self) -> str:
        """``tensor 'w' shard 0/2 round 5 worker 1``, for error messages and logs."""
        who = "server" if self.worker == SERVER_ID else f"worker {self.worker}"
        return (f"tensor {self.tensor!r} shard {self.shard}/{self.shards} round {self.round} "
                f"{who}")


def crc32(data: bytes | bytearray | memoryview | np.ndarray, crc: int = 0) -> int:
    """``zlib.crc32(data, crc)``, by the native kernel for large buffers (same value)."""
    native = native_sparse.crc32(data, crc)
    return zlib.crc32(data, crc) if native is None else native


# Index codings -----------------------------------------------------------------------------
def varint_encode(gaps: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 of each element of ``gaps`` (uint64), concatenated, as uint8."""
    gaps = np.asarray(gaps, dtype=np.uint64)
    if gaps.size == 0:
        return np.zeros(0, dtype=np.uint8)
    nbytes = _varint_lengths(gaps)
    width = int(nbytes.max())
    shifts = np.arange(width, dtype=np.uint64) * np.uint64(7)
    groups = ((gaps[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    position = np.arange(width)
    groups[position[None, :] < (nbytes[:, None] - 1)] |= 0x80
    return groups[position[None, :] < nbytes[:, None]]


def _varint_lengths(gaps: np.ndarray) -> np.ndarray:
    """Bytes of each value's LEB128: 1 plus how many of 2**7, 2**14, ... it reaches."""
    lengths = np.ones(gaps.shape, dtype=np.int64)
    for k in range(1, 10):  # 2**63 needs 10 groups
        above = gaps >= np.uint64(1 << (7 * k))
        if not above.any():
            break
        lengths += above
    return lengths


def varint_decode(data: np.ndarray, count: int) -> np.ndarray:
    """Inverse of :func:`varint_encode`: exactly ``count`` values (uint64) from ``data``."""
    data = np.asarray(data, dtype=np.uint8)
    ends = np.flatnonzero((data & 0x80) == 0)
    if ends.size != count:
        raise ValueError(f"index section holds {ends.size} varints, header says {count} pairs")
    if count == 0:
        if data.size:
            raise ValueError(f"index section has {data.size} bytes but no pairs")
        return np.zeros(0, dtype=np.uint64)
    if ends[-1] != data.size - 1:
        raise ValueError("index section ends inside a varint (truncated or corrupt)")
    starts = np.empty_like(ends)
    starts[0] = 0
    starts[1:] = ends[:-1] + 1
    lengths = ends - starts + 1
    if int(lengths.max()) > _MAX_VARINT_BYTES:
        raise ValueError(f"varint longer than {_MAX_VARINT_BYTES} bytes: gap too large "
                         f"for any shard of at most {MAX_NUMEL} elements")
    if np.any((data[ends] == 0) & (lengths > 1)):
        raise ValueError("non-canonical varint (redundant trailing zero group)")
    position = np.arange(data.size) - np.repeat(starts, lengths)
    parts = (data & 0x7F).astype(np.uint64) << (position.astype(np.uint64) * np.uint64(7))
    return np.add.reduceat(parts, starts)


def varint_nbytes(gaps: np.ndarray) -> int:
    """Bytes :func:`varint_encode` takes for ``gaps``, without encoding."""
    gaps = np.asarray(gaps, dtype=np.uint64)
    return int(_varint_lengths(gaps).sum()) if gaps.size else 0


def bitmap_nbytes(numel: int) -> int:
    return (numel + 7) // 8


def _gaps(indices: np.ndarray) -> np.ndarray:
    gaps = np.empty(indices.size, dtype=np.int64)
    if indices.size:
        gaps[0] = indices[0]
        gaps[1:] = np.diff(indices) - 1
    return gaps.astype(np.uint64)


def _section_sizes(indices: np.ndarray, numel: int, itemsize: int,
                   varint: int | None = None) -> dict[IndexCoding, int]:
    """Bytes of the index and value sections in each coding; ``varint`` is the varint
    section's size when already known."""
    count = indices.size
    if varint is None:
        varint = native_sparse.varint_index_nbytes(indices)
    return {
        IndexCoding.VARINT: (varint_nbytes(_gaps(indices)) if varint is None else varint)
        + count * itemsize,
        IndexCoding.BITMAP: bitmap_nbytes(numel) + count * itemsize,
        IndexCoding.DENSE: numel * itemsize,
    }


def _smallest(sizes: dict[IndexCoding, int]) -> IndexCoding:
    return min(sizes, key=lambda coding: (sizes[coding], coding))


def choose_coding(indices: np.ndarray, numel: int, itemsize: int) -> IndexCoding:
    """The coding giving the smallest frame for these (valid, increasing) indices."""
    return _smallest(_section_sizes(indices, numel, itemsize))


def pairs_nbytes(indices: np.ndarray, numel: int, dtype: ValueDType | str) -> int:
    """Bytes of the index and value sections a frame of these (unique) pairs takes with the
    smallest coding, as :func:`encode_frame` chooses it; a frame adds its header, name and
    CRC."""
    idx = np.sort(np.asarray(indices, np.int64).ravel())
    return min(_section_sizes(idx, numel, ValueDType.parse(dtype).numpy.itemsize).values())


def varint_bound(count: int, total: int) -> int:
    """The most bytes :func:`varint_encode` can take for ``count`` gaps summing to at most
    ``total``. A gap takes one more byte at each of 2**7, 2**14, ...; each step up costs
    more gap than the one before, so the most bytes come from raising every gap one step
    at a time, cheapest first, until ``total`` runs out."""
    nbytes, left = count, total
    for step in range(1, 10):
        cost = (1 << (7 * step)) - ((1 << (7 * (step - 1))) if step > 1 else 0)
        raised = min(count, left // cost)
        nbytes += raised
        left -= raised * cost
        if raised < count:
            break
    return nbytes


def frame_bound(tensor: str, numel: int, count: int, dtype: ValueDType | str) -> int:
    """The most bytes :func:`encode_frame` takes for ``count`` strictly increasing indices
    in ``[0, numel)`` of a tensor named ``tensor``, whichever they are: its header, name
    and CRC, and the smallest coding's sections where their gaps (summing to at most
    ``numel - count``) are spread to need the most varint bytes (:func:`varint_bound`).
    What a collective of a size fixed in advance carries a frame in."""
    itemsize = ValueDType.parse(dtype).numpy.itemsize
    if not 0 <= count <= numel:
        raise ValueError(f"{count} pairs do not fit a tensor of {numel} elements")
    sections = min(varint_bound(count, numel - count), bitmap_nbytes(numel)) + \
        count * itemsize
    return HEADER_BYTES + len(tensor.encode("utf-8")) + min(sections, numel * itemsize) + \
        _CRC_BYTES


# Frames ------------------------------------------------------------------------------------
def encode_frame(kind: Kind, tensor: str, shard: int, shards: int, round: int, worker: int,
                 numel: int, indices: np.ndarray | None = None,
                 values: np.ndarray | None = None, dtype: ValueDType | str = ValueDType.FP32,
                 coding: IndexCoding | None = None) -> bytes:
    """Encode one frame. ``indices`` (local, strictly increasing) and ``values`` (cast to
    ``dtype``) default to none; ``coding`` defaults to the smallest (:func:`choose_coding`).
    """
    dtype = ValueDType.parse(dtype)
    name = tensor.encode("utf-8")
    if not 1 <= len(name) <= MAX_NAME_BYTES:
        raise ValueError(f"tensor name must be 1..{MAX_NAME_BYTES} UTF-8 bytes, "
                         f"got {len(name)}")
    if not 0 <= shard < shards <= 0xFFFFFFFF:
        raise ValueError(f"shard must satisfy 0 <= shard < shards, got {shard}/{shards}")
    if not 0 <= round < 1 << 64 or not 0 <= worker <= SERVER_ID:
        raise ValueError(f"round and worker must fit u64/u32, got {round} and {worker}")
    if not 0 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel must be 0..{MAX_NUMEL}, got {numel}")
    idx = np.zeros(0, np.int64) if indices is None else np.asarray(indices, np.int64).ravel()
    val = np.zeros(0, dtype.numpy) if values is None else np.asarray(values).ravel()
    if idx.size != val.size:
        raise ValueError(f"{idx.size} indices but {val.size} values")
    varint = None  # the varint section, made first when native: it checks the order too
    if idx.size:
        if idx[0] < 0 or idx[-1] >= numel:
            raise ValueError(f"indices must lie in [0, {numel}), got {idx.min()}..{idx.max()}")
        try:  # with the first and last index in range, a failure means a gap <= 0
            varint = native_sparse.varint_encode_indices(idx)
        except ValueError:
            varint = None
            ordered = False
        else:
            ordered = varint is not None or not np.any(np.diff(idx) <= 0)
        if not ordered:
            raise ValueError("indices must be strictly increasing (sorted, no duplicates)")
    val = val.astype(dtype.numpy, copy=False)
    if coding is None:
        coding = _smallest(_section_sizes(idx, numel, dtype.numpy.itemsize,
                                          None if varint is None else varint.nbytes))
    if coding is IndexCoding.VARINT:
        index_section = varint_encode(_gaps(idx)) if varint is None else varint
    elif coding is IndexCoding.BITMAP:
        bits = np.zeros(bitmap_nbytes(numel) * 8, dtype=bool)
        bits[idx] = True
        index_section = np.packbits(bits, bitorder="little")
    else:
        dense = np.zeros(numel, dtype=dtype.numpy)
        dense[idx] = val
        val, index_section = dense, np.zeros(0, np.uint8)
    head = pack_header(kind, coding, dtype, worker, round, shard, shards, numel, val.size,
                       index_section.nbytes, name)
    parts = [head, index_section, val]  # both contiguous (fresh arrays, ravel)
    crc = 0
    for part in parts:
        crc = crc32(part, crc)
    return b"".join([*parts, struct.pack("<I", crc)])  # one copy of the sections


def pack_header(kind: Kind, coding: IndexCoding, dtype: ValueDType, worker: int, round: int,
                shard: int, shards: int, numel: int, count: int, index_nbytes: int,
                name: bytes) -> bytes:
    """A frame's header followed by its tensor name (UTF-8): the bytes before its index
    section (fields as the module docstring gives them, not checked here)."""
    return _HEADER.pack(MAGIC, VERSION, int(kind), int(coding), int(dtype), worker, round,
                        shard, shards, numel, count, index_nbytes, len(name)) + name


def decode_frame(data: bytes | bytearray | memoryview, max_numel: int = MAX_NUMEL,
                 arrays: Callable[[int, np.dtype], np.ndarray] | None = None) -> Frame:
    """Decode and validate a frame; any inconsistency raises :class:`ValueError`.

    ``max_numel`` lets a receiver refuse shards larger than it is willing to hold.
    ``arrays(count, dtype)``, when given, returns uninitialised arrays (the server's
    recycled memory, :class:`ps_server.buffers.PushBuffers`): a delta+varint section is
    decoded into one, and the values are copied into another, so the frame holds no
    reference to ``data`` (which its sender's transport can then free at once).
    """
    buf = memoryview(data).cast("B")
    size = buf.nbytes
    if size < HEADER_BYTES + _CRC_BYTES:
        raise ValueError(f"frame of {size} bytes is shorter than the "
                         f"{HEADER_BYTES + _CRC_BYTES}-byte header and CRC (truncated)")
    (magic, version, kind, coding, dtype, worker, round, shard, shards, numel, count,
     index_nbytes, name_len) = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise ValueError(f"not a parameter-server frame: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ValueError(f"unsupported frame version {version}; this build reads version "
                         f"{VERSION} (are client and server the same hvd_compress version?)")
    (stored_crc,) = struct.unpack_from("<I", buf, size - _CRC_BYTES)
    if crc32(buf[: size - _CRC_BYTES]) != stored_crc:
        raise ValueError(f"CRC mismatch on a {size}-byte frame (corrupt or truncated)")
    kind = _enum(Kind, kind, "kind")
    coding = _enum(IndexCoding, coding, "index coding")
    dtype = _enum(ValueDType, dtype, "value dtype")
    if not 0 <= shard < shards:
        raise ValueError(f"shard index {shard} is not below the shard count {shards}")
    if numel > min(max_numel, MAX_NUMEL):
        raise ValueError(f"shard of {numel} elements exceeds the limit of "
                         f"{min(max_numel, MAX_NUMEL)}")
    if count > numel:
        raise ValueError(f"{count} pairs in a shard of only {numel} elements")
    if not 1 <= name_len <= MAX_NAME_BYTES:
        raise ValueError(f"tensor name length {name_len} is outside 1..{MAX_NAME_BYTES}")
    numpy_dtype = _NUMPY_DTYPES[dtype]
    itemsize = numpy_dtype.itemsize
    expected_index = bitmap_nbytes(numel) if coding is _BITMAP else \
        0 if coding is _DENSE else None
    if expected_index is not None and index_nbytes != expected_index:
        raise ValueError(f"{coding.name.lower()} index section of {index_nbytes} bytes, "
                         f"expected {expected_index} for {numel} elements")
    if coding is _DENSE and count != numel:
        raise ValueError(f"dense frame with {count} values for {numel} elements")
    if coding is _VARINT and not count <= index_nbytes <= _MAX_VARINT_BYTES * count:
        raise ValueError(f"varint index section of {index_nbytes} bytes cannot hold "
                         f"{count} indices")
    expected = HEADER_BYTES + name_len + index_nbytes + count * itemsize + _CRC_BYTES
    if size != expected:
        raise ValueError(f"frame has {size} bytes, its header describes {expected}")
    offset = HEADER_BYTES
    try:
        tensor = bytes(buf[offset : offset + name_len]).decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("tensor name is not valid UTF-8") from None
    offset += name_len
    index_section = np.frombuffer(buf, np.uint8, index_nbytes, offset)
    offset += index_nbytes
    values = np.frombuffer(buf, numpy_dtype, count, offset)
    indices = _decode_indices(coding, index_section, numel, count, arrays)
    if arrays is not None and count:
        values = _copied(values, arrays)
    return Frame(kind, tensor, shard, shards, round, worker, numel, indices, values, coding,
                 dtype)


def frame_nbytes(data: bytes | bytearray | memoryview, offset: int = 0) -> int:
    """The size of the frame starting at ``offset``, from its header alone (how frames
    concatenated by an all-gather are told apart); raises :class:`ValueError` if the
    header does not fit or does not start with the magic."""
    buf = memoryview(data).cast("B")
    if buf.nbytes - offset < HEADER_BYTES + _CRC_BYTES:
        raise ValueError(f"{buf.nbytes - offset} bytes left at offset {offset}: shorter than "
                         "a frame header (truncated)")
    fields = _HEADER.unpack_from(buf, offset)
    magic, dtype, count, index_nbytes, name_len = (fields[0], fields[4], fields[10],
                                                   fields[11], fields[12])
    if magic != MAGIC:
        raise ValueError(f"no frame at offset {offset}: magic {magic!r}, expected {MAGIC!r}")
    itemsize = _enum(ValueDType, dtype, "value dtype").numpy.itemsize
    return HEADER_BYTES + name_len + index_nbytes + count * itemsize + _CRC_BYTES


def split_frames(data: bytes | bytearray | memoryview) -> list[Frame]:
    """Decode a concatenation of frames (e.g. every rank's push, all-gathered)."""
    buf = memoryview(data).cast("B")
    frames, offset = [], 0
    while offset < buf.nbytes:
        size = frame_nbytes(buf, offset)
        if offset + size > buf.nbytes:
            raise ValueError(f"frame at offset {offset} needs {size} bytes, only "
                             f"{buf.nbytes - offset} remain (truncated)")
        frames.append(decode_frame(buf[offset:offset + size]))
        offset += size
    return frames


def _decode_indices(coding: IndexCoding, section: np.ndarray, numel: int, count: int,
                    arrays: Callable[[int, np.dtype], np.ndarray] | None = None
                    ) -> np.ndarray:
    if coding is _DENSE:
        return np.arange(numel, dtype=np.int64)
    if coding is _BITMAP:
        bits = np.unpackbits(section, bitorder="little")
        if bits[numel:].any():
            raise ValueError(f"bitmap sets bits at or beyond numel {numel} (out of range)")
        indices = np.flatnonzero(bits).astype(np.int64)
        if indices.size != count:
            raise ValueError(f"bitmap holds {indices.size} indices, header says {count}")
        return indices
    out = arrays(count, _INT64) if arrays is not None and count else None
    indices = native_sparse.varint_decode_indices(section, count, numel, out)
    if indices is not None:
        return indices
    gaps = varint_decode(section, count)
    if count and int(gaps.max()) >= numel:
        raise ValueError(f"index gap {int(gaps.max())} reaches beyond numel {numel} "
                         "(out of range)")
    # Each gap is below numel <= 2**32 and count is below the frame's byte size (< 2**31 for
    # any message gRPC or MPI delivers), so the int64 cumulative sum cannot overflow.
    indices = np.cumsum(gaps.astype(np.int64) + 1) - 1
    if count and indices[-1] >= numel:
        raise ValueError(f"index {int(indices[-1])} out of range for a shard of {numel} "
                         "elements")
    return indices


def _copied(array: np.ndarray, arrays: Callable[[int, np.dtype], np.ndarray]) -> np.ndarray:
    """A copy of ``array`` (1-D) in memory from ``arrays``."""
    copy = arrays(array.size, array.dtype)
    copy[...] = array
    return copy


_MEMBERS = {cls: {int(m): m for m in cls} for cls in (Kind, IndexCoding, ValueDType)}
"""Each header enum's members by value: a dict lookup per field, not an enum call."""


def _enum(cls: type[IntEnum], value: int, what: str) -> IntEnum:
    member = _MEMBERS[cls].get(value)
    if member is not None:
        return member
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"unknown {what} {value}; known: "
                         f"{', '.join(f'{m.value} {m.name.lower()}' for m in cls)}") from None
