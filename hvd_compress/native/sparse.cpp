// Sparse (index, value) kernels of the parameter-server frames and the server's
// aggregation: delta+varint index coding (hvd_compress/sparse_wire.py gives the format),
// the sum of a round's pushes, and the frames' CRC-32. Single-threaded: a server runs one process per shard,
// and these loops are bound by memory access, not arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>
#if (defined(__PCLMUL__) && defined(__SSE4_1__)) || defined(__AVX2__) || defined(__BMI2__)
#include <immintrin.h>
#endif
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#define HVDC_CLMUL 1
#if defined(__VPCLMULQDQ__) && defined(__AVX512F__)
#define HVDC_WIDE_CLMUL 1  // four 128-bit folds in one instruction
#endif
#endif

namespace {
// Pairs of room hvdc_merge_sum needs past the sum of its counts (see emit_block).
constexpr int64_t kMergeSlack = 8;
constexpr int64_t kBlock = 1 << 13, kWords = kBlock / 64;

// Emit the marked positions of a block (see hvdc_merge_sum), clearing them; returns
// how many. Writes up to K pairs past that count (at most kMergeSlack). SKIP: words
// without a mark are skipped (a branch per word, for blocks with few pairs); else every
// word takes its K branch-free writes, which an empty word makes all past the count.
template <int K, bool SKIP>
int64_t emit_block(int64_t base, float* __restrict acc, uint64_t* __restrict marked,
                   int64_t* __restrict out_idx, float* __restrict out_val) {
    static_assert(K <= kMergeSlack, "pairs written past the count exceed the slack");
    int64_t n = 0;
    for (int64_t w = 0; w < kWords; ++w) {
        uint64_t bits = marked[w];
        if (SKIP && !bits) continue;
        marked[w] = 0;
        const int64_t count = __builtin_popcountll(bits), first = base + (w << 6);
        float* const a = acc + (w << 6);
#pragma GCC unroll 8
        for (int k = 0; k < K; ++k) {
            const int i = __builtin_ctzll(bits | (uint64_t(1) << 63));
            out_idx[n + k] = first + i;
            out_val[n + k] = a[i];
            a[i] = 0.0f;
            bits &= bits - 1;
        }
        for (int64_t k = K; bits; ++k) {
            const int i = __builtin_ctzll(bits);
            out_idx[n + k] = first + i;
            out_val[n + k] = a[i];
            a[i] = 0.0f;
            bits &= bits - 1;
        }
        n += count;
    }
    return n;
}

// emit_block with K and SKIP for a block holding `pairs` (before the union): K about the
// marks a word holds, so that a word rarely needs the loop past K.
int64_t emit(int64_t pairs, int64_t base, float* acc, uint64_t* marked, int64_t* out_idx,
             float* out_val) {
    if (pairs < kWords / 2) return emit_block<2, true>(base, acc, marked, out_idx, out_val);
    if (pairs < 2 * kWords) return emit_block<2, false>(base, acc, marked, out_idx, out_val);
    if (pairs < 4 * kWords) return emit_block<4, false>(base, acc, marked, out_idx, out_val);
    return emit_block<8, true>(base, acc, marked, out_idx, out_val);  // few words empty
}

// Two lists of at least this many pairs in all go to merge_two, fewer to the accumulator.
constexpr int64_t kMergeTwoMin = 4096;
// Merges merge_two runs side by side, each writing one pair of slack past its output.
// More than 2 are slower on x86-64: their cursors no longer fit in registers.
constexpr int kStreams = 2;
static_assert(kStreams <= kMergeSlack, "merge_two's streams need a pair of slack each");

// Whether idx[0, count) is strictly increasing.
bool strictly_increasing(const int64_t* idx, int64_t count) {
    int64_t bad = 0;
    for (int64_t j = 1; j < count; ++j) bad |= idx[j] <= idx[j - 1];
    return !bad;
}

// Where part p of `parts` ends in lists a and b, for merges side by side (merge_two's
// streams, merge_wide's runs): the index range is cut at indices of the longer list, at
// equal shares of it, so a shared index never straddles a cut. The last part ends at the
// lists' ends.
void cut_part(const int64_t* a, int64_t na, const int64_t* b, int64_t nb, int p, int parts,
              int64_t& ea, int64_t& eb) {
    if (p + 1 >= parts) {
        ea = na;
        eb = nb;
        return;
    }
    const int64_t* const longer = na >= nb ? a : b;
    const int64_t cut = longer[std::max(na, nb) * (p + 1) / parts];
    ea = std::lower_bound(a, a + na, cut) - a;
    eb = std::lower_bound(b, b + nb, cut) - b;
}

// The cursors of one of merge_two's merges: list a at ia (up to ea), b at ib (up to eb),
// the output at `at`.
struct Stream {
    int64_t ia, ea, ib, eb, at;
    int64_t last = INT64_MIN;  // the index it wrote last
    int64_t bad = 0;           // nonzero once an index it wrote did not exceed the one before
};

// One output pair of a merge_two stream, without a branch: the lower next index of the
// two lists, (0.0f + a's value) + b's value with 0.0f for a list without it. CHECKED: a
// list may be finished (its next index is then INT64_MAX, and a stream whose lists are
// both finished writes in its slack without advancing); else both hold a pair.
template <bool CHECKED>
inline void merge_step(Stream& t, const int64_t* a, const float* va, const int64_t* b,
                       const float* vb, int64_t* out_idx, float* out_val) {
    static const int64_t kNone = INT64_MAX;
    static const float kZero = 0.0f;
    const bool ha = !CHECKED || t.ia < t.ea, hb = !CHECKED || t.ib < t.eb;
    // Pointers chosen, then loaded: a finished list reads the constants above.
    const int64_t x = *(ha ? a + t.ia : &kNone), y = *(hb ? b + t.ib : &kNone);
    uint32_t ux, uy;
    std::memcpy(&ux, ha ? va + t.ia : &kZero, 4);
    std::memcpy(&uy, hb ? vb + t.ib : &kZero, 4);
    const uint32_t tx = x <= y, ty = y <= x;
    ux &= 0u - tx;
    uy &= 0u - ty;
    float fx, fy;
    std::memcpy(&fx, &ux, 4);
    std::memcpy(&fy, &uy, 4);
    const int64_t out = tx ? x : y;
    out_idx[t.at] = out;
    out_val[t.at] = (0.0f + fx) + fy;
    t.ia += tx;
    t.ib += ty;
    const bool wrote = !CHECKED || (ha | hb);
    t.at += wrote;
    t.bad |= wrote & (out <= t.last);
    t.last = wrote ? out : t.last;
}

// hvdc_merge_sum of two lists (a, na) and (b, nb), the same bits as the accumulator. The
// index range is cut at indices of the longer list into kStreams parts, merged side by
// side without a branch per pair, so that one part's load-compare-advance chain runs
// while another's waits. Each writes its union to its own stretch of the output (its
// pairs and one of slack); the stretches are then moved together. The steps run in
// batches that no list can finish inside, without the checks of a finished list, and
// the last few dozen with them. The lists' order is checked on the output as it is
// written, not by passes over the lists first: each pair of a list is written once, in
// the list's order, as its own index, so the output increases strictly exactly when both
// lists do (a decreasing list gives -1 once merged).
int64_t merge_two(const int64_t* a, const float* va, int64_t na, const int64_t* b,
                  const float* vb, int64_t nb, int64_t* out_idx, float* out_val) {
    Stream t[kStreams];
    int64_t from[kStreams], o = 0;
    for (int p = 0; p < kStreams; ++p) {
        t[p].ia = p ? t[p - 1].ea : 0;
        t[p].ib = p ? t[p - 1].eb : 0;
        cut_part(a, na, b, nb, p, kStreams, t[p].ea, t[p].eb);
        t[p].at = from[p] = o;
        o += t[p].ea - t[p].ia + t[p].eb - t[p].ib + 1;
    }
    for (;;) {  // a step takes at most one pair of each list
        int64_t safe = INT64_MAX;
        for (const Stream& s : t) safe = std::min({safe, s.ea - s.ia, s.eb - s.ib});
        if (safe < 32) break;
        for (int64_t s = 0; s < safe; ++s)
#pragma GCC unroll 8
            for (int p = 0; p < kStreams; ++p)
                merge_step<false>(t[p], a, va, b, vb, out_idx, out_val);
    }
    int64_t steps = 0;
    for (const Stream& s : t) steps = std::max(steps, s.ea - s.ia + s.eb - s.ib);
    for (int64_t s = 0; s < steps; ++s)
#pragma GCC unroll 8
        for (int p = 0; p < kStreams; ++p)
            merge_step<true>(t[p], a, va, b, vb, out_idx, out_val);
    int64_t n = t[0].at, bad = t[0].bad;
    for (int p = 1; p < kStreams; ++p) {
        const int64_t count = t[p].at - from[p];
        std::memmove(out_idx + n, out_idx + from[p], size_t(count) * 8);
        std::memmove(out_val + n, out_val + from[p], size_t(count) * 4);
        bad |= t[p].bad | (count > 0 && n > 0 && out_idx[n] <= out_idx[n - 1]);
        n += count;
    }
    return bad ? -1 : n;
}

#if defined(__AVX512F__) && defined(__AVX512VL__)
#define HVDC_WIDE_MERGE 1
// merge_two on 8 indices at a time (AVX-512), when the lists allow it (merge_wide); the
// same pairs and bits. Phase one merges the lists' indices as tagged keys, 2 i for list a
// and 2 i + 1 for list b, all distinct, into out_idx: runs side by side (as merge_two's
// streams) each carry the 8 largest keys merged so far, and take the next block of 8
// from the list whose next index is lower, the bitonic network giving the 8 lowest of
// the 16 (the standard rule: those are below every key not yet taken). Phase two reads
// the keys back in place, 8 at a time: a key's value is the next unread one of its
// list (expanded into the lanes of that list), an index held by both lists is a key of
// a followed by b's, whose sum (0.0f + a's value) + b's value goes in a's lane and whose
// b lane is dropped; the rest are compressed to the output. No branch per pair.
constexpr int kLanes = 8;

// A bitonic vector of 8 keys, sorted (three compare-exchange stages, lanes 4, 2, 1 apart).
inline __m512i sort_bitonic(__m512i v) {
    __m512i w = _mm512_shuffle_i64x2(v, v, 0x4E);
    v = _mm512_mask_max_epi64(_mm512_min_epi64(v, w), 0xF0, v, w);
    w = _mm512_permutex_epi64(v, 0x4E);
    v = _mm512_mask_max_epi64(_mm512_min_epi64(v, w), 0xCC, v, w);
    w = _mm512_shuffle_epi32(v, _MM_PERM_BADC);
    return _mm512_mask_max_epi64(_mm512_min_epi64(v, w), 0xAA, v, w);
}

// 8 indices from p as keys with `tag` (0 or 1), in reverse order.
inline __m512i reversed_keys(const int64_t* p, __m512i tag) {
    const __m512i reverse = _mm512_set_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm512_permutexvar_epi64(
        reverse, _mm512_or_si512(_mm512_slli_epi64(_mm512_loadu_si512(p), 1), tag));
}

// One run of phase one: list a at ia (up to ea), b at ib (up to eb), keys written at
// `at`; `high` the 8 largest keys merged so far, once `started`.
struct WideRun {
    int64_t ia, ea, ib, eb, at;
    __m512i high;
    bool started = false;

