// Sparse (index, value) kernels of the parameter-server frames and the server's
// aggregation: delta+varint index coding (hvd_compress/sparse_wire.py gives the format),
// the sum of a round's pushes, and the frames' CRC-32. Single-threaded: a server runs one process per shard,
// and these loops are bound by memory access, not arithmetic.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>
#if (defined(__PCLMUL__) && defined(__SSE4_1__)) || defined(__AVX2__) || defined(__BMI2__)
#include <immintrin.h>
#endif
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#define HVDC_CLMUL 1
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

// The body of hvdc_merge_sum (see there).
int64_t merge_lists(int64_t lists, const int64_t* const* idx, const float* const* val,
                    const int64_t* counts, int64_t* out_idx, float* out_val) {
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
}  // namespace

extern "C" {
// Server-side error feedback of mode topk: s = residual + (the union sum: n pairs at
// strictly increasing u_idx), then the k entries of largest |s| (ties: the lower index)
// go to out_idx (increasing) and out_val, and residual <- s with those entries set to
// 0.0f. Returns min(k, numel); -2 when s is not finite anywhere: the residual is then
// left as it was (the caller returns s whole); -1 if u_idx is not strictly increasing.
//
// One pass over the residual adds the sum in (in order, so memory is read sequentially),
// checks that s is finite and keeps the candidates: the entries whose |s| reaches a
// threshold t estimated from a fixed sample (every numel / 2**13-th entry). The k-th
// largest |s| among them is exact when at least k reach t (else the pass runs again with
// a lower t, down to 0, the sum already added), and the winners are written in index
// order. The sample only decides how many candidates there are, never which entries win.
int64_t hvdc_topk(float* residual, int64_t numel, const int64_t* u_idx, const float* u_val,
                  int64_t n, int64_t k, int64_t* out_idx, float* out_val) {
    for (int64_t j = 1; j < n; ++j)
        if (u_idx[j] <= u_idx[j - 1]) return -1;
    if (k > numel) k = numel;
    const int64_t stride = numel > (1 << 13) ? numel >> 13 : 1;
    std::vector<uint32_t> sample;  // |s| at every stride-th entry, in decreasing order
    if (k > 0 && k < numel) {
        sample.reserve(size_t(numel / stride + 1));
        const int64_t* u = u_idx;
        const int64_t* const u_end = u_idx + n;
        for (int64_t i = 0; i < numel; i += stride) {
            u = std::lower_bound(u, u_end, i);
            const float add = u != u_end && *u == i ? u_val[u - u_idx] : 0.0f;
            sample.push_back(magnitude(residual[i] + add));
        }
        std::sort(sample.begin(), sample.end(), std::greater<uint32_t>());
    }
    // The sample's entry of rank k / stride with a margin; 4 times further at each miss.
    const double expected = double(k) * double(sample.size()) / double(numel);
    size_t rank = size_t(expected + 4.0 * std::sqrt(expected) + 16.0);
    // The lowest threshold but one keeps every non-zero entry (magnitude >= 1); 0 keeps all.
    auto threshold = [&]() { return rank < sample.size() ? std::max(sample[rank], 1u) : 1u; };
    uint32_t t = threshold();
    std::vector<float> old(size_t(n > 0 ? n : 1));  // the residual where the sum is added
    std::vector<int64_t> cand;
    std::vector<uint32_t> mags;  // |s| of each candidate
    uint32_t worst = 0;
    bool added = false;
    for (;;) {
        cand.clear();
        mags.clear();
        cand.reserve(size_t(k > 0 ? 2 * k : 1));
        mags.reserve(size_t(k > 0 ? 2 * k : 1));
        int64_t i = 0, j = 0;
        auto add_below = [&](int64_t end) {  // the sum's pairs below `end`, first pass only
            for (; !added && j < n && u_idx[j] < end; ++j) {
                old[j] = residual[u_idx[j]];
                residual[u_idx[j]] = old[j] + u_val[j];
            }
        };
#if defined(__AVX2__)
        // 64 entries at a time: their magnitudes' maximum and a mask of those >= t.
        const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
        const __m256i below = _mm256_set1_epi32(int(t) - 1);  // m >= t iff m > t - 1
        __m256i most = _mm256_setzero_si256();
        for (; i + 64 <= numel; i += 64) {
            add_below(i + 64);
            uint64_t hits = 0;
            for (int l = 0; l < 64; l += 8) {
                const __m256i m = _mm256_and_si256(
                    _mm256_loadu_si256(reinterpret_cast<const __m256i*>(residual + i + l)),
                    abs_mask);
                most = _mm256_max_epu32(most, m);
                const int bits = _mm256_movemask_ps(
                    _mm256_castsi256_ps(_mm256_cmpgt_epi32(m, below)));
                hits |= uint64_t(unsigned(bits)) << l;
            }
            for (; hits; hits &= hits - 1) {
                const int64_t at = i + __builtin_ctzll(hits);
                cand.push_back(at);
                mags.push_back(magnitude(residual[at]));
            }
        }
        alignas(32) uint32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), most);
        for (uint32_t m : lanes) worst = m > worst ? m : worst;
#endif
        add_below(numel);
        for (; i < numel; ++i) {
            const uint32_t m = magnitude(residual[i]);
            worst = m > worst ? m : worst;
            if (m >= t) {
                cand.push_back(i);
                mags.push_back(m);
            }
        }
        added = true;
        if (worst >= kNonFinite) {
            for (int64_t r = n - 1; r >= 0; --r) residual[u_idx[r]] = old[r];
            return -2;
        }
        if (int64_t(cand.size()) >= k || t == 0) break;
        // The sample missed (structured data, or few non-zero entries): a lower threshold,
        // down to 1 (every non-zero entry), then 0.
        rank *= 4;
        t = t == 1 ? 0 : std::min(threshold(), t - 1);
    }
    if (k <= 0) return 0;
    std::vector<uint32_t> order(mags);
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(),
                     std::greater<uint32_t>());
    const uint32_t kth = order[size_t(k - 1)];
    int64_t above = 0;
    for (uint32_t m : mags) above += m > kth;
    int64_t ties = k - above, written = 0;  // entries equal to the k-th to take
    for (size_t c = 0; c < cand.size(); ++c) {
        if (mags[c] < kth) continue;
        if (mags[c] == kth) {
            if (!ties) continue;
            --ties;
        }
        const int64_t at = cand[c];
        out_idx[written] = at;
        out_val[written++] = residual[at];
        residual[at] = 0.0f;
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
#if defined(__AVX2__)
    // Four gaps at a time: a varint's length is 1 plus the 7-bit thresholds its gap
    // reaches. A gap of 2**35 or more (or a negative one) is left to the loop below,
    // which counts it as the encoder would (up to 10 bytes).
    if (count > 0) {
        total = (64 - __builtin_clzll(uint64_t(idx[0]) | 1) + 6) / 7;
        prev = idx[0];
        j = 1;
    }
    const __m256i one = _mm256_set1_epi64x(1);
    __m256i lengths = _mm256_setzero_si256(), big = _mm256_setzero_si256();
    int64_t done = j;
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
// The sums are formed block by block of kBlock consecutive indices, in a scratch
// accumulator that stays in cache: every list's cursor advances through the block, then
// the block's marked positions are emitted (in order) and cleared. Memory is touched only
// sequentially, whatever the indices' range; blocks holding no pair are skipped.
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
// (the residual is then unchanged).
int64_t hvdc_round(int64_t lists, const int64_t* const* idx, const float* const* val,
                   const int64_t* counts, int64_t* out_idx, float* out_val,
                   int64_t* union_count, float* residual, int64_t numel, int64_t k,
                   int64_t* agg_idx, float* agg_val) {
    const int64_t n = merge_lists(lists, idx, val, counts, out_idx, out_val);
    *union_count = n;
    if (n < 0 || residual == nullptr) return n;
    return hvdc_topk(residual, numel, out_idx, out_val, n, k, agg_idx, agg_val);
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
    __m128i by512, by384, by256, by128;
};

const Folds& folds() {
    static const Folds f = {fold_constants(512), fold_constants(384), fold_constants(256),
                            fold_constants(128)};
    return f;
}

inline __m128i fold(__m128i x, __m128i k) {
    return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

inline __m128i load(const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
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
    __m128i x0 = _mm_xor_si128(load(data), _mm_cvtsi32_si128(int(reg)));
    __m128i x1 = load(data + 16), x2 = load(data + 32), x3 = load(data + 48);
    data += 64;
    nbytes -= 64;
    for (; nbytes >= 64; data += 64, nbytes -= 64) {
        x0 = _mm_xor_si128(fold(x0, k.by512), load(data));
        x1 = _mm_xor_si128(fold(x1, k.by512), load(data + 16));
        x2 = _mm_xor_si128(fold(x2, k.by512), load(data + 32));
        x3 = _mm_xor_si128(fold(x3, k.by512), load(data + 48));
    }
    __m128i x = _mm_xor_si128(_mm_xor_si128(fold(x0, k.by384), fold(x1, k.by256)),
                              _mm_xor_si128(fold(x2, k.by128), x3));
    for (; nbytes >= 16; data += 16, nbytes -= 16) x = _mm_xor_si128(fold(x, k.by128), load(data));
    alignas(16) uint8_t last[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(last), x);
    return ~crc_bytes(crc_bytes(0, last, 16), data, nbytes);
#else
    (void)crc, (void)data, (void)nbytes, (void)crc_bytes;
    return -1;
#endif
}

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
#if defined(__BMI2__)
        // Each varint as one 8-byte store: its groups spread by pdep, continuation bits on
        // all but its last byte. A store reaches at most 7 bytes past the section, into
        // the values (4 * count bytes) and the CRC written after it.
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
        // second byte kept only where the gap needs it (vpcompressb), one 64-byte store.
        // Past the section it reaches at most 64 bytes, inside the values that follow
        // (4 * count bytes, count >= 32 here) and the CRC.
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
    const int64_t body = p - out;
    int64_t crc = hvdc_crc32(0, out, body);
    if (crc < 0) crc = ~crc_bytes(~0u, out, body) & 0xFFFFFFFFu;
    const uint32_t c = uint32_t(crc);
    std::memcpy(p, &c, 4);  // little-endian, as the format says (x86)
    return body + 4;
}
