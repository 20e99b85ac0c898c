"""The server's recycled memory for the pushes it holds (ps_server.buffers)."""

from __future__ import annotations

import gc
import struct

import numpy as np
import pytest

from hvd_compress.native import available
from hvd_compress.sparse_wire import Kind, crc32, decode_frame, encode_frame
from ps_server.buffers import GRANULE, MIN_BYTES, TRIM_EVERY, PushBuffers
from ps_server.rounds import HeapKeeper
from ps_server.service import ShardService
from ps_server.store import RequestError, ShardStore


def test_small_arrays_come_from_numpy() -> None:
    pool = PushBuffers()
    a = pool.lend(MIN_BYTES // 8 - 1)
    assert a.dtype == np.int64 and a.size == MIN_BYTES // 8 - 1
    assert pool.held_bytes() == 0
    b = pool.lend(MIN_BYTES // 2, np.float16)
    assert b.dtype == np.float16 and b.size == MIN_BYTES // 2
    assert pool.held_bytes() == GRANULE


def test_a_block_is_reused_only_once_its_array_and_views_are_gone() -> None:
    pool = PushBuffers()
    count = 3 * GRANULE // 8
    first = pool.lend(count)
    first[:] = 7
    view = first[10:20]
    del first
    gc.collect()
    second = pool.lend(count)  # the first block is still read through `view`
    second[:] = 9
    assert (view == 7).all()
    assert pool.held_bytes() == 2 * 3 * GRANULE
    address = second.ctypes.data
    del second
    gc.collect()
    third = pool.lend(count - 5)  # same rounded size: the free block again
    assert third.ctypes.data == address and third.size == count - 5
    assert pool.held_bytes() == 2 * 3 * GRANULE


def test_free_blocks_are_bounded() -> None:
    pool = PushBuffers(max_free_bytes=2 * GRANULE, idle_lends=4)
    arrays = [pool.lend(GRANULE // 8) for _ in range(5)]
    assert pool.held_bytes() == 5 * GRANULE  # all lent
    del arrays
    gc.collect()
    pool.lend(2 * GRANULE // 8)  # maps a block: at most two free ones stay
    assert pool.held_bytes() == 2 * GRANULE + 2 * GRANULE
    for _ in range(TRIM_EVERY):  # the same block again; idle ones go at a periodic check
        pool.lend(2 * GRANULE // 8)
    assert pool.held_bytes() == 2 * GRANULE


def test_release_unmaps_free_blocks_only() -> None:
    pool = PushBuffers()
    kept = pool.lend(GRANULE // 8)
    pool.lend(2 * GRANULE // 8)  # dropped at once: free
    gc.collect()
    assert pool.held_bytes() == 3 * GRANULE
    pool.release()
    assert pool.held_bytes() == GRANULE
    kept[:] = 1  # still mapped
    assert (kept == 1).all()


def test_a_server_releases_free_blocks_when_tensors_expire() -> None:
    now = [0.0]
    service = ShardService(ShardStore(1, 0, 1, deadline=1.0, idle_timeout=2.0,
                                      clock=lambda: now[0]))
    idx = np.arange(0, 1 << 20, 8, dtype=np.int64)
    service.push(encode_frame(Kind.PUSH, "s/t", 0, 1, 0, 0, 1 << 20, idx,
                              np.ones(idx.size, np.float32)), "peer")
    gc.collect()
    assert service.push_buffers.held_bytes() > 0  # the closed round's arrays, now free
    now[0] = 10.0
    service.tick()
    assert service.store.expired_tensors == 1
    assert service.push_buffers.held_bytes() == 0


@pytest.mark.skipif(not available(), reason="native library unavailable")
def test_decode_into_lent_indices_equals_plain_decode() -> None:
    rng = np.random.default_rng(3)
    numel = 1 << 22
    idx = np.sort(rng.choice(numel, 40_000, replace=False))
    val = rng.standard_normal(idx.size).astype(np.float32)
    data = encode_frame(Kind.PUSH, "t", 0, 1, 5, 1, numel, idx, val)
    pool = PushBuffers()
    frame = decode_frame(data, arrays=pool.lend)
    plain = decode_frame(data)
    assert np.array_equal(frame.indices, idx) and np.array_equal(plain.indices, idx)
    assert np.array_equal(frame.values, val)
    assert pool.held_bytes() > 0  # it came from the pool
    assert not np.shares_memory(frame.values, np.frombuffer(data, np.uint8))  # a copy
    assert frame.indices.base is not None and frame.values.base is not None


@pytest.mark.skipif(not available(), reason="native library unavailable")
def test_a_malformed_section_decoded_into_the_pool_gives_the_usual_error() -> None:
    numel = 1 << 20
    idx = np.arange(0, numel, 64, dtype=np.int64)
    data = bytearray(encode_frame(Kind.PUSH, "t", 0, 1, 0, 0, numel, idx,
                                  np.ones(idx.size, np.float32)))
    data[-4 - 4 * idx.size - 1] |= 0x80  # the last varint now runs on: truncated
    struct.pack_into("<I", data, len(data) - 4, crc32(bytes(data[:-4])))
    with pytest.raises(ValueError) as plain:
        decode_frame(bytes(data))
    with pytest.raises(ValueError) as pooled:
        decode_frame(bytes(data), arrays=PushBuffers().lend)
    assert str(pooled.value) == str(plain.value)


class FakeLibc:
    """Records glibc's mallopt calls (parameter, value) and returns ``result``."""

    def __init__(self, result: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.result = result

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.result


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _round_of(service: ShardService, tensor: str, pairs: int, workers: int) -> bytes:
    """Every worker pushes ``pairs`` pairs of ``tensor`` (round 0); worker 0's pull."""
    numel = 1 << 22
    for w in range(workers):
        idx = np.arange(w, numel, numel // pairs, dtype=np.int64)[:pairs]
        service.push(encode_frame(Kind.PUSH, tensor, 0, 1, 0, w, numel, idx,
                                  np.ones(pairs, np.float32)), "t")
    reply = service.pull(encode_frame(Kind.PULL, tensor, 0, 1, 0, 0, numel), "t", 1.0)
    assert reply is not None
    return reply


def test_the_heap_keeps_what_the_rounds_replies_take() -> None:
    libc = FakeLibc()
    heap = HeapKeeper(libc)
    service = ShardService(ShardStore(2, 0, 1, heap=heap))
    small = _round_of(service, "small", 1_000, 2)  # a few KB: glibc's own policy stays
    assert len(small) < HeapKeeper.MIN_REPLY and libc.calls == []
    big = _round_of(service, "big", 60_000, 2)
    assert len(big) >= HeapKeeper.MIN_REPLY
    assert libc.calls == [(M_MMAP_THRESHOLD, HeapKeeper.MMAP_THRESHOLD),
                          (M_TRIM_THRESHOLD, 2 * 2 * len(big))]
    service.pull(encode_frame(Kind.PULL, "big", 0, 1, 0, 1, 1 << 22), "t", 1.0)
    assert len(libc.calls) == 2  # the same round's frame: encoded once, noted once
    other = _round_of(service, "other", 60_000, 2)  # a step's replies add up
    assert libc.calls[-1] == (M_TRIM_THRESHOLD, 2 * 2 * (len(big) + len(other)))
    heap.forget(["big", "other"])
    assert heap.fit("next", HeapKeeper.MIN_REPLY, 2) == 2 * 2 * (len(big) + len(other))
    assert heap.fit("huge", HeapKeeper.TRIM_MAX, 8) == HeapKeeper.TRIM_MAX  # bounded


def test_refused_pushes_and_a_failing_mallopt_leave_the_heap_alone() -> None:

    libc = FakeLibc()
    service = ShardService(ShardStore(2, 0, 1, heap=HeapKeeper(libc)))
    big = encode_frame(Kind.PUSH, "w", 0, 1, 0, 0, 1 << 22,
                       np.arange(0, 1 << 22, 64, dtype=np.int64),
                       np.ones((1 << 22) // 64, np.float32))
    with pytest.raises(RequestError):
        service.push(big[:-1], "t")  # truncated: refused before anything is held
    with pytest.raises(RequestError):
        service.push(big.replace(b"\x00" * 8, b"\x07" * 8, 1), "t")  # a CRC mismatch
    assert libc.calls == []
    failing = HeapKeeper(FakeLibc(result=0))
    assert failing.fit("w", 1 << 20, 2) == 0  # not set: a later reply tries again
    assert len(failing.libc.calls) == 1
    assert HeapKeeper(object()).fit("w", 1 << 20, 2) == 0  # no mallopt (not glibc)