    bool can_step() const { return ia + kLanes <= ea && ib + kLanes <= eb; }

    // Takes the block of the list with the lower next index, writes the 8 lowest keys.
    void step(const int64_t* a, const int64_t* b, int64_t* keys) {
        const bool take_a = a[ia] <= b[ib];
        const __m512i x = reversed_keys(take_a ? a + ia : b + ib,
                                        _mm512_set1_epi64(take_a ? 0 : 1));
        ia += take_a ? kLanes : 0;
        ib += take_a ? 0 : kLanes;
        _mm512_storeu_si512(keys + at, sort_bitonic(_mm512_min_epi64(high, x)));
        high = sort_bitonic(_mm512_max_epi64(high, x));
        at += kLanes;
    }

    // The rest, once a list has fewer than 8 left: the carried keys and that list's
    // merged first (at most 15), then those with the other list, scalar.
    void finish(const int64_t* a, const int64_t* b, int64_t* keys) {
        int64_t carried[kLanes], few[2 * kLanes];
        const int held = started ? kLanes : 0;
        if (started) _mm512_storeu_si512(carried, high);
        const bool a_short = ea - ia <= eb - ib;
        const int64_t *s = a_short ? a : b, *l = a_short ? b : a;
        int64_t si = a_short ? ia : ib, li = a_short ? ib : ia;
        const int64_t se = a_short ? ea : eb, le = a_short ? eb : ea;
        const int64_t stag = a_short ? 0 : 1, ltag = 1 - stag;
        int nf = 0, h = 0;
        while (h < held || si < se) {
            const int64_t key = si < se ? (s[si] << 1) | stag : INT64_MAX;
            if (h < held && carried[h] < key) {
                few[nf++] = carried[h++];
            } else {
                few[nf++] = key;
                ++si;
            }
        }
        int f = 0;
        for (; f < nf && li < le; ++at) {
            const int64_t key = (l[li] << 1) | ltag;
            if (few[f] < key) {
                keys[at] = few[f++];
            } else {
                keys[at] = key;
                ++li;
            }
        }
        for (; f < nf; ++f) keys[at++] = few[f];
        for (; li < le; ++li) keys[at++] = (l[li] << 1) | ltag;
    }
};

// Runs side by side (cut_part). In a C++ harness (two pushes of 1% of 4M)
// 3 and 4 runs took 1.26 and 1.29 ns a pushed pair against 2's 1.33; one run 1.68.
constexpr int kWideRuns = 2;
// Keys of both lists must fit 63 bits, and the sentinel INT64_MAX must exceed them all.
constexpr int64_t kWideMaxIndex = (int64_t(1) << 62) - 2;

// Whether idx[0, count) increases strictly within [0, kWideMaxIndex].
bool wide_mergeable(const int64_t* idx, int64_t count) {
    if (count == 0) return true;
    if (idx[0] < 0 || idx[count - 1] > kWideMaxIndex) return false;
    __mmask8 bad = 0;
    int64_t j = 0;
    for (; j + kLanes < count; j += kLanes)
        bad |= _mm512_cmple_epi64_mask(_mm512_loadu_si512(idx + j + 1),
                                       _mm512_loadu_si512(idx + j));
    for (; j + 1 < count; ++j) bad |= idx[j + 1] <= idx[j];
    return !bad;
}

// merge_two by 8 pairs at a time (see HVDC_WIDE_MERGE); -1 where merge_two would give
// it, and lists outside its index range go to merge_two.
int64_t merge_wide(const int64_t* a, const float* va, int64_t na, const int64_t* b,
                   const float* vb, int64_t nb, int64_t* out_idx, float* out_val) {
    if (!wide_mergeable(a, na) || !wide_mergeable(b, nb))
        return merge_two(a, va, na, b, vb, nb, out_idx, out_val);
    const int64_t total = na + nb;
    int64_t* const keys = out_idx;  // phase two writes each pair at or before its key
    WideRun runs[kWideRuns];
    int64_t at = 0;
    for (int p = 0; p < kWideRuns; ++p) {
        WideRun& r = runs[p];
        r.ia = p ? runs[p - 1].ea : 0;
        r.ib = p ? runs[p - 1].eb : 0;
        cut_part(a, na, b, nb, p, kWideRuns, r.ea, r.eb);
        r.at = at;
        at += r.ea - r.ia + r.eb - r.ib;
        if (r.can_step()) {  // the first blocks of both lists
            const __m512i x = _mm512_slli_epi64(_mm512_loadu_si512(a + r.ia), 1);
            const __m512i y = reversed_keys(b + r.ib, _mm512_set1_epi64(1));
            _mm512_storeu_si512(keys + r.at, sort_bitonic(_mm512_min_epi64(x, y)));
            r.high = sort_bitonic(_mm512_max_epi64(x, y));
            r.started = true;
            r.ia += kLanes;
            r.ib += kLanes;
            r.at += kLanes;
        }
    }
    for (;;) {  // the runs side by side, in batches of steps none can run out in
        int64_t steps = INT64_MAX;
        for (const WideRun& r : runs)
            steps = std::min({steps, r.started ? (r.ea - r.ia) / kLanes : 0,
                              (r.eb - r.ib) / kLanes});
        if (steps == 0) break;
        for (int64_t s = 0; s < steps; ++s)
#pragma GCC unroll 2
            for (int p = 0; p < kWideRuns; ++p) runs[p].step(a, b, keys);
    }
    for (WideRun& r : runs) {
        while (r.started && r.can_step()) r.step(a, b, keys);
        r.finish(a, b, keys);
    }

    const __m512i one = _mm512_set1_epi64(1), none = _mm512_set1_epi64(INT64_MAX);
    const __m256i up = _mm256_set_epi32(8, 7, 6, 5, 4, 3, 2, 1);  // lane j + 1's value
    static const float kZero = 0.0f;
    int64_t ja = 0, jb = 0, n = 0;
    __mmask8 carry = 0;  // lane 0 holds b's half of a shared index
    for (int64_t p = 0; p < total; p += kLanes) {
        const int64_t left = total - p;
        const __mmask8 valid = left >= kLanes ? 0xFF : __mmask8((1u << left) - 1);
        const __mmask8 ahead = left > kLanes ? 0xFF : __mmask8((1u << (left - 1)) - 1);
        const __m512i key = _mm512_maskz_loadu_epi64(valid, keys + p);
        const __m512i next = _mm512_mask_loadu_epi64(none, ahead, keys + p + 1);
        const __m512i index = _mm512_srai_epi64(key, 1);
        const __mmask8 from_b = _mm512_mask_test_epi64_mask(valid, key, one);
        const __mmask8 from_a = valid & ~from_b;
        const __mmask8 shared = _mm512_mask_cmpeq_epi64_mask(
            valid, index, _mm512_srai_epi64(next, 1));
        const int ca = __builtin_popcount(from_a), cb = __builtin_popcount(from_b);
        __m256 v = _mm256_maskz_expand_ps(
            from_a, _mm256_maskz_loadu_ps(__mmask8((1u << ca) - 1), va + ja));
        v = _mm256_mask_expand_ps(
            v, from_b, _mm256_maskz_loadu_ps(__mmask8((1u << cb) - 1), vb + jb));
        ja += ca;
        jb += cb;
        // lane 7 of a shared index: b's value is the next one of b (next block's lane)
        const float beyond = *((shared >> 7) ? vb + jb : &kZero);
        const __m256 partner = _mm256_permutex2var_ps(v, up, _mm256_set1_ps(beyond));
        __m256 sum = _mm256_add_ps(_mm256_setzero_ps(), v);
        sum = _mm256_mask_add_ps(sum, shared, sum, partner);
        const __mmask8 keep = valid & __mmask8(~((shared << 1) | carry));
        carry = shared >> 7;
        _mm512_storeu_si512(out_idx + n, _mm512_maskz_compress_epi64(keep, index));
        _mm256_storeu_ps(out_val + n, _mm256_maskz_compress_ps(keep, sum));
        n += __builtin_popcount(keep);
    }
    return n;
}
#endif

// The body of hvdc_merge_sum (see there).
int64_t merge_lists(int64_t lists, const int64_t* const* idx, const float* const* val,
                    const int64_t* counts, int64_t* out_idx, float* out_val) {
    if (lists == 2 && counts[0] + counts[1] >= kMergeTwoMin) {
#if defined(HVDC_WIDE_MERGE)
        return merge_wide(idx[0], val[0], counts[0], idx[1], val[1], counts[1], out_idx,
                          out_val);
#else
        return merge_two(idx[0], val[0], counts[0], idx[1], val[1], counts[1], out_idx,
                         out_val);
#endif
    }
    std::vector<int64_t> cursor(size_t(lists), 0);
    std::vector<float> acc(kBlock, 0.0f);
    std::vector<uint64_t> marked(kWords, 0);
    float* const a = acc.data();
    uint64_t* const m = marked.data();
    int64_t n = 0;
    for (;;) {
        int64_t lowest = INT64_MAX;
        for (int64_t l = 0; l < lists; ++l)
            if (cursor[l] < counts[l] && idx[l][cursor[l]] < lowest) lowest = idx[l][cursor[l]];
        if (lowest == INT64_MAX) return n;
        const int64_t base = lowest & ~(kBlock - 1), end = base + kBlock;
        int64_t pairs = 0;
        for (int64_t l = 0; l < lists; ++l) {
            const int64_t* __restrict ix = idx[l];
            const float* __restrict v = val[l];
            const int64_t c = counts[l], from = cursor[l];
            int64_t j = from;
            for (; j < c && ix[j] < end; ++j) {
                const int64_t i = ix[j] - base;
                if (i < 0) return -1;  // list l decreases: its index lies before this block
                a[i] += v[j];
                m[i >> 6] |= uint64_t(1) << (i & 63);
            }
            cursor[l] = j;
            pairs += j - from;
        }
        n += emit(pairs, base, a, m, out_idx + n, out_val + n);
    }
}

// |x| as an integer that orders like |x| for finite x (and NaN and infinities above all).
inline uint32_t magnitude(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    return bits & 0x7FFFFFFFu;
}
constexpr uint32_t kNonFinite = 0x7F800000u;  // magnitude() of infinity; NaN is above

// Entries of the residual covered by one bound of hvdc_topk_bounded (see there), and how many
// pairs ahead its scattered accesses to the residual are prefetched.
constexpr int64_t kBoundBlock = 64, kAhead = 48;

// The exact bound of each block of kBoundBlock entries of x: the largest magnitude().
void block_bounds(const float* x, int64_t numel, uint32_t* bounds) {
    for (int64_t b = 0, lo = 0; lo < numel; ++b, lo += kBoundBlock) {
        const int64_t hi = std::min(lo + kBoundBlock, numel);
        uint32_t most = 0;
        for (int64_t i = lo; i < hi; ++i) most = std::max(most, magnitude(x[i]));
        bounds[b] = most;
    }
}

// The magnitude of rank k (1 = the largest) among those `mags` give, k <= their count.
// A histogram of the top 15 bits, then the bucket that holds rank k in full.
template <typename Mag>
uint32_t kth_largest(int64_t count, Mag mags, int64_t k, std::vector<uint32_t>& hist) {
    hist.assign(size_t(1) << 15, 0);
    for (int64_t c = 0; c < count; ++c) ++hist[mags[c] >> 16];
    int64_t above = 0, bucket = (int64_t(1) << 15) - 1;
    for (; above + hist[size_t(bucket)] < k; --bucket) above += hist[size_t(bucket)];
    std::vector<uint32_t> low;
    low.reserve(hist[size_t(bucket)]);
    for (int64_t c = 0; c < count; ++c)
        if (int64_t(mags[c] >> 16) == bucket) low.push_back(mags[c]);
    const size_t rank = size_t(k - above - 1);
    std::nth_element(low.begin(), low.begin() + rank, low.end(), std::greater<uint32_t>());
    return low[rank];
}

// An array that keeps its memory between calls (grown, never shrunk nor cleared): a
// round's scratch, not faulted in and zeroed by the kernel every round.
template <typename T>
struct Buffer {
    std::unique_ptr<T[]> data;
    int64_t size = 0;
    T* ensure(int64_t n) {
        if (n > size) {
            size = n + n / 4;  // room for the next rounds, a little larger
            data.reset(new T[size_t(size)]);
        }
        return data.get();
    }
};

struct Scratch {
    Buffer<float> old, sum, fix_val;
    Buffer<uint32_t> mag, own, cand_mag;
    Buffer<int64_t> fix_at;
    std::vector<uint32_t> sample;
    std::vector<uint32_t> hist;
    std::vector<int64_t> read;
};

Scratch& scratch() {  // one per thread: a server closes rounds on any of its threads
    thread_local Scratch s;
    return s;
}
}  // namespace

