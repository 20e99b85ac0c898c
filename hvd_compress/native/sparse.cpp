// Sparse (index, value) kernels of the parameter-server frames and the server's
// aggregation: delta+varint index coding (hvd_compress/sparse_wire.py gives the format),
// the sum of a round's pushes, and the frames' CRC-32. Single-threaded: a server runs one process per shard,
// and these loops are bound by memory access, not arithmetic.
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__PCLMUL__) && defined(__SSE4_1__)
#include <immintrin.h>
#define HVDC_CLMUL 1
#endif

namespace {
// Pairs of room hvdc_merge_sum needs past the sum of its counts (see emit_block).
constexpr int64_t kMergeSlack = 8;
constexpr int64_t kBlock = 1 << 13, kWords = kBlock / 64;

// Emit the marked positions of a block (see hvdc_merge_sum), clearing them; returns
// how many. Writes up to K - 1 pairs past that count (at most kMergeSlack).
template <int K>
int64_t emit_block(int64_t base, float* __restrict acc, uint64_t* __restrict marked,
                   int64_t* __restrict out_idx, float* __restrict out_val) {
    static_assert(K - 1 <= kMergeSlack, "pairs written past the count exceed the slack");
    int64_t n = 0;
    for (int64_t w = 0; w < kWords; ++w) {
        uint64_t bits = marked[w];
        if (!bits) continue;
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
}  // namespace

extern "C" {

// Error codes of hvdc_varint_decode (sparse_wire.py turns them into messages).
enum : int64_t {
    kTruncated = -1,     // the section ends inside a varint, or bytes remain after `count`
    kTooLong = -2,       // a varint longer than 5 bytes
    kNonCanonical = -3,  // a redundant trailing zero group
    kOutOfRange = -4,    // an index at or beyond numel
};

// Decode `count` gaps g_j (unsigned LEB128) from data[0, nbytes) into strictly increasing
// indices i_j = i_{j-1} + g_j + 1 with i_{-1} = -1. Returns 0 or an error code above.
int64_t hvdc_varint_decode(const uint8_t* data, int64_t nbytes, int64_t count, int64_t numel,
                           int64_t* out) {
    int64_t pos = 0, prev = -1;
    for (int64_t j = 0; j < count; ++j) {
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
    int64_t total = 0, prev = -1;
    for (int64_t j = 0; j < count; ++j) {
        uint64_t gap = uint64_t(idx[j] - prev - 1);
        prev = idx[j];
        do {
            ++total;
            gap >>= 7;
        } while (gap);
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
        n += pairs > 3 * kWords ? emit_block<8>(base, a, m, out_idx + n, out_val + n)
                                : emit_block<4>(base, a, m, out_idx + n, out_val + n);
    }
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
