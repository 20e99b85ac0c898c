"""Triton kernels of the packed codecs: 1-bit, QSGD and TernGrad, error feedback fused.

The arithmetic is ``hvd_compress/native/codecs.cpp``'s, operation for operation, in
float32 without fused multiply-adds (every launch passes ``enable_fp_fusion=False``) and
with correctly rounded divisions (``div_rn``); the byte layouts are :mod:`hvd_compress.wire`'s.
An encode computes, per bucket, its scale (1-bit: mean ``|x|``; QSGD: max ``|x|`` as an
integer maximum of the bits, so a NaN wins as in ``amax``, or the float64 2-norm; TernGrad:
the clipping bound from the float64 mean and variance, then the max ``|clipped x|``) and, for
the random codecs, its key (splitmix64 of the seed, read from a device tensor); then each
payload byte from its elements' codes (the draw of element ``j`` of bucket ``b`` is
``mix32(j ^ key_b) >> 8`` times 2^-24), with error feedback writing the residual
``x - decoded`` in the same pass. When a bucket is a whole number of packing groups (every
1-bit bucket; QSGD's 512 by default) that is one launch, ``_encode_fused``, a program per
bucket that reads its elements again from cache; otherwise two, ``_stats`` per bucket and
``_pack`` per block of bytes.

Float64 sums add in another order than the native kernels' eight lanes; their float32
roundings differ only where a sum lies within float64 rounding of a float32 tie (about
2^-29 per scale), as between any two devices (tests/test_gpu_codecs.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hvd_compress import wire

ONEBIT, QSGD, TERNGRAD = 0, 1, 2
CODECS = {"onebit": ONEBIT, "qsgd": QSGD, "terngrad": TERNGRAD}
TINY = float(torch.finfo(torch.float32).tiny)
STATS_BLOCK = 1024
PACK_BLOCK = 256
DECODE_BLOCK = 1024
MAX_ELEMENTS = (1 << 31) - (1 << 16)
"""Element counts at or above this take the torch code (32-bit offsets in the kernels)."""


@triton.jit
def _mix32(h):
    h ^= h >> 16
    h *= 0x7FEB352D
    h ^= h >> 15
    h *= 0x846CA68B
    h ^= h >> 16
    return h


@triton.jit
def _load_x(g_ptr, e_ptr, offs, mask, HAS_RES: tl.constexpr):
    x = tl.load(g_ptr + offs, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(e_ptr + offs, mask=mask, other=0.0)
    return x


@triton.jit
def _bucket_stats(g_ptr, e_ptr, seed_ptr, clip_ptr, b, n, bucket, CODEC: tl.constexpr,
                  L2: tl.constexpr, CLIP: tl.constexpr, HAS_RES: tl.constexpr,
                  BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """Bucket ``b``'s (scale, clipping bound, key) as the native kernel computes them."""
    start = b * bucket
    length = tl.minimum(bucket, n - start)
    lane = tl.arange(0, BLOCK)
    bound = tl.full([], float("inf"), tl.float32)
    key = tl.full([], 0, tl.uint32)
    if CODEC == 0:  # 1-bit: mean |x|, summed in float64
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for off in range(0, CHUNKS * BLOCK, BLOCK):
            m = off + lane < length
            x = _load_x(g_ptr, e_ptr, start + off + lane, m, HAS_RES)
            acc += tl.abs(x).to(tl.float64)
        scale = (tl.sum(acc, axis=0) / length.to(tl.float64)).to(tl.float32)
    else:
        if CLIP:  # TernGrad's bound: clip times the standard deviation, in float64
            acc = tl.zeros([BLOCK], dtype=tl.float64)
            for off in range(0, CHUNKS * BLOCK, BLOCK):
                m = off + lane < length
                acc += _load_x(g_ptr, e_ptr, start + off + lane, m, HAS_RES).to(tl.float64)
            nf = length.to(tl.float64)
            mean = tl.sum(acc, axis=0) / nf
            acc = tl.zeros([BLOCK], dtype=tl.float64)
            for off in range(0, CHUNKS * BLOCK, BLOCK):
                m = off + lane < length
                d = _load_x(g_ptr, e_ptr, start + off + lane, m, HAS_RES).to(tl.float64) - mean
                acc += tl.where(m, d * d, 0.0)
            var = tl.sum(acc, axis=0) / nf
            bound = (tl.load(clip_ptr) * tl.sqrt(var)).to(tl.float32)
        if L2:  # QSGD's 2-norm
            acc = tl.zeros([BLOCK], dtype=tl.float64)
            for off in range(0, CHUNKS * BLOCK, BLOCK):
                m = off + lane < length
                x = _load_x(g_ptr, e_ptr, start + off + lane, m, HAS_RES).to(tl.float64)
                acc += x * x
            scale = tl.sqrt(tl.sum(acc, axis=0)).to(tl.float32)
        else:  # max |x| (TernGrad: of the clipped x) as the integer maximum of the bits
            top = tl.zeros([BLOCK], dtype=tl.int32)
            for off in range(0, CHUNKS * BLOCK, BLOCK):
                m = off + lane < length
                x = _load_x(g_ptr, e_ptr, start + off + lane, m, HAS_RES)
                if CODEC == 2:
                    x = tl.where(x > bound, bound, x)
                    x = tl.where(x < -bound, -bound, x)
                top = tl.maximum(top, tl.where(m, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
            scale = tl.max(top, axis=0).to(tl.float32, bitcast=True)
        if CODEC == 2:
            # A NaN bound: the native kernel sends the bound as the scale, every trit 0.
            scale = tl.where(bound != bound, bound, scale)
        # The bucket's key: the top half of splitmix64's b-th output from the seed.
        z = tl.load(seed_ptr).to(tl.uint64, bitcast=True) \
            + (b + 1).to(tl.uint64) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        key = ((z ^ (z >> 31)) >> 32).to(tl.uint32)
    return scale, bound, key


@triton.jit(do_not_specialize=["n", "bucket"])
def _stats(g_ptr, e_ptr, seed_ptr, clip_ptr, scale_ptr, bound_ptr, key_ptr, n, bucket,
           CODEC: tl.constexpr, L2: tl.constexpr, CLIP: tl.constexpr, HAS_RES: tl.constexpr,
           BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """The two-pass encode's first pass: each bucket's scale, bound and key."""
    b = tl.program_id(0)
    scale, bound, key = _bucket_stats(g_ptr, e_ptr, seed_ptr, clip_ptr, b, n, bucket, CODEC,
                                      L2, CLIP, HAS_RES, BLOCK, CHUNKS)
    tl.store(scale_ptr + b, scale)
    tl.store(bound_ptr + b, bound)
    tl.store(key_ptr + b, key.to(tl.int32, bitcast=True))


@triton.jit
def _code(g_ptr, e_ptr, r_ptr, scale_ptr, bound_ptr, key_ptr, idx, n, bucket, levels,
          scale, bound, key, CODEC: tl.constexpr, HAS_RES: tl.constexpr,
          LOAD_STATS: tl.constexpr):
    """Element ``idx``'s code (0 past ``n``); with HAS_RES also writes its residual. The
    bucket's statistics are loaded per element (LOAD_STATS) or given (one bucket)."""
    m = idx < n
    x = _load_x(g_ptr, e_ptr, idx, m, HAS_RES)
    b = idx // bucket
    if LOAD_STATS:
        scale = tl.load(scale_ptr + b, mask=m, other=1.0)
    if CODEC == 0:
        code = (x >= 0.0).to(tl.int32)
        decoded = (2 * code - 1).to(tl.float32) * scale
    else:
        if LOAD_STATS:
            key = tl.load(key_ptr + b, mask=m, other=0).to(tl.uint32, bitcast=True)
        j = (idx - b * bucket).to(tl.uint32)
        u = (_mix32(j ^ key) >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2^-24
        d = tl.where(scale < 1.1754943508222875e-38, 1.1754943508222875e-38, scale)
        if CODEC == 1:
            s = levels.to(tl.float32)
            inv = tl.math.div_rn(s, d)
            t = tl.abs(x) * inv + u
            t = tl.where(t > s, s, t)
            t = tl.where(t >= 0.0, t, 0.0)
            lv = t.to(tl.int32)
            code = tl.where(x < 0.0, levels - lv, levels + lv)
            decoded = (code - levels).to(tl.float32) * tl.math.div_rn(scale, s)
        else:
            if LOAD_STATS:
                bound = tl.load(bound_ptr + b, mask=m, other=1.0)
            r = tl.where(x > bound, bound, x)
            r = tl.where(r < -bound, -bound, r)
            inv = tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)
            keep = (u < tl.abs(r) * inv).to(tl.int32)
            code = 1 + keep * ((r > 0.0).to(tl.int32) - (r < 0.0).to(tl.int32))
            decoded = (code - 1).to(tl.float32) * scale
    if HAS_RES:
        tl.store(r_ptr + idx, x - decoded, mask=m)
    return tl.where(m, code, 0)


@triton.jit
def _pack_bytes(g_ptr, e_ptr, r_ptr, scale_ptr, bound_ptr, key_ptr, out_ptr, byte, valid, n,
                plane_bytes, bucket, levels, scale, bound, key, CODEC: tl.constexpr,
                BITS: tl.constexpr, GROUP: tl.constexpr, PLANES: tl.constexpr,
                HAS_RES: tl.constexpr, LOAD_STATS: tl.constexpr, BLOCK: tl.constexpr):
    """Write payload bytes ``byte`` (where ``valid``; for bit planes, byte ``byte`` of
    every plane) from the codes of their elements."""
    if PLANES:  # 8 codes as the bytes of a word, then bit p of each byte per plane
        word = tl.zeros([BLOCK], dtype=tl.uint64)
        for t in tl.static_range(8):
            code = _code(g_ptr, e_ptr, r_ptr, scale_ptr, bound_ptr, key_ptr, byte * 8 + t, n,
                         bucket, levels, scale, bound, key, CODEC, HAS_RES, LOAD_STATS)
            word |= code.to(tl.uint64) << (8 * t)
        for p in tl.static_range(BITS):
            lsb = (word >> p) & 0x0101010101010101
            tl.store(out_ptr + p * plane_bytes + byte,
                     ((lsb * 0x0102040810204080) >> 56).to(tl.uint8), mask=valid)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        weight = 1
        for t in tl.static_range(GROUP):
            code = _code(g_ptr, e_ptr, r_ptr, scale_ptr, bound_ptr, key_ptr, byte * GROUP + t,
                         n, bucket, levels, scale, bound, key, CODEC, HAS_RES, LOAD_STATS)
            if BITS == 0:
                acc += code * weight
                weight *= 3
            else:
                acc |= code << (BITS * t)
        tl.store(out_ptr + byte, acc.to(tl.uint8), mask=valid)


@triton.jit(do_not_specialize=["n", "nbytes", "plane_bytes", "bucket", "levels"])
def _pack(g_ptr, e_ptr, r_ptr, scale_ptr, bound_ptr, key_ptr, out_ptr, n, nbytes, plane_bytes,
          bucket, levels, CODEC: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
          PLANES: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """The two-pass encode's second pass: payload bytes [pid * BLOCK, +BLOCK) (for bit
    planes: of plane 0's bytes, every plane written)."""
    byte = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = byte < (plane_bytes if PLANES else nbytes)
    _pack_bytes(g_ptr, e_ptr, r_ptr, scale_ptr, bound_ptr, key_ptr, out_ptr, byte, valid, n,
                plane_bytes, bucket, levels, 0.0, 0.0, 0, CODEC, BITS, GROUP, PLANES, HAS_RES,
                True, BLOCK)


@triton.jit(do_not_specialize=["n", "nbytes", "plane_bytes", "bucket", "levels"])
def _encode_fused(g_ptr, e_ptr, r_ptr, seed_ptr, clip_ptr, scale_ptr, out_ptr, n, nbytes,
                  plane_bytes, bucket, levels, CODEC: tl.constexpr, L2: tl.constexpr,
                  CLIP: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                  PLANES: tl.constexpr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                  CHUNKS: tl.constexpr, PACK_BLOCK: tl.constexpr, PACK_CHUNKS: tl.constexpr):
    """The one-pass encode of a bucket a whole number of packing groups long: program b
    computes bucket b's statistics, then packs its bytes (its elements read again from
    cache, not from memory)."""
    b = tl.program_id(0)
    scale, bound, key = _bucket_stats(g_ptr, e_ptr, seed_ptr, clip_ptr, b, n, bucket, CODEC,
                                      L2, CLIP, HAS_RES, BLOCK, CHUNKS)
    tl.store(scale_ptr + b, scale)
    per_bucket = bucket // GROUP
    first = b * per_bucket
    lane = tl.arange(0, PACK_BLOCK)
    for off in range(0, PACK_CHUNKS * PACK_BLOCK, PACK_BLOCK):
        byte = first + off + lane
        valid = (off + lane < per_bucket) & (byte < (plane_bytes if PLANES else nbytes))
        _pack_bytes(g_ptr, e_ptr, r_ptr, scale_ptr, scale_ptr, scale_ptr, out_ptr, byte, valid,
                    n, plane_bytes, bucket, levels, scale, bound, key, CODEC, BITS, GROUP,
                    PLANES, HAS_RES, False, PACK_BLOCK)


@triton.jit(do_not_specialize=["n", "plane_bytes", "bucket", "levels"])
def _decode(in_ptr, scale_ptr, out_ptr, n, plane_bytes, bucket, levels, CODEC: tl.constexpr,
            BITS: tl.constexpr, GROUP: tl.constexpr, PLANES: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < n
    if PLANES:
        code = tl.zeros([BLOCK], dtype=tl.int32)
        for p in tl.static_range(BITS):
            byte = tl.load(in_ptr + p * plane_bytes + idx // 8, mask=m, other=0).to(tl.int32)
            code |= ((byte >> (idx % 8)) & 1) << p
    elif BITS == 0:
        byte = tl.load(in_ptr + idx // 5, mask=m, other=0).to(tl.int32)
        t = idx % 5
        power = tl.where(t == 0, 1, tl.where(t == 1, 3, tl.where(t == 2, 9,
                                                                   tl.where(t == 3, 27, 81))))
        code = (byte // power) % 3
    else:
        byte = tl.load(in_ptr + idx // GROUP, mask=m, other=0).to(tl.int32)
        code = (byte >> (BITS * (idx % GROUP))) & ((1 << BITS) - 1)
    scale = tl.load(scale_ptr + idx // bucket, mask=m, other=1.0)
    if CODEC == 0:
        value = (2 * code - 1).to(tl.float32) * scale
    elif CODEC == 1:
        value = (code - levels).to(tl.float32) * tl.math.div_rn(scale, levels.to(tl.float32))
    else:
        value = (code - 1).to(tl.float32) * scale
    tl.store(out_ptr + idx, value, mask=m)


def _layout(codec: str, bits: int) -> tuple[int, int, int, bool]:
    """(codec number, bits, group, planes) of a codec's code section; bits 0 = trits."""
    width = {"onebit": 1, "terngrad": 0}.get(codec, bits)
    if width == 0:
        return CODECS[codec], 0, 5, False
    planes = 8 % width != 0
    return CODECS[codec], width, 8 if planes else 8 // width, planes


def _code_bytes(width: int, n: int) -> int:
    if width == 0:
        return wire.trits_nbytes(n)
    return wire.codes_nbytes(n, width)


_CLIPS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _clip_tensor(clip: float, device: torch.device) -> torch.Tensor:
    """TernGrad's clip factor as a float64 device tensor, made once per (clip, device): a
    copy from the host at every encode would wait for the device."""
    key = (clip, device)
    if key not in _CLIPS:
        _CLIPS[key] = torch.tensor([clip], dtype=torch.float64, device=device)
    return _CLIPS[key]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).to(torch.float32).contiguous()


def encode(codec: str, x: torch.Tensor, bucket_size: int, *, bits: int = 1, l2: bool = False,
           clip: float | None = None, seed: torch.Tensor | None = None,
           residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``codec``'s payload of the flat float32 ``x`` (``onebit``, ``qsgd`` with ``bits``
    and ``l2``, ``terngrad`` with ``clip``, ``None`` for none): the native kernel's bytes
    for the draws keyed by ``seed`` (a one-element int64 tensor on ``x``'s device, as
    :func:`hvd_compress.native.seed` gives; QSGD and TernGrad only).

    With ``residual`` (error feedback fused) the codec codes ``x + residual`` and returns
    the new residual ``(x + residual) - decode(payload)`` beside the payload; otherwise
    ``None`` beside it."""
    kind, width, group, planes = _layout(codec, bits)
    g = _flat(x)
    n = g.numel()
    if n >= MAX_ELEMENTS:
        raise ValueError(f"{n} elements: the Triton kernels take fewer than {MAX_ELEMENTS}")
    e = _flat(residual) if residual is not None else g
    buckets = -(-n // bucket_size)
    code_bytes = _code_bytes(width, n)
    out = torch.empty(code_bytes + 4 * buckets, dtype=torch.uint8, device=g.device)
    if not n:
        return out, (torch.empty_like(g) if residual is not None else None)
    scales = out[code_bytes:].view(torch.float32) if code_bytes % 4 == 0 \
        else torch.empty(buckets, dtype=torch.float32, device=g.device)
    clip_t = _clip_tensor(float(clip or 0.0), g.device)
    if seed is None:
        seed = torch.zeros(1, dtype=torch.int64, device=g.device)
    levels = (1 << (bits - 1)) - 1 if kind == QSGD else 1
    block = min(STATS_BLOCK, triton.next_power_of_2(bucket_size))
    new_residual = torch.empty_like(g) if residual is not None else g
    plane_bytes = (n + 7) // 8
    flags = dict(CODEC=kind, L2=kind == QSGD and bool(l2),
                 CLIP=kind == TERNGRAD and clip is not None, HAS_RES=residual is not None)
    if bucket_size % group == 0:  # one pass: a program per bucket
        per_bucket = bucket_size // group
        pack_block = min(PACK_BLOCK, triton.next_power_of_2(per_bucket))
        _encode_fused[(buckets,)](
            g, e, new_residual, seed, clip_t, scales, out, n, code_bytes, plane_bytes,
            bucket_size, levels, **flags, BITS=width, GROUP=group, PLANES=planes, BLOCK=block,
            CHUNKS=triton.cdiv(bucket_size, block), PACK_BLOCK=pack_block,
            PACK_CHUNKS=triton.cdiv(per_bucket, pack_block), enable_fp_fusion=False)
    else:  # two passes: the buckets' statistics, then the bytes
        bound = torch.empty(buckets, dtype=torch.float32, device=g.device)
        keys = torch.empty(buckets, dtype=torch.int32, device=g.device)
        _stats[(buckets,)](g, e, seed, clip_t, scales, bound, keys, n, bucket_size, **flags,
                           BLOCK=block, CHUNKS=triton.cdiv(bucket_size, block),
                           enable_fp_fusion=False)
        span = plane_bytes if planes else code_bytes
        _pack[(triton.cdiv(span, PACK_BLOCK),)](
            g, e, new_residual, scales, bound, keys, out, n, code_bytes, plane_bytes,
            bucket_size, levels, CODEC=kind, BITS=width, GROUP=group, PLANES=planes,
            HAS_RES=residual is not None, BLOCK=PACK_BLOCK, enable_fp_fusion=False)
    if scales.data_ptr() != out[code_bytes:].data_ptr():
        out[code_bytes:].copy_(scales.view(torch.uint8))
    return out, (new_residual if residual is not None else None)


def decode(codec: str, payload: torch.Tensor, numel: int, bucket_size: int,
           bits: int = 1) -> torch.Tensor:
    """The ``numel`` float32 values of a checked ``codec`` payload (as the native decode)."""
    kind, width, group, planes = _layout(codec, bits)
    out = torch.empty(numel, dtype=torch.float32, device=payload.device)
    if not numel:
        return out
    if numel >= MAX_ELEMENTS:
        raise ValueError(f"{numel} elements: the Triton kernels take fewer than {MAX_ELEMENTS}")
    payload = payload.contiguous()
    code_bytes = _code_bytes(width, numel)
    scales = payload[code_bytes:]
    scales = scales.view(torch.float32) if code_bytes % 4 == 0 and \
        scales.data_ptr() % 4 == 0 else scales.clone().view(torch.float32)
    levels = (1 << (bits - 1)) - 1 if kind == QSGD else 1
    _decode[(triton.cdiv(numel, DECODE_BLOCK),)](
        payload, scales, out, numel, (numel + 7) // 8, bucket_size, levels, CODEC=kind,
        BITS=width, GROUP=group, PLANES=planes, BLOCK=DECODE_BLOCK, enable_fp_fusion=False)
    return out