extern "C" {
// The bounds hvdc_topk_bounded keeps for `residual` (numel floats): ceil(numel / 64) uint32, each
// the largest |x| (as magnitude()) of its 64 entries. Returns their count.
int64_t hvdc_topk_bounds(const float* residual, int64_t numel, uint32_t* bounds) {
    block_bounds(residual, numel, bounds);
    return (numel + kBoundBlock - 1) / kBoundBlock;
}

// Pairs sampled by sampled_kth.
constexpr int64_t kSample = 2048;

// An estimate of the k-th largest magnitude() of s = residual + u_val at the n pairs:
// that rank's share of kSample of them, evenly spaced (all of them when fewer). Above
// every magnitude (nothing guessed a winner) when k is 0 or n < k (every block is read).
uint32_t sampled_kth(const float* residual, const int64_t* u_idx, const float* u_val,
                     int64_t n, int64_t k, std::vector<uint32_t>& sample) {
    if (k <= 0 || n < k) return UINT32_MAX;
    const int64_t m = std::min(n, kSample);
    for (int64_t c = 0; c < m; ++c) __builtin_prefetch(residual + u_idx[c * n / m]);
    sample.resize(size_t(m));
    for (int64_t c = 0; c < m; ++c) {
        const int64_t j = c * n / m;
        sample[size_t(c)] = magnitude(residual[u_idx[j]] + u_val[j]);
    }
    const int64_t rank = std::min(m, std::max<int64_t>(1, (k * m + n / 2) / n));
    std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(),
                     std::greater<uint32_t>());
    return sample[size_t(rank - 1)];
}

