"""The parameter server's native round (hvd_compress/native/round.py) against its numpy
route (ps_server/rounds.py with the library disabled): the same union sums, top-k
aggregates, residuals and aggregate frames, bit for bit."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import hvd_compress.native as native
from hvd_compress.native import round as native_round
from hvd_compress.native.sparse import (
    varint_decode_indices,
    varint_encode_indices,
    varint_index_nbytes,
)
from hvd_compress.sparse_wire import (
    SERVER_ID,
    IndexCoding,
    Kind,
    decode_frame,
    encode_frame,
    varint_decode,
    varint_encode,
    varint_nbytes,
)
from ps_server.rounds import (
    Finished,
    Quorum,
    aggregate,
    close_pushes,
    encode_aggregate,
    new_state,
)
from ps_server.service import ShardService
from ps_server.store import ConflictingPush, ShardStore

pytestmark = pytest.mark.skipif(not native.available(), reason="native library unavailable")


def frame(worker: int, round: int, idx, val, numel: int, dtype: str = "fp32",
          tensor: str = "w") -> bytes:
    return encode_frame(Kind.PUSH, tensor, 0, 1, round, worker, numel,
                        np.asarray(idx, np.int64), np.asarray(val, np.float32), dtype)


def pushes_of(frames: list[bytes]):
    return [decode_frame(f) for f in frames]


def both_routes(mode: str, numel: int, rounds: list[list[bytes]], residual=None):
    """Close each round's pushes with the native route and the numpy one, from the same
    state; the union sums, aggregates and residuals of both."""
    results = []
    for route in ("native", "numpy"):
        state = new_state(mode, numel, 0, 0.0)
        if residual is not None:
            state.residual = residual.copy()
        outcome = []
        for frames in rounds:
            pushes = pushes_of(frames)
            k = max(f.count for f in pushes)
            if route == "native":
                union, agg = close_pushes(mode, state, pushes, k)
            else:
                with native.disabled():
                    union, agg = close_pushes(mode, state, pushes, k)
            outcome.append((union, agg, None if state.residual is None
                            else state.residual.copy()))
        results.append(outcome)
    return results


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def assert_routes_agree(results) -> None:
    for (u1, a1, r1), (u2, a2, r2) in zip(*results):
        for x, y in (*zip(u1, u2), *zip(a1, a2)):
            assert_same_bits(np.asarray(x), np.asarray(y))
        if r1 is not None:
            assert_same_bits(r1, r2)


def random_round(rng, workers: int, numel: int, dtype: str = "fp32", spread: float = 1.0,
                 round: int = 0):
    frames = []
    for w in range(workers):
        k = int(rng.integers(0, numel // 3))
        idx = np.sort(rng.choice(numel, k, replace=False))
        frames.append(frame(w, round, idx, rng.standard_normal(k) * spread, numel, dtype))
    return frames


@pytest.mark.parametrize("mode", ["union", "topk", "gtopk"])
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("workers", [1, 2, 5])
def test_random_rounds_match_the_numpy_route(mode, dtype, workers):
    rng = np.random.default_rng([workers, len(dtype), len(mode)])
    numel = 40000  # several merge blocks
    rounds = [random_round(rng, workers, numel, dtype) for _ in range(4)]
    results = both_routes(mode, numel, rounds)
    assert_routes_agree(results)
    union, agg, _ = results[0][0]
    assert union[0].size > 0 and agg[0].size > 0  # the rounds held pairs


def test_topk_ties_take_the_lower_indices_on_both_routes():
    numel = 20000
    idx = np.arange(0, numel, 2)
    sign = np.where(idx % 3 == 0, -1.0, 1.0)
    # Worker 0 pushes idx[50:150], worker 1 idx[100:200], all of magnitude 1 (k = 100):
    # idx[100:150] sum to magnitude 2, the other 100 tie at 1 for the 50 places left.
    rounds = [[frame(0, 0, idx[50:150], sign[50:150], numel),
               frame(1, 0, idx[100:200], sign[100:200], numel)]]
    native_out, numpy_out = both_routes("topk", numel, rounds)
    assert_routes_agree((native_out, numpy_out))
    _, (top, values), residual = native_out[0]
    np.testing.assert_array_equal(top, idx[50:150])  # the 50 lowest of the tied
    np.testing.assert_array_equal(np.abs(values), [1.0] * 50 + [2.0] * 50)
    assert not residual[top].any()
    np.testing.assert_array_equal(np.abs(residual[idx[150:200]]), 1.0)
    # Next round one pair of magnitude 1 at the end (k = 1): 51 entries tie, the lowest wins.
    more = [[frame(0, 0, [numel - 1], [1.0], numel)]]
    state_out = both_routes("topk", numel, more, residual=residual)
    assert_routes_agree(state_out)
    np.testing.assert_array_equal(state_out[0][0][1][0], [idx[150]])


def test_topk_on_periodic_data_where_most_blocks_hold_a_winner():
    """Every block of the residual (64 entries) holds entries of 3 that beat every pair's
    sum: the native top-k reads them all, and its result is still the numpy route's."""
    numel, k = 1 << 18, 70000
    residual = np.where(np.arange(numel) % 4 == 0, 3.0, -1.0).astype(np.float32)
    residual[1::8] = 1.5
    idx = np.sort(np.random.default_rng(1).choice(numel, k, replace=False))
    results = both_routes("topk", numel, [[frame(0, 0, idx, np.full(k, 0.25), numel)]],
                          residual=residual)
    assert_routes_agree(results)
    top = results[0][0][1][0]
    assert top.size == k and np.isin(np.arange(0, numel, 4), top).all()  # all of 3 +- .25


