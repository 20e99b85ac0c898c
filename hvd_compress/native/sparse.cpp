// Sparse (index, value) kernels of the parameter-server frames and the server's
// aggregation: delta+varint index coding (hvd_compress/sparse_wire.py gives the format)
// and the sum of a round's pushes. Single-threaded: a server runs one process per shard,
// and these loops are bound by memory access, not arithmetic.
#include <cstdint>
#include <cstring>
#include <vector>

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
// list order starting from 0.0f, to out_val (room for the sum of the counts). Returns the
// number of pairs written, or -1 if a list's indices decrease (outputs then incomplete).
//
// The sums are formed block by block of kBlock consecutive indices, in a scratch
// accumulator that stays in cache: every list's cursor advances through the block, then
// the block's marked positions are emitted (in order) and cleared. Memory is touched only
// sequentially, whatever the indices' range; blocks holding no pair are skipped.
int64_t hvdc_merge_sum(int64_t lists, const int64_t* const* idx, const float* const* val,
                       const int64_t* counts, int64_t* out_idx, float* out_val) {
    constexpr int64_t kBlock = 1 << 13, kWords = kBlock / 64;
    std::vector<int64_t> cursor(size_t(lists), 0);
    std::vector<float> acc(kBlock, 0.0f);
    std::vector<uint64_t> marked(kWords, 0);
    int64_t n = 0;
    for (;;) {
        int64_t lowest = INT64_MAX;
        for (int64_t l = 0; l < lists; ++l)
            if (cursor[l] < counts[l] && idx[l][cursor[l]] < lowest) lowest = idx[l][cursor[l]];
        if (lowest == INT64_MAX) return n;
        const int64_t base = lowest & ~(kBlock - 1), end = base + kBlock;
        for (int64_t l = 0; l < lists; ++l) {
            const int64_t* ix = idx[l];
            const float* v = val[l];
            int64_t j = cursor[l];
            for (const int64_t c = counts[l]; j < c && ix[j] < end; ++j) {
                const int64_t i = ix[j] - base;
                if (i < 0) return -1;  // list l decreases: its index lies before this block
                acc[i] += v[j];
                marked[i >> 6] |= uint64_t(1) << (i & 63);
            }
            cursor[l] = j;
        }
        for (int64_t w = 0; w < kWords; ++w) {
            uint64_t bits = marked[w];
            if (!bits) continue;
            marked[w] = 0;
            do {
                const int64_t i = (w << 6) + __builtin_ctzll(bits);
                out_idx[n] = base + i;
                out_val[n++] = acc[i];
                acc[i] = 0.0f;
                bits &= bits - 1;
            } while (bits);
        }
    }
}

}  // extern "C"