// Server-side error feedback of mode topk: s = residual + (the union sum: n pairs at
// strictly increasing u_idx), then the k entries of largest |s| (ties: the lower index)
// go to out_idx (increasing) and out_val, and residual <- s with those entries set to
// 0.0f. Returns min(k, numel); -2 when s is not finite anywhere: the residual is then
// left as it was (the caller returns s whole); -1 if u_idx is not strictly increasing.
//
// `bounds` (hvdc_topk_bounds's, kept by the caller between rounds and updated here; or
// null: computed by a pass over the residual) hold for each block of 64 entries a number
// at least the magnitude of each: the residual changes only at the sum's pairs, so its
// top-k is found without reading all of it. The sum is added at its pairs (keeping the
// old values), and t0 is the k-th largest |s| among them when n >= k (else 0): k
// entries reach it, so it is a lower bound of the k-th largest |s| of all entries, and
// the tightest that the pairs give (the fewest blocks read). The candidates are the pairs
// with |s| >= t0 and every entry of the blocks whose bound reaches t0; every other entry
// is below t0, so the k-th largest candidate is the
// k-th largest of all, exactly, ties included, and a non-finite entry (its block's bound
// is at least infinity's magnitude) is always among those read. The bounds of the blocks
// read are then recomputed exactly, the others raised to the pairs' new |residual|.
//
// The residual is touched once where a pair lands, not again to zero its winners: g, an
// estimate of the k-th largest |s| of the pairs from a sample of them (read before that
// pass, so its lines are in cache for it), decides what the pass writes there: 0.0f when
// |s| > g, else s. Once the k-th is known, only the pairs that g misjudged are written
// again (s for a loser zeroed, 0.0f for a winner not), with the winners in the blocks
// read; the pairs in those blocks get s back before they are read. g decides no result:
// a poor one costs writes, never bits.
// topk_of_union is its body, for a u_idx already known to increase strictly.
static int64_t topk_of_union(float* residual, int64_t numel, uint32_t* bounds,
                             const int64_t* u_idx, const float* u_val, int64_t n, int64_t k,
                             int64_t* out_idx, float* out_val) {
    if (k > numel) k = numel;
    const int64_t blocks = (numel + kBoundBlock - 1) / kBoundBlock;
    Scratch& w = scratch();
    if (bounds == nullptr) {
        bounds = w.own.ensure(blocks);
        block_bounds(residual, numel, bounds);
    }
    // The pairs' old residual (to restore), s and |s|. The residual is read where the
    // pairs land, ahead of use: it rarely is in cache.
    float* const old = w.old.ensure(n);
    float* const sum = w.sum.ensure(n);
    uint32_t* const mag = w.mag.ensure(n);
    const uint32_t guess = sampled_kth(residual, u_idx, u_val, n, k, w.sample);
    uint32_t worst = 0;
    for (int64_t j = 0; j < n; ++j) {
        if (j + kAhead < n) __builtin_prefetch(residual + u_idx[j + kAhead], 1);
        float* const r = residual + u_idx[j];
        old[j] = *r;
        sum[j] = old[j] + u_val[j];
        mag[j] = magnitude(sum[j]);
        uint32_t bits;  // s, or 0.0f when |s| > guess: a mask, not a branch
        std::memcpy(&bits, sum + j, 4);
        bits &= 0u - uint32_t(mag[j] <= guess);
        std::memcpy(r, &bits, 4);
        worst = std::max(worst, mag[j]);
    }
    auto restore = [&]() {
        for (int64_t j = n - 1; j >= 0; --j) residual[u_idx[j]] = old[j];
    };
    if (worst >= kNonFinite) {
        restore();
        return -2;
    }
    uint32_t t0 = 0, kth_pairs = 0;  // the k-th largest |s| of the pairs, the threshold
    if (k > 0 && n >= k) {
        kth_pairs = kth_largest(n, mag, k, w.hist);
        t0 = kth_pairs;
    }
    // The blocks to read (their bound reaches t0), then the candidates in index order:
    // the pairs with |s| >= t0 outside those blocks, and those blocks' entries >= t0.
    std::vector<int64_t>& read = w.read;
    read.clear();
    int64_t b = 0;
    if (k > 0) {
#if defined(__AVX512F__)
        const __m512i low = _mm512_set1_epi32(int(t0));
        for (; b + 16 <= blocks; b += 16)
            for (uint32_t hit = _mm512_cmpge_epu32_mask(_mm512_loadu_si512(bounds + b), low);
                 hit; hit &= hit - 1)
                read.push_back(b + __builtin_ctz(hit));
#endif
        for (; b < blocks; ++b)
            if (bounds[b] >= t0) read.push_back(b);
    }
    {  // the pairs in the blocks read hold s, as the walks below read it there
        int64_t j = 0;
        for (int64_t r : read) {
            const int64_t lo = r * kBoundBlock, hi = lo + kBoundBlock;
            while (j < n && u_idx[j] < lo) ++j;
            for (; j < n && u_idx[j] < hi; ++j) residual[u_idx[j]] = sum[j];
        }
    }
    for (int64_t r : read) {  // a non-finite entry lies in a block read
        const int64_t lo = r * kBoundBlock, hi = std::min(lo + kBoundBlock, numel);
        uint32_t most = 0;
        for (int64_t i = lo; i < hi; ++i) most = std::max(most, magnitude(residual[i]));
        if (most >= kNonFinite) {
            restore();
            return -2;
        }
    }
    // Visits (at, value, |value|, pair) of every entry that may be a candidate, in index
    // order: each pair outside the blocks read (pair: its position), then each entry of
    // those blocks (pair -1; its residual holds s where a pair lands).
    auto walk = [&](auto&& visit) {
        int64_t j = 0;
        auto pairs_below = [&](int64_t end) {
            for (; j < n && u_idx[j] < end; ++j) visit(u_idx[j], sum[j], mag[j], j);
        };
        for (int64_t r : read) {
            const int64_t lo = r * kBoundBlock, hi = std::min(lo + kBoundBlock, numel);
            pairs_below(lo);
            while (j < n && u_idx[j] < hi) ++j;
            for (int64_t i = lo; i < hi; ++i) visit(i, residual[i], magnitude(residual[i]), -1);
        }
        pairs_below(INT64_MAX);
    };
    int64_t written = 0;
    if (k > 0) {  // k candidates at least reach t0 (see above)
        uint32_t kth = kth_pairs;  // no block read: the candidates' k-th is the pairs'
        int64_t above = 0;
        if (read.empty() && n >= k) {
            for (int64_t c = 0; c < n; ++c) above += mag[c] > kth;
        } else {
            // The candidates' magnitudes (those >= t0), each written, kept when >= t0.
            uint32_t* const cmag = w.cand_mag.ensure(n + int64_t(read.size()) * kBoundBlock);
            int64_t count = 0;
            walk([&](int64_t, float, uint32_t m, int64_t) {
                cmag[count] = m;
                count += m >= t0;
            });
            kth = kth_largest(count, cmag, k, w.hist);
            for (int64_t c = 0; c < count; ++c) above += cmag[c] > kth;
        }
        // The winners in index order, without a branch per entry: every entry above the
        // k-th and the first (k - above) equal to it, each written, kept when it wins; a
        // winning pair's |residual| becomes 0. The residual's entries still to write (a
        // winner not zeroed by the pass over the pairs, a loser it zeroed) likewise.
        int64_t* const fix_at = w.fix_at.ensure(n + int64_t(read.size()) * kBoundBlock);
        float* const fix_val = w.fix_val.ensure(n + int64_t(read.size()) * kBoundBlock);
        int64_t ties = k - above, sink_idx, fixes = 0;
        float sink_val;
        walk([&](int64_t at, float value, uint32_t m, int64_t pair) {
            const bool tie = m == kth && ties > 0;
            const bool win = m > kth || tie;
            ties -= tie;
            const bool room = written < k;  // past the k-th winner: written to a sink
            *(room ? out_idx + written : &sink_idx) = at;
            *(room ? out_val + written : &sink_val) = value;
            written += win;
            uint32_t bits;  // value, or 0.0f for a winner: a mask, not a branch
            std::memcpy(&bits, &value, 4);
            bits &= uint32_t(win) - 1u;
            fix_at[fixes] = at;
            std::memcpy(fix_val + fixes, &bits, 4);
            fixes += win != ((pair >= 0) & (m > guess));
            if (pair >= 0) mag[pair] = win ? 0 : m;
        });
        for (int64_t c = 0; c < fixes; ++c) {
            if (c + kAhead < fixes) __builtin_prefetch(residual + fix_at[c + kAhead], 1);
            residual[fix_at[c]] = fix_val[c];
        }
    }
    for (int64_t j = 0; j < n; ++j) {
        uint32_t& bound = bounds[u_idx[j] / kBoundBlock];
        bound = std::max(bound, mag[j]);
    }
    for (int64_t r : read) {
        const int64_t lo = r * kBoundBlock;
        block_bounds(residual + lo, std::min(kBoundBlock, numel - lo), bounds + r);
    }
    return written;
}