def test_topk_with_fewer_non_zero_entries_than_k_takes_the_lowest_zeros():
    numel, k = 100_000, 1000
    idx = np.arange(50_000, 50_000 + k)
    val = np.zeros(k)
    val[::100] = 1.0  # 10 non-zero sums
    results = both_routes("topk", numel, [[frame(0, 0, idx, val, numel)]])
    assert_routes_agree(results)
    top = results[0][0][1][0]
    np.testing.assert_array_equal(top, np.union1d(np.arange(k - 10), idx[::100]))


def assert_bounds_hold(residual: np.ndarray) -> None:
    """The bounds kept for ``residual`` are at least each block's largest |x|."""
    bounds = native_round.residual_bounds(native.library(), residual)
    block = native_round.BOUND_BLOCK
    padded = np.zeros(bounds.size * block, np.uint32)
    padded[:residual.size] = residual.view(np.uint32) & 0x7FFFFFFF
    assert (bounds >= padded.reshape(-1, block).max(axis=1)).all()


def uneven_round(rng, numel: int, round: int) -> list[bytes]:
    """Three workers: two share most indices (duplicates across workers), the third pushes
    nothing, a few pairs or many, of magnitudes that vary by round; so the k-th largest is
    sometimes among the pairs, sometimes an untouched entry of the residual."""
    common = np.sort(rng.choice(numel, int(rng.integers(0, numel // 4 + 2)), replace=False))
    frames = []
    for w in range(2):
        idx = np.union1d(common[rng.random(common.size) < 0.8],
                         rng.choice(numel, min(50, numel), replace=False))
        frames.append(frame(w, round, idx, rng.standard_normal(idx.size) * 0.3, numel))
    few = np.sort(rng.choice(numel, min(numel, int(rng.choice([0, 3, numel // 3]))),
                             replace=False))
    frames.append(frame(2, round, few, rng.standard_normal(few.size) * 4.0, numel))
    return frames


@pytest.mark.parametrize("numel", [1, 63, 65, 10007])
def test_topk_rounds_with_kept_bounds_match_the_numpy_route(numel):
    """Rounds on one state reuse the residual's bounds: odd sizes (a partial last block),
    duplicate indices across workers, empty pushes, few pairs (the winners then come from
    blocks of the residual no pair touches); every residual and aggregate is the numpy
    route's, and the bounds stay above every block's entries."""
    rng = np.random.default_rng(numel)
    rounds = [uneven_round(rng, numel, r) for r in range(10)]
    native_out, numpy_out = both_routes("topk", numel, rounds)
    assert_routes_agree((native_out, numpy_out))
    state = new_state("topk", numel, 0, 0.0)
    for frames in rounds:
        pushes = pushes_of(frames)
        close_pushes("topk", state, pushes, max(f.count for f in pushes))
        assert_bounds_hold(state.residual)


@pytest.mark.parametrize("k", [0, 1, 7, 500, 20000])
def test_topk_of_a_replayed_sum_with_any_k_matches_the_numpy_route(k):
    """A journaled sum through the top-k (k = 0, k beyond the sum's pairs, beyond numel),
    from a residual with values no pair reaches: the native and numpy aggregates agree."""
    numel = 9000
    rng = np.random.default_rng(k)
    start = (rng.standard_normal(numel) * (rng.random(numel) < 0.05)).astype(np.float32)
    idx = np.sort(rng.choice(numel, 300, replace=False)).astype(np.int64)
    val = (rng.standard_normal(300) * 0.5).astype(np.float32)
    results = []
    for disabled in (False, True):
        state = new_state("topk", numel, 0, 0.0)
        state.residual = start.copy()
        with native.disabled() if disabled else contextlib.nullcontext():
            out = aggregate("topk", state, idx, val, k)
            again = aggregate("topk", state, idx[::2], val[::2], k)  # bounds kept
        results.append((out, again, state.residual))
    for a, b in zip(*results):
        for x, y in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
            assert_same_bits(np.asarray(x), np.asarray(y))
    assert results[0][0][0].size == min(k, numel)


def test_topk_ties_between_pairs_and_untouched_entries_take_the_lower_indices():
    """|s| = 1 at pairs and at untouched entries of the residual alike: the lowest indices
    of the tied win, wherever they are."""
    numel = 4096
    residual = np.zeros(numel, np.float32)
    residual[::7] = -1.0
    idx = np.arange(3, numel, 11)
    val = np.where(idx % 7 == 0, 0.0, 1.0)  # where a pair meets a -1, s stays -1
    rounds = [[frame(0, 0, idx, val, numel)]]
    results = both_routes("topk", numel, rounds, residual=residual)
    assert_routes_agree(results)
    top = results[0][0][1][0]
    tied = np.union1d(np.arange(0, numel, 7), idx)
    np.testing.assert_array_equal(top, tied[:idx.size])


def test_topk_without_kept_bounds_gives_the_same_bits():
    """``hvdc_topk`` (bounds from a pass over the residual, each call) and the kept
    bounds of :func:`native_round.topk` give the same aggregates and residuals."""
    numel, rng = 5000, np.random.default_rng(4)
    kept, fresh = np.zeros(numel, np.float32), np.zeros(numel, np.float32)
    lib = native.library()
    for k in (40, 400, 3, 2000):
        idx = np.sort(rng.choice(numel, 1000, replace=False)).astype(np.int64)
        val = (rng.standard_normal(1000) * rng.choice([0.01, 1.0, 100.0])).astype(np.float32)
        top, values = native_round.topk(kept, idx, val, k)
        out_idx, out_val = np.empty(k, np.int64), np.empty(k, np.float32)
        count = lib.hvdc_topk(fresh.ctypes.data, numel, idx.ctypes.data, val.ctypes.data,
                              idx.size, k, out_idx.ctypes.data, out_val.ctypes.data)
        assert count == top.size == k
        assert_same_bits(out_idx, top)
        assert_same_bits(out_val, values)
        assert_same_bits(fresh, kept)


def test_a_residual_changed_in_place_needs_its_bounds_forgotten():
    numel = 1000
    residual = np.zeros(numel, np.float32)
    one = (np.array([5], np.int64), np.array([1.0], np.float32))
    native_round.topk(residual, *one, 1)  # bounds kept: all zero but at 5
    residual[900] = 50.0  # not through a round
    native_round.forget_residual(residual)
    top, _ = native_round.topk(residual, *one, 1)
    np.testing.assert_array_equal(top, [900])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_sum_is_returned_whole_and_the_residual_kept(bad):
    numel = 5000
    rng = np.random.default_rng(3)
    first = random_round(rng, 2, numel)
    poisoned = [frame(0, 0, [7, 4000], [1.0, bad], numel), frame(1, 0, [7], [2.0], numel)]
    results = both_routes("topk", numel, [first, poisoned])
    assert_routes_agree(results)
    _, (idx, val), residual = results[0][1]
    np.testing.assert_array_equal(idx, np.arange(numel))
    assert not np.isfinite(val[4000]) and val[7] == residual[7] + 3.0
    assert_same_bits(residual, results[0][0][2])  # kept as after the first round


def test_empty_pushes_give_an_empty_aggregate():
    numel = 300
    rounds = [[frame(0, 0, [], [], numel), frame(1, 0, [], [], numel)]]
    for mode in ("union", "topk"):
        results = both_routes(mode, numel, rounds)
        assert_routes_agree(results)
        assert results[0][0][1][0].size == 0


def test_decreasing_indices_are_refused():
    idx = np.array([9000, 5], np.int64)  # two merge blocks, out of order
    with pytest.raises(ValueError, match="increasing"):
        native_round.close_round([(idx, np.ones(2, np.float32))], 10000, None, 2)
    with pytest.raises(ValueError, match="strictly increasing"):  # no frame holds them
        frame(0, 0, [3, 3], [1.0, 1.0], 10)
    residual = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="strictly increasing"):  # nor a journaled sum
        native_round.topk(residual, np.array([5, 3]), np.ones(2, np.float32), 1)
    assert (residual == 1.0).all()


@pytest.mark.parametrize("count, coding, numel", [
    (3, IndexCoding.VARINT, 10000), (2000, IndexCoding.BITMAP, 10000),
    (9800, IndexCoding.DENSE, 10000), (40, IndexCoding.VARINT, 1 << 32)])  # gaps of up to 5 bytes
def test_the_aggregate_frame_is_encode_frames_bytes(count, coding, numel):
    rng = np.random.default_rng(count)
    idx = np.sort(rng.choice(numel, count, replace=False)).astype(np.int64)
    val = rng.standard_normal(count).astype(np.float32)
    finished = Finished(12, idx, val)
    for dtype in ("fp32", "fp16"):
        expected = encode_frame(Kind.AGGREGATE, "layer.w", 1, 3, 12, SERVER_ID - 1, numel,
                                idx, val, dtype)
        got = encode_aggregate("layer.w", 1, 3, finished, SERVER_ID - 1, numel,
                               decode_frame(expected).dtype)
        assert got == expected
        assert decode_frame(got).coding is coding


def run_store(mode: str, quorum: Quorum | None, rounds: int, seed: int) -> list[bytes]:
    """Rounds of 3 workers through a store; with a quorum, worker 2 pushes only every
    other round (the others close by quorum without it). The pulled aggregates."""
    clock = [0.0]
    store = ShardStore(3, 0, 1, mode, deadline=100.0, clock=lambda: clock[0], quorum=quorum)
    service = ShardService(store)
    rng = np.random.default_rng(seed)
    numel, answers = 30000, []
    for r in range(rounds):
        frames = random_round(rng, 3, numel, spread=10.0 ** int(rng.integers(-3, 3)), round=r)
        for w in range(3):
            if quorum is None or w < 2 or r % 2 == 0:
                service.push(frames[w], "t")
        clock[0] += 1.0  # past the grace
        answers.append(service.pull(encode_frame(Kind.PULL, "w", 0, 1, r, 0, numel), "t", 1.0))
    return answers


@pytest.mark.parametrize("mode", ["union", "topk", "gtopk"])
@pytest.mark.parametrize("partial", [False, True])
def test_store_rounds_answer_the_same_bytes_on_both_routes(mode, partial):
    quorum = Quorum(3, 2, grace=0.5) if partial else None
    native_answers = run_store(mode, quorum, 6, seed=5)
    with native.disabled():
        numpy_answers = run_store(mode, quorum, 6, seed=5)
    assert native_answers == numpy_answers
    if partial:  # rounds without worker 2 say so in the frame
        assert decode_frame(native_answers[1]).worker == SERVER_ID - 1
        assert decode_frame(native_answers[0]).worker == SERVER_ID


def test_a_second_content_for_the_same_worker_is_refused_on_both_routes():
    for disabled in (False, True):
        service = ShardService(ShardStore(2, 0, 1, "topk"))
        with native.disabled() if disabled else contextlib.nullcontext():
            service.push(frame(0, 0, [1], [1.0], 100), "a")
            with pytest.raises(ConflictingPush):
                service.push(frame(0, 0, [1], [2.0], 100), "b")


def serve_rounds(service: ShardService, rounds: list[list[bytes]], which: range, numel: int
                 ) -> list[bytes]:
    """Push every worker's frame of each round in ``which`` (tensor ``w``, one shard), then
    pull its aggregate as worker 0; the answers."""
    answers = []
    for r in which:
        for push in rounds[r]:
            service.push(push, "t")
        answers.append(service.pull(encode_frame(Kind.PULL, "w", 0, 1, r, 0, numel), "t", 5.0))
    return answers


@pytest.mark.parametrize("restart_native", [True, False])
def test_a_restart_resumes_the_topk_residual_exactly_on_either_route(tmp_path, restart_native):
    """The journal holds each round's union sum; a server restarted from the checkpoint of
    one that stopped after 5 rounds (native or not) replays it through the top-k into the
    same residual, and answers the next rounds as a server that never stopped."""
    numel, rng = 30000, np.random.default_rng(9)
    rounds = [random_round(rng, 2, numel, round=r) for r in range(8)]

    def serve(service: ShardService, which: range) -> list[bytes]:
        return serve_rounds(service, rounds, which, numel)

    reference = ShardService(ShardStore(2, 0, 1, "topk"))
    serve(reference, range(5))
    residual = reference.store.tensors["w"].residual.copy()
    expected = serve(reference, range(5, 8))
    stopped = ShardService(ShardStore(2, 0, 1, "topk"), checkpoint_dir=str(tmp_path),
                           checkpoint_every=3)  # a snapshot, then rounds in the journal
    stopped.restore()
    serve(stopped, range(5))  # each answer waited for its round to be written
    assert stopped.snapshots >= 1 and stopped.journaled > 0  # some rounds to replay
    with native.disabled() if not restart_native else contextlib.nullcontext():
        restarted = ShardService(ShardStore(2, 0, 1, "topk"), checkpoint_dir=str(tmp_path),
                                 checkpoint_every=3)
        restarted.restore()
        assert restarted.store.rounds() == {"w": 5} and restarted.journaled == 0
        assert_same_bits(restarted.store.tensors["w"].residual, residual)
        assert serve(restarted, range(5, 8)) == expected


# The varint fast paths (sparse.cpp: 32-byte blocks in hvdc_varint_decode, four gaps at a
# time in hvdc_varint_nbytes) against the numpy coding, on sections long enough to use them.
BOUNDARY_GAPS = [0, 1, 126, 127, 128, 129, 2**14 - 1, 2**14, 2**14 + 1, 2**21 - 1, 2**21,
                 2**28 - 1, 2**28, 2**31, 2**32 - 2]


def boundary_gaps(seed: int, size: int) -> np.ndarray:
    """Gaps mostly of 1-2 bytes with every varint length boundary strewn among them."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(100.0, size).astype(np.uint64)
    gaps[rng.choice(size, len(BOUNDARY_GAPS) * 3, replace=False)] = BOUNDARY_GAPS * 3
    return gaps


def indices_of(gaps: np.ndarray) -> np.ndarray:
    return np.cumsum(gaps.astype(np.int64) + 1) - 1


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("size", [1, 31, 32, 33, 100, 1000, 5000])
def test_varint_fast_paths_match_the_numpy_coding(seed, size):
    gaps = boundary_gaps(seed, size) if size >= 100 else np.random.default_rng(seed).integers(
        0, 2**20, size).astype(np.uint64)
    if seed == 1:
        gaps[0] = 0  # first index 0
    indices = indices_of(gaps)
    section = varint_encode(gaps)
    numel = int(indices[-1]) + 1  # the last index is numel - 1, the largest allowed
    assert varint_index_nbytes(indices) == section.size == varint_nbytes(gaps)
    assert_same_bits(varint_decode_indices(section, size, numel), indices)
    assert varint_encode_indices(indices).tobytes() == section.tobytes()
    with pytest.raises(ValueError, match="beyond numel"):
        varint_decode_indices(section, size, numel - 1)


@pytest.mark.parametrize("size", [32, 33, 64, 1000, 5000])
@pytest.mark.parametrize("top", [2**7, 2**14])
def test_varint_decode_of_one_and_two_byte_gaps_matches_the_numpy_coding(size, top):
    """Sections of varints of 1 or 2 bytes only (the AVX-512 path of hvdc_varint_decode,
    32 at a time), and an index past numel in any block of them, refused."""
    gaps = np.random.default_rng([size, top]).integers(0, top, size).astype(np.uint64)
    indices = indices_of(gaps)
    section = varint_encode(gaps)
    assert_same_bits(varint_decode_indices(section, size, int(indices[-1]) + 1), indices)
    for cut in {size // 2, size - 1}:
        with pytest.raises(ValueError, match="beyond numel"):
            varint_decode_indices(section, size, int(indices[cut]))


def test_varint_fast_paths_on_an_empty_push():
    empty = np.zeros(0, np.int64)
    assert varint_index_nbytes(empty) == 0
    decoded = varint_decode_indices(np.zeros(0, np.uint8), 0, 10)
    assert decoded.size == 0 and decoded.dtype == np.int64
    with pytest.raises(ValueError, match="holds 1 varints, header says 0"):  # not shortcut
        varint_decode_indices(np.zeros(1, np.uint8), 0, 10)
    pushes = pushes_of([frame(0, 0, [], [], 100), frame(1, 0, [0, 99], [1.0, 2.0], 100)])
    assert [f.count for f in pushes] == [0, 2]


def test_varint_nbytes_counts_gaps_beyond_five_bytes_as_the_encoder_does():
    # Not a valid index list for a frame, but hvdc_varint_nbytes promises the encoder's count.
    gaps = np.full(40, 5, np.uint64)
    gaps[17] = 2**40
    assert varint_index_nbytes(indices_of(gaps)) == varint_nbytes(gaps) == 39 + 6


@pytest.mark.parametrize("at", [0, 40, 500, 999])
@pytest.mark.parametrize("fault, message", [
    (bytes([0x85, 0x80, 0x00]), "non-canonical"),
    (bytes([0x81, 0x00]), "non-canonical"),
    (bytes([0xFF] * 5 + [0x01]), "longer than 5 bytes"),
    (bytes([0xFF] * 9 + [0x01]), "longer than 5 bytes"),
])
def test_varint_faults_deep_in_a_long_section_are_found(at, fault, message):
    gaps = boundary_gaps(7, 1000)
    ends = np.cumsum(np.array([len(varint_encode(gaps[j:j + 1])) for j in range(gaps.size)]))
    start = 0 if at == 0 else int(ends[at - 1])
    section = np.frombuffer(varint_encode(gaps).tobytes()[:start] + fault
                            + varint_encode(gaps[at + 1:]).tobytes(), np.uint8)
    with pytest.raises(ValueError, match=message):
        varint_decode_indices(section, 1000, 2**40)
    with pytest.raises(ValueError, match=message):
        varint_decode(section, 1000)


@pytest.mark.parametrize("cut", [1, 3, 50])
def test_a_long_varint_section_with_bytes_missing_or_left_over_is_refused(cut):
    gaps = boundary_gaps(3, 1000)
    section = varint_encode(gaps)
    numel = 2**40
    with pytest.raises(ValueError, match=r"inside a varint|varints, header says"):
        varint_decode_indices(section[:-cut], 1000, numel)
    with pytest.raises(ValueError, match="varints, header says"):
        varint_decode_indices(section, 1000 - cut, numel)


@pytest.mark.parametrize("density", [0.001, 0.005, 0.02, 0.05, 0.3, 1.0])
@pytest.mark.parametrize("workers", [2, 3])
def test_union_sums_match_at_every_emit_density(density, workers):
    """hvdc_merge_sum writes a block's marks four ways by pairs per block (sparse.cpp:
    emit); each, with -0.0 and empty blocks among the pushes, against the numpy route."""
    rng = np.random.default_rng([workers, int(density * 1000)])
    numel = 5 * 8192 + 77
    frames = []
    for w in range(workers):
        k = max(1, int(density * numel))
        idx = np.sort(rng.choice(numel, k, replace=False))
        idx = idx[(idx < 8192) | (idx >= 2 * 8192)]  # the second block empty
        val = rng.standard_normal(idx.size).astype(np.float32)
        val[::7] = -0.0
        frames.append(frame(w, 0, idx, val, numel))
    results = both_routes("union", numel, [frames])
    assert_routes_agree(results)
    union = results[0][0][0]
    assert union[0].size >= max(f.count for f in pushes_of(frames))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("count", [1, 32, 33, 64, 65, 1000])
def test_aggregate_varints_across_length_boundaries_are_encode_frames_bytes(seed, count):
    """hvdc_frame_encode writes 32 gaps at a time when all fit 2 bytes (one by one
    otherwise): gaps at 127/128 and 2**14 - 1/2**14, longer ones among them, first index 0
    and the last index numel - 1, against the numpy coding."""
    gaps = boundary_gaps(seed, count) if count >= 100 else np.random.default_rng(
        seed).choice(np.array([0, 127, 128, 2**14 - 1, 2**14, 2**21], np.uint64), count)
    gaps = np.minimum(gaps, 2**21 if seed < 2 else 2**14 - 1)  # seed 2: every gap 1-2 bytes
    gaps[0] = 0
    idx = indices_of(gaps)
    numel = int(idx[-1]) + 1
    val = np.random.default_rng(seed).standard_normal(count).astype(np.float32)
    with native.disabled():
        expected = encode_frame(Kind.AGGREGATE, "w", 0, 1, 3, SERVER_ID - 1, numel, idx, val,
                                "fp32")
    got = encode_aggregate("w", 0, 1, Finished(3, idx, val), SERVER_ID - 1, numel,
                           decode_frame(expected).dtype)
    assert got == expected
    assert count == 1 or decode_frame(got).coding is IndexCoding.VARINT  # 1: numel 1, dense


def test_large_union_sums_reuse_memory_only_once_their_arrays_are_gone():
    """close_round lends union arrays of 1 MiB and more from a pool (round.py): a round's
    sum held by the caller (or any view of it) is never overwritten by later rounds."""
    numel = 1 << 20

    def pushes(seed):
        r = np.random.default_rng(seed)
        return [(np.sort(r.choice(numel, 100_000, replace=False)).astype(np.int64),
                 r.standard_normal(100_000).astype(np.float32)) for _ in range(2)]

    first = native_round.close_round(pushes(1), numel, None, 0)[0]
    kept = first[0].copy(), first[1].copy()
    address = first[0].ctypes.data
    second = native_round.close_round(pushes(2), numel, None, 0)[0]
    assert second[0].ctypes.data != address
    assert_same_bits(first[0], kept[0])
    assert_same_bits(first[1], kept[1])
    view = first[1][10:20]
    del first
    third = native_round.close_round(pushes(3), numel, None, 0)[0]
    assert third[0].ctypes.data not in (address, second[0].ctypes.data)  # a view remains
    assert_same_bits(view, kept[1][10:20])
    del view, third
    fourth = native_round.close_round(pushes(4), numel, None, 0)[0]
    assert fourth[0].ctypes.data != second[0].ctypes.data  # still held
    assert_same_bits(second[0], native_round.close_round(pushes(2), numel, None, 0)[0][0])


def test_large_decoded_pushes_each_keep_their_own_indices():
    """Decoded indices of 1 MiB and more come from the same pool (sparse.py): pushes held
    together never share memory, and a freed push's memory may serve the next one."""
    numel = 1 << 22
    rng = np.random.default_rng(9)
    idx = [np.sort(rng.choice(numel, 140_000, replace=False)) for _ in range(3)]
    frames = [frame(w, 0, i, np.ones(i.size), numel) for w, i in enumerate(idx)]
    first, second = decode_frame(frames[0]), decode_frame(frames[1])
    assert first.indices.ctypes.data != second.indices.ctypes.data
    assert_same_bits(first.indices, idx[0].astype(np.int64))
    assert_same_bits(second.indices, idx[1].astype(np.int64))
    del first
    third = decode_frame(frames[2])
    assert third.indices.ctypes.data != second.indices.ctypes.data
    assert_same_bits(third.indices, idx[2].astype(np.int64))
    assert_same_bits(second.indices, idx[1].astype(np.int64))