int64_t hvdc_topk_bounded(float* residual, int64_t numel, uint32_t* bounds,
                          const int64_t* u_idx, const float* u_val, int64_t n, int64_t k,
                          int64_t* out_idx, float* out_val) {
    if (!strictly_increasing(u_idx, n)) return -1;
    return topk_of_union(residual, numel, bounds, u_idx, u_val, n, k, out_idx, out_val);
}

// hvdc_topk_bounded with bounds computed by a pass over the residual (a caller that keeps
// none between rounds).
int64_t hvdc_topk(float* residual, int64_t numel, const int64_t* u_idx, const float* u_val,
                  int64_t n, int64_t k, int64_t* out_idx, float* out_val) {
    return hvdc_topk_bounded(residual, numel, nullptr, u_idx, u_val, n, k, out_idx, out_val);
}

// Mode gtopk's aggregate (ps_server/rounds.py): of a union sum's n pairs (u_idx strictly
// increasing), the k with the largest |u_val| (of equal ones, the lower indices), in index
// order, into out_idx and out_val. No residual: the pairs left out stay with the workers
// that pushed them. Returns how many were written (min(k, n)), or -2 if a value is not
// finite (nothing written: the caller answers the whole sum).
//
// One pass over the sum keeps the candidates, the pairs whose magnitude reaches a guess
// below the k-th (from kSample evenly spaced pairs, lowered by three standard deviations
// of the sample's count); the exact k-th and the winners come from the candidates alone,
// about k(1 + 3 / sqrt(k kSample / n)) of them. A guess that let fewer than k through
// (the sample misled) makes every pair a candidate: the same result, slower.
int64_t hvdc_select_largest(const int64_t* u_idx, const float* u_val, int64_t n, int64_t k,
                            int64_t* out_idx, float* out_val) {
    if (n <= 0) return 0;
    Scratch& w = scratch();
    k = std::max<int64_t>(0, std::min(k, n));
    uint32_t guess = 0;
    if (k > 0 && k < n && n >= 4 * kSample && n < (int64_t(1) << 31)) {
        std::vector<uint32_t>& sample = w.sample;
        sample.resize(size_t(kSample));
        for (int64_t c = 0; c < kSample; ++c) sample[size_t(c)] = magnitude(u_val[c * n / kSample]);
        const double expected = double(k) * double(kSample) / double(n);
        const int64_t rank = std::min<int64_t>(
            kSample, int64_t(expected + 3.0 * std::sqrt(expected)) + 1);
        std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(),
                         std::greater<uint32_t>());
        guess = sample[size_t(rank - 1)];
    }
    // The candidates' magnitudes and positions (32-bit: n < 2**31 when guessing), and the
    // largest magnitude of all, for the non-finite check.
    uint32_t* const cmag = w.cand_mag.ensure(n + 16);
    uint32_t* const cpos = w.own.ensure(n + 16);
    int64_t count = 0, j = 0;
    uint32_t worst = 0;
    if (guess > 0) {
#if defined(__AVX512F__)
        const __m512i low = _mm512_set1_epi32(int(guess)), abs = _mm512_set1_epi32(0x7FFFFFFF);
        __m512i most = _mm512_setzero_si512();
        __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        for (; j + 16 <= n; j += 16) {  // compressed in a register, stored whole: the slack
            const __m512i m = _mm512_and_si512(_mm512_loadu_si512(u_val + j), abs);
            most = _mm512_max_epu32(most, m);
            const __mmask16 hit = _mm512_cmpge_epu32_mask(m, low);
            _mm512_storeu_si512(cmag + count, _mm512_maskz_compress_epi32(hit, m));
            _mm512_storeu_si512(cpos + count, _mm512_maskz_compress_epi32(hit, at));
            count += __builtin_popcount(hit);
            at = _mm512_add_epi32(at, step);
        }
        worst = _mm512_reduce_max_epu32(most);
#endif
        for (; j < n; ++j) {
            const uint32_t m = magnitude(u_val[j]);
            worst = std::max(worst, m);
            cmag[count] = m;
            cpos[count] = uint32_t(j);
            count += m >= guess;
        }
    }
    // Without a guess (or with one that let fewer than k through) every pair is a
    // candidate, its magnitude written once, by the same pass as the non-finite check.
    uint32_t* mag = cmag;
    auto every_pair = [&]() {
        mag = w.mag.ensure(n);
        for (int64_t i = 0; i < n; ++i) {
            mag[i] = magnitude(u_val[i]);
            worst = std::max(worst, mag[i]);
        }
        count = n;
    };
    bool all = guess == 0;
    if (all) every_pair();
    if (worst >= kNonFinite) return -2;
    if (k == n) {
        std::memcpy(out_idx, u_idx, size_t(n) * sizeof(int64_t));
        std::memcpy(out_val, u_val, size_t(n) * sizeof(float));
        return n;
    }
    if (k == 0) return 0;
    if (!all && count < k) {  // the sample misled
        every_pair();
        all = true;
    }
    const uint32_t kth = kth_largest(count, mag, k, w.hist);
    int64_t above = 0;
    for (int64_t c = 0; c < count; ++c) above += mag[c] > kth;
    // Every candidate above the k-th and the first (k - above) equal to it, each written
    // and kept when it wins (no branch per pair); past the k-th winner, into a sink.
    int64_t ties = k - above, written = 0, sink_idx;
    float sink_val;
    for (int64_t c = 0; c < count; ++c) {
        const int64_t at = all ? c : int64_t(cpos[c]);
        const bool tie = mag[c] == kth && ties > 0;
        const bool win = mag[c] > kth || tie;
        ties -= tie;
        const bool room = written < k;
        *(room ? out_idx + written : &sink_idx) = u_idx[at];
        *(room ? out_val + written : &sink_val) = u_val[at];
        written += win;
    }
    return written;
}

// Error codes of hvdc_varint_decode (sparse_wire.py turns them into messages).
enum : int64_t {
    kTruncated = -1,     // the section ends inside a varint, or bytes remain after `count`
    kTooLong = -2,       // a varint longer than 5 bytes
    kNonCanonical = -3,  // a redundant trailing zero group
    kOutOfRange = -4,    // an index at or beyond numel
};

// Decode `count` gaps g_j (unsigned LEB128) from data[0, nbytes) into strictly increasing
// indices i_j = i_{j-1} + g_j + 1 with i_{-1} = -1. Returns 0 or an error code above.
//
// Fast path (BMI2 and AVX2): 32 bytes at a time, their varints' last bytes (high bit
// clear) found at once by movemask. A block with a varint longer than 5 bytes (5
// continuation bytes in a row) or a non-canonical one (a zero byte after a continuation
// byte) goes to the byte-wise loop below, which gives the error code; otherwise each
// varint whole in the block is one 8-byte load and a pext at a position the mask gives,
// with no branch on its length, and the block's last index is checked against numel (the
// indices increase, so the first out of range is found only when one is).
int64_t hvdc_varint_decode(const uint8_t* data, int64_t nbytes, int64_t count, int64_t numel,
                           int64_t* out) {
    int64_t pos = 0, prev = -1, j = 0;
#if defined(__AVX512VBMI2__) && defined(__AVX512BW__) && defined(__BMI2__)
    // 32 varints at a time while they are all of 1 or 2 bytes (the gaps below 2**14 of
    // densities above 1 / 2**14): each one's bytes spread into a 16-bit lane by vpexpandb
    // (the inverse of hvdc_frame_encode's vpcompressb), its gap + 1 summed across the
    // lanes. A block with a longer varint, a non-canonical one or too few ends goes on to
    // the paths below, which give any error code; the block's last index is checked
    // against numel (the indices increase).
    while (pos + 64 <= nbytes && count - j >= 32) {
        const __m512i block = _mm512_loadu_si512(data + pos);
        const uint64_t more = _mm512_movepi8_mask(block);  // continuation bytes
        const uint64_t zero = _mm512_testn_epi8_mask(block, block);
        const uint64_t last = _pdep_u64(uint64_t(1) << 31, ~more);  // the 32nd varint's end
        const uint64_t used = last | (last - 1);
        if (!last || (more & more << 1 & used) || (zero & more << 1 & used)) break;
        const uint64_t starts = (~more << 1 | 1) & used;
        const uint64_t two = _pext_u64(more, starts);  // varint c has 2 bytes: bit c
        const __m512i lanes = _mm512_maskz_expand_epi8(
            _pdep_u64(two, 0xAAAAAAAAAAAAAAAAULL) | 0x5555555555555555ULL, block);
        const __m512i step = _mm512_add_epi16(  // gap + 1
            _mm512_or_si512(_mm512_and_si512(lanes, _mm512_set1_epi16(0x7F)),
                            _mm512_srli_epi16(_mm512_and_si512(lanes, _mm512_set1_epi16(0x7F00)), 1)),
            _mm512_set1_epi16(1));
        for (int half = 0; half < 2; ++half) {
            __m512i x = _mm512_cvtepu16_epi32(half ? _mm512_extracti64x4_epi64(step, 1)
                                                   : _mm512_castsi512_si256(step));
            const __m512i none = _mm512_setzero_si512();  // prefix sums over 16 lanes
            x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, none, 15));
            x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, none, 14));
            x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, none, 12));
            x = _mm512_add_epi32(x, _mm512_alignr_epi32(x, none, 8));
            const __m512i base = _mm512_set1_epi64(prev);
            _mm512_storeu_si512(out + j, _mm512_add_epi64(
                base, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(x))));
            _mm512_storeu_si512(out + j + 8, _mm512_add_epi64(
                base, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(x, 1))));
            j += 16;  // the last lane's sum, not read back from `out` (a stalled load)
            prev += _mm_extract_epi32(_mm512_extracti32x4_epi32(x, 3), 3);
        }
        if (prev >= numel) return kOutOfRange;
        pos += __builtin_ctzll(last) + 1;
    }
#endif
#if defined(__BMI2__) && defined(__AVX2__)
    // A block at pos reads data[pos, pos + 32) and 8-byte words from varint starts below
    // pos + 32, all inside the section; it holds at most 32 varints, all still counted.
    while (pos + 40 <= nbytes && count - j >= 32) {
        const __m256i block = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(data + pos));
        const uint32_t more = uint32_t(_mm256_movemask_epi8(block));  // continuation bytes
        const uint32_t zero = uint32_t(
            _mm256_movemask_epi8(_mm256_cmpeq_epi8(block, _mm256_setzero_si256())));
        uint32_t ends = ~more;  // varints' last bytes
        if (!ends || (more & more >> 1 & more >> 2 & more >> 3 & more >> 4) ||
            (zero & more << 1))
            break;  // a long or non-canonical varint, or none ending here
        int64_t start = 0;
        for (; ends; ends &= ends - 1) {
            const int64_t end = __builtin_ctz(ends);
            uint64_t word;
            std::memcpy(&word, data + pos + start, 8);
            prev += 1 + int64_t(_bzhi_u64(_pext_u64(word, 0x7F7F7F7F7F7F7F7FULL),
                                          unsigned(7 * (end - start + 1))));
            out[j++] = prev;
            start = end + 1;
        }
        if (prev >= numel) return kOutOfRange;
        pos += start;
    }
#endif
    for (; j < count; ++j) {
        uint64_t gap = 0;
        int len = 0;
        for (;;) {
            if (pos >= nbytes) return kTruncated;
            const uint8_t b = data[pos++];
            gap |= uint64_t(b & 0x7F) << (7 * len);
            ++len;
            if (!(b & 0x80)) {
                if (b == 0 && len > 1) return kNonCanonical;
                break;
            }
            if (len == 5) return kTooLong;
        }
        const int64_t idx = prev + 1 + int64_t(gap);  // gap < 2**35: no overflow
        if (idx >= numel) return kOutOfRange;
        out[j] = prev = idx;
    }
    return pos == nbytes ? 0 : kTruncated;
}

// Bytes of the varints of the gaps of strictly increasing, non-negative `idx`.
int64_t hvdc_varint_nbytes(const int64_t* idx, int64_t count) {
    int64_t total = 0, prev = -1, j = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
    // Several gaps at a time: a varint's length is 1 plus the 7-bit thresholds its gap
    // reaches. A gap of 2**35 or more (or a negative one) is left to the loop below,
    // which counts it as the encoder would (up to 10 bytes).
    if (count > 0) {
        total = (64 - __builtin_clzll(uint64_t(idx[0]) | 1) + 6) / 7;
        prev = idx[0];
        j = 1;
    }
    const int64_t done = j;
#endif
#if defined(__AVX512F__)
    const __m512i one = _mm512_set1_epi64(1);  // eight gaps at a time
    __m512i lengths = _mm512_setzero_si512();
    __mmask8 big = 0;
    for (; j + 8 <= count; j += 8) {
        const __m512i gap = _mm512_sub_epi64(
            _mm512_sub_epi64(_mm512_loadu_si512(idx + j), _mm512_loadu_si512(idx + j - 1)), one);
        __m512i len = one;
        for (int64_t t : {int64_t(1) << 7, int64_t(1) << 14, int64_t(1) << 21, int64_t(1) << 28})
            len = _mm512_mask_add_epi64(len, _mm512_cmpge_epu64_mask(gap, _mm512_set1_epi64(t)),
                                        len, one);
        lengths = _mm512_add_epi64(lengths, len);
        // unsigned: a negative gap is at least 2**63
        big |= _mm512_cmpge_epu64_mask(gap, _mm512_set1_epi64(int64_t(1) << 35));
    }
    if (!big) {
        total += _mm512_reduce_add_epi64(lengths);
        if (j > 0) prev = idx[j - 1];
    } else {
        j = done;  // counted again one by one
    }
#elif defined(__AVX2__)
    const __m256i one = _mm256_set1_epi64x(1);  // four gaps at a time
    __m256i lengths = _mm256_setzero_si256(), big = _mm256_setzero_si256();
    for (; j + 4 <= count; j += 4) {
        const __m256i gap = _mm256_sub_epi64(
            _mm256_sub_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + j)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(idx + j - 1))),
            one);
        __m256i len = one;
        for (int64_t t : {int64_t(1) << 7, int64_t(1) << 14, int64_t(1) << 21, int64_t(1) << 28})
            len = _mm256_sub_epi64(len, _mm256_cmpgt_epi64(gap, _mm256_set1_epi64x(t - 1)));
        lengths = _mm256_add_epi64(lengths, len);
        big = _mm256_or_si256(big, _mm256_or_si256(
            _mm256_cmpgt_epi64(gap, _mm256_set1_epi64x((int64_t(1) << 35) - 1)),
            _mm256_cmpgt_epi64(_mm256_setzero_si256(), gap)));
    }
    if (_mm256_testz_si256(big, big)) {
        alignas(32) int64_t lanes[4];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), lengths);
        total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
        if (j > 0) prev = idx[j - 1];
    } else {
        j = done;  // counted again one by one
    }
#endif
    for (; j < count; ++j) {  // a gap of b significant bits takes ceil(b / 7)
        const uint64_t gap = uint64_t(idx[j] - prev - 1);
        prev = idx[j];
        total += (64 - __builtin_clzll(gap | 1) + 6) / 7;
    }
    return total;
}

// Write the varints of the gaps of `idx` to `out` (room for 5 bytes per index); returns
// the count written, or -1 at the first gap of 2**35 or more, which would need a longer
// varint: `idx` is then not strictly increasing (a negative gap) or spans too much.
int64_t hvdc_varint_encode(const int64_t* idx, int64_t count, uint8_t* out) {
    int64_t pos = 0, prev = -1;
    for (int64_t j = 0; j < count; ++j) {
        uint64_t gap = uint64_t(idx[j] - prev - 1);
        if (gap >> 35) return -1;
        prev = idx[j];
        while (gap >= 0x80) {
            out[pos++] = uint8_t(gap) | 0x80;
            gap >>= 7;
        }
        out[pos++] = uint8_t(gap);
    }
    return pos;
}

// The union of `lists` sparse vectors and its sums: list l holds counts[l] pairs
// (idx[l][j], val[l][j]) with strictly increasing indices. Writes the union's indices in
// increasing order to out_idx and, for each, the sum of the lists' values there, added in
// list order starting from 0.0f, to out_val (room for the sum of the counts plus
// kMergeSlack). Returns the number of pairs written, or -1 if a list's indices decrease
// (outputs then incomplete).
//
// Two lists of kMergeTwoMin pairs or more are merged (merge_wide where AVX-512 is built
// in, else merge_two). Otherwise the sums are formed block by block of kBlock consecutive
// indices, in a scratch accumulator that stays in cache: every list's cursor advances
// through the block, then the block's marked positions are emitted (in order) and
// cleared. Memory is touched only sequentially, whatever the indices' range; blocks
// holding no pair are skipped.
//
// Emitting a marked word takes K set bits without a branch per bit (K = 4 in sparse
// blocks, 8 in blocks with more pairs than 3 per word, then a loop for any beyond K): an
// exhausted word yields bit 63 again, whose accumulator was just cleared, so the extra
// pairs written past the word's count hold (index, 0.0f) and are overwritten by the next
// ones, or lie in the slack.
int64_t hvdc_merge_sum(int64_t lists, const int64_t* const* idx, const float* const* val,
                       const int64_t* counts, int64_t* out_idx, float* out_val) {
    return merge_lists(lists, idx, val, counts, out_idx, out_val);
}

// A parameter-server round in one call (ps_server/rounds.py gives the contract): the
// union sum of the pushes as hvdc_merge_sum writes it (out_idx, out_val, `*union_count`
// pairs), then, with a `residual` (mode topk, numel floats), hvdc_topk of that sum into
// agg_idx and agg_val. Returns the aggregate's pair count (the union's without a
// residual), -1 if a list's indices decrease, -2 if s = residual + sum is not finite
// (the residual is then unchanged). `bounds`: hvdc_topk_bounded's.
int64_t hvdc_round_bounded(int64_t lists, const int64_t* const* idx, const float* const* val,
                           const int64_t* counts, int64_t* out_idx, float* out_val,
                           int64_t* union_count, float* residual, uint32_t* bounds,
                           int64_t numel, int64_t k, int64_t* agg_idx, float* agg_val) {
    const int64_t n = merge_lists(lists, idx, val, counts, out_idx, out_val);
    *union_count = n;
    if (n < 0 || residual == nullptr) return n;
    return topk_of_union(residual, numel, bounds, out_idx, out_val, n, k, agg_idx,
                         agg_val);  // the union increases strictly: not checked again
}

// hvdc_round_bounded without bounds kept between rounds (see hvdc_topk).
int64_t hvdc_round(int64_t lists, const int64_t* const* idx, const float* const* val,
                   const int64_t* counts, int64_t* out_idx, float* out_val,
                   int64_t* union_count, float* residual, int64_t numel, int64_t k,
                   int64_t* agg_idx, float* agg_val) {
    return hvdc_round_bounded(lists, idx, val, counts, out_idx, out_val, union_count,
                              residual, nullptr, numel, k, agg_idx, agg_val);
}

}  // extern "C"

// zlib's CRC-32 (reflected polynomial 0xEDB88320) of data[0, nbytes), continuing from
// `crc` as zlib.crc32(data, crc) does; returns it, or -1 when this build has no
// carry-less multiply (PCLMULQDQ), and the caller uses zlib.
//
// The message M(x) (its first 32 bits inverted by the start value) is reduced modulo P by
// folding: in the reflected bit order a 16-byte block is the polynomial whose x^127
// coefficient is bit 0 of its first byte, its low 64-bit half the coefficients x^127..x^64
// (s_hi) and its high half x^63..x^0 (s_lo). Moving a block T bits forward is
// s_hi * x^(T+64) + s_lo * x^T, and since a carry-less product of two reflected 64-bit
// words is the reflected 128-bit product times x, the constants are the reflected
// x^(T+63) mod P and x^(T-1) mod P (under 33 bits, so the products fit in 128). Four
// blocks 512 bits apart are folded at once, then into one; the last block and the bytes
// after it go through the byte-wise CRC, which maps anything congruent to M to M's CRC.
namespace {
uint32_t crc_table[256];

uint32_t crc_bytes(uint32_t reg, const uint8_t* p, int64_t n) {
    for (int64_t i = 0; i < n; ++i) reg = crc_table[(reg ^ p[i]) & 0xFF] ^ (reg >> 8);
    return reg;
}

#if defined(HVDC_CLMUL)
uint64_t reflect64(uint64_t v) {
    uint64_t r = 0;
    for (int i = 0; i < 64; ++i) r |= ((v >> i) & 1) << (63 - i);
    return r;
}

uint64_t x_pow_mod_p(int k) {  // x^k mod P in the normal bit order, P = 0x104C11DB7
    uint64_t r = 1;
    for (int i = 0; i < k; ++i) {
        r <<= 1;
        if (r >> 32) r ^= 0x104C11DB7ull;
    }
    return r;
}

__m128i fold_constants(int t) {
    return _mm_set_epi64x(int64_t(reflect64(x_pow_mod_p(t - 1))),
                          int64_t(reflect64(x_pow_mod_p(t + 63))));
}

struct Folds {
    __m128i by512, by384, by256, by128, by2048, by1536, by1024;
};

const Folds& folds() {
    static const Folds f = {fold_constants(512),  fold_constants(384),  fold_constants(256),
                            fold_constants(128),  fold_constants(2048), fold_constants(1536),
                            fold_constants(1024)};
    return f;
}

inline __m128i fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

inline __m128i load(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Registers of one block (Narrow) or four (Wide), for the folding loop of hvdc_crc32.
struct Narrow {
    using V = __m128i;
    static constexpr int64_t kBytes = 16;
    static V load(const uint8_t* p) { return ::load(p); }
    static V fold(V x, __m128i k) { return ::fold(x, k); }
    static V add(V a, V b) { return _mm_xor_si128(a, b); }
    static V low(uint32_t reg) { return _mm_cvtsi32_si128(int(reg)); }
};

#if defined(HVDC_WIDE_CLMUL)
struct Wide {
    using V = __m512i;
    static constexpr int64_t kBytes = 64;
    static V load(const uint8_t* p) { return _mm512_loadu_si512(p); }
    static V fold(V x, __m128i k) {  // fold() of each 128-bit lane
        const __m512i kk = _mm512_broadcast_i32x4(k);
        return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, kk, 0x00),
                                _mm512_clmulepi64_epi128(x, kk, 0x11));
    }
    static V add(V a, V b) { return _mm512_xor_si512(a, b); }
    static V low(uint32_t reg) { return _mm512_zextsi128_si512(_mm_cvtsi32_si128(int(reg))); }
};
#endif

// Four registers folded into the last: the first three moved by by3, by2, by1 bits.
template <typename L>
typename L::V combine(const typename L::V (&x)[4], __m128i by3, __m128i by2, __m128i by1) {
    return L::add(L::add(L::fold(x[0], by3), L::fold(x[1], by2)),
                  L::add(L::fold(x[2], by1), x[3]));
}

// Four registers of the first 4 * L::kBytes bytes (the start value in the first 4),
// folded forward by `by` (4 * L::kBytes * 8 bits) through every further such stretch,
// then combined into one.
template <typename L>
typename L::V fold_four(const uint8_t*& data, int64_t& nbytes, uint32_t reg, __m128i by,
                        __m128i by3, __m128i by2, __m128i by1) {
    typename L::V x[4];
    for (int i = 0; i < 4; ++i) x[i] = L::load(data + i * L::kBytes);
    x[0] = L::add(x[0], L::low(reg));
    for (data += 4 * L::kBytes, nbytes -= 4 * L::kBytes; nbytes >= 4 * L::kBytes;
         data += 4 * L::kBytes, nbytes -= 4 * L::kBytes)
        for (int i = 0; i < 4; ++i) x[i] = L::add(L::fold(x[i], by), L::load(data + i * L::kBytes));
    return combine<L>(x, by3, by2, by1);
}
#endif

struct TableInit {
    TableInit() {
        for (uint32_t b = 0; b < 256; ++b) {
            uint32_t r = b;
            for (int k = 0; k < 8; ++k) r = (r >> 1) ^ (0xEDB88320u & (0u - (r & 1)));
            crc_table[b] = r;
        }
    }
} table_init;
}  // namespace

extern "C" int64_t hvdc_crc32(int64_t crc, const uint8_t* data, int64_t nbytes) {
#if defined(HVDC_CLMUL)
    uint32_t reg = ~uint32_t(crc);
    if (nbytes < 64) return ~crc_bytes(reg, data, nbytes);
    const Folds& k = folds();
    __m128i x;
#if defined(HVDC_WIDE_CLMUL)
    if (nbytes >= 512) {
        // Sixteen blocks 2048 bits apart folded at once (four 64-byte registers), then
        // one register of four blocks 512 bits apart, then its four blocks into one.
        __m512i w = fold_four<Wide>(data, nbytes, reg, k.by2048, k.by1536, k.by1024, k.by512);
        for (; nbytes >= 64; data += 64, nbytes -= 64)
            w = Wide::add(Wide::fold(w, k.by512), Wide::load(data));
        const __m128i lanes[4] = {_mm512_castsi512_si128(w), _mm512_extracti32x4_epi32(w, 1),
                                  _mm512_extracti32x4_epi32(w, 2),
                                  _mm512_extracti32x4_epi32(w, 3)};
        x = combine<Narrow>(lanes, k.by384, k.by256, k.by128);
    } else
#endif
        x = fold_four<Narrow>(data, nbytes, reg, k.by512, k.by384, k.by256, k.by128);
    for (; nbytes >= 16; data += 16, nbytes -= 16) x = _mm_xor_si128(fold(x, k.by128), load(data));
    alignas(16) uint8_t last[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(last), x);
    return ~crc_bytes(crc_bytes(0, last, 16), data, nbytes);
#else
    (void)crc, (void)data, (void)nbytes, (void)crc_bytes;
    return -1;
#endif
}

// The delta+varint section of `count` strictly increasing indices (gaps below 2**35), written
// at p; returns its end. The fast paths store up to 64 bytes past the section's end: the
// caller leaves that much room (a frame's values and CRC follow it).
namespace {
uint8_t* put_varints(const int64_t* idx, int64_t count, uint8_t* p) {
#if defined(__BMI2__)
    // Each varint as one 8-byte store: its groups spread by pdep, continuation bits on
    // all but its last byte. A store reaches at most 7 bytes past the section.
    auto put = [&p, idx](int64_t j) {
        const uint64_t gap = uint64_t(idx[j] - (j ? idx[j - 1] : -1) - 1);
        const int len = (64 - __builtin_clzll(gap | 1) + 6) / 7;  // at most 5 here
        const uint64_t word = _pdep_u64(gap, 0x7F7F7F7F7FULL) |
                              (0x8080808080ULL & ((uint64_t(1) << (8 * len - 8)) - 1));
        std::memcpy(p, &word, 8);
        p += len;
    };
    int64_t j = 0;
#if defined(__AVX512VBMI2__) && defined(__AVX512BW__)
    // 32 gaps at a time when all are below 2**14 (varints of 1 or 2 bytes, most of
    // them at densities above 1 / 2**14): each gap's two bytes in a 16-bit lane, the
    // second byte kept only where the gap needs it (vpcompressb), one 64-byte store,
    // which reaches at most 64 bytes past the section.
    if (count > 0) put(j++);
    while (j + 32 <= count) {
        __m128i part[4];
        __mmask8 wide = 0;
        for (int q = 0; q < 4; ++q) {
            const int64_t* at = idx + j + 8 * q;
            const __m512i gap = _mm512_sub_epi64(
                _mm512_sub_epi64(_mm512_loadu_si512(at), _mm512_loadu_si512(at - 1)),
                _mm512_set1_epi64(1));
            wide |= _mm512_cmpge_epu64_mask(gap, _mm512_set1_epi64(1 << 14));
            part[q] = _mm512_maskz_cvtepi64_epi16(0xFF, gap);
        }
        if (wide) {  // a gap of 3 or more bytes (or a negative one): one by one
            for (const int64_t stop = j + 32; j < stop; ++j) put(j);
            continue;
        }
        const __m512i v = _mm512_maskz_inserti64x4(  // maskz: no undefined lanes
            0xFF, _mm512_zextsi256_si512(_mm256_set_m128i(part[1], part[0])),
            _mm256_set_m128i(part[3], part[2]), 1);
        const __mmask32 two = _mm512_cmpge_epu16_mask(v, _mm512_set1_epi16(0x80));
        // lane: the low 7 bits, a continuation bit where a second byte follows, then
        // the next 7 bits
        const __m512i bytes = _mm512_or_si512(
            _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(0x7F)),
                            _mm512_and_si512(_mm512_slli_epi16(v, 1),
                                             _mm512_set1_epi16(0x7F00))),
            _mm512_maskz_mov_epi16(two, _mm512_set1_epi16(0x80)));
        const __mmask64 keep = _pdep_u64(two, 0xAAAAAAAAAAAAAAAAULL) |
                               0x5555555555555555ULL;
        _mm512_storeu_si512(p, _mm512_maskz_compress_epi8(keep, bytes));
        p += __builtin_popcountll(keep);
        j += 32;
    }
#endif
    for (; j < count; ++j) put(j);
#else
    p += hvdc_varint_encode(idx, count, p);
#endif
    return p;
}
}  // namespace

namespace {
// Writes the CRC-32 of out[0, end) at `end` (little-endian, as the format says; x86);
// returns the frame's bytes.
int64_t close_frame(uint8_t* out, uint8_t* end) {
    const int64_t body = end - out;
    int64_t crc = hvdc_crc32(0, out, body);
    if (crc < 0) crc = ~crc_bytes(~0u, out, body) & 0xFFFFFFFFu;
    const uint32_t c = uint32_t(crc);
    std::memcpy(end, &c, 4);
    return body + 4;
}
}  // namespace

// A whole frame (sparse_wire.py's format) of `count` float32 pairs at strictly increasing
// `idx` below numel, in index coding `coding` (0 delta+varint, 1 bitmap, 2 dense), into
// out: the `head_len` bytes of `head` (header and tensor name, which the caller packed
// knowing the coding and the sections' sizes), the index and value sections, then the
// CRC-32 of all that. `out` holds exactly what this writes; returns the bytes written.
extern "C" int64_t hvdc_frame_encode(const uint8_t* head, int64_t head_len, const int64_t* idx,
                                     const float* val, int64_t count, int64_t numel,
                                     int64_t coding, uint8_t* out) {
    std::memcpy(out, head, size_t(head_len));
    uint8_t* p = out + head_len;
    if (coding == 0) {
        p = put_varints(idx, count, p);
        std::memcpy(p, val, size_t(count) * 4);
        p += count * 4;
    } else if (coding == 1) {
        const int64_t bytes = (numel + 7) / 8;
        std::memset(p, 0, size_t(bytes));
        for (int64_t j = 0; j < count; ++j) p[idx[j] >> 3] |= uint8_t(1u << (idx[j] & 7));
        p += bytes;
        std::memcpy(p, val, size_t(count) * 4);
        p += count * 4;
    } else {
        std::memset(p, 0, size_t(numel) * 4);
        float* dense = reinterpret_cast<float*>(p);
        for (int64_t j = 0; j < count; ++j) std::memcpy(dense + idx[j], val + j, 4);
        p += numel * 4;
    }
    return close_frame(out, p);
}

// The delta+varint index section of `count` strictly increasing non-negative indices
// whose gaps are below 2**35 (any shard's), written to `out` (room for 5 * count + 64
// bytes: the fast paths store past the section's end); returns its bytes. With
// hvdc_frame_assemble, a frame is sized by writing its section once, not by a counting
// pass over the indices and then the writing.
extern "C" int64_t hvdc_varint_section(const int64_t* idx, int64_t count, uint8_t* out) {
    return put_varints(idx, count, out) - out;
}

// hvdc_frame_encode's delta+varint frame from a section hvdc_varint_section wrote:
// `head` (its header giving section_len), the section, the `count` float32 values, the
// CRC-32 of all that. `out` holds exactly what this writes; returns the bytes written.
extern "C" int64_t hvdc_frame_assemble(const uint8_t* head, int64_t head_len,
                                       const uint8_t* section, int64_t section_len,
                                       const float* val, int64_t count, uint8_t* out) {
    std::memcpy(out, head, size_t(head_len));
    uint8_t* p = out + head_len;
    std::memcpy(p, section, size_t(section_len));
    p += section_len;
    std::memcpy(p, val, size_t(count) * 4);
    return close_frame(out, p + count * 4);
}
