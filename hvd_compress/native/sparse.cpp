// Sparse (index, value) kernels of the parameter-server frames and the server's
// accumulator: delta+varint index coding (hvd_compress/sparse_wire.py gives the format)
// and the scatter-add / collect of a round. Single-threaded: a server runs one process per
// shard, and these loops are bound by memory access, not arithmetic.
#include <cstdint>
#include <cstring>

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

// Write the varints of the gaps of `idx` to `out` (hvdc_varint_nbytes bytes); returns the
// count written.
int64_t hvdc_varint_encode(const int64_t* idx, int64_t count, uint8_t* out) {
    int64_t pos = 0, prev = -1;
    for (int64_t j = 0; j < count; ++j) {
        uint64_t gap = uint64_t(idx[j] - prev - 1);
        prev = idx[j];
        while (gap >= 0x80) {
            out[pos++] = uint8_t(gap) | 0x80;
            gap >>= 7;
        }
        out[pos++] = uint8_t(gap);
    }
    return pos;
}

// acc[idx[j]] += val[j] and bit idx[j] of the bitmap `touched` set (LSB first), for
// unique in-range indices. The accumulator is far larger than the caches and the indices
// sparse, so the loads are prefetched a few pairs ahead.
void hvdc_scatter_add(float* acc, uint64_t* touched, const int64_t* idx, const float* val,
                      int64_t count) {
    constexpr int64_t kAhead = 16;
    for (int64_t j = 0; j < count; ++j) {
        if (j + kAhead < count) __builtin_prefetch(acc + idx[j + kAhead], 1);
        const int64_t i = idx[j];
        acc[i] += val[j];
        touched[i >> 6] |= uint64_t(1) << (i & 63);
    }
}

// Emit every position whose bit is set in `touched` (increasing), with its accumulated
// value, and reset both there (the accumulator is then all zeros again). `words` is the
// bitmap's length in 64-bit words. Returns the number of pairs written.
int64_t hvdc_collect(float* acc, uint64_t* touched, int64_t words, int64_t* out_idx,
                     float* out_val) {
    int64_t n = 0;
    for (int64_t w = 0; w < words; ++w) {
        uint64_t bits = touched[w];
        if (!bits) continue;
        touched[w] = 0;
        do {
            const int64_t i = (w << 6) + __builtin_ctzll(bits);
            out_idx[n] = i;
            out_val[n++] = acc[i];
            acc[i] = 0.0f;
            bits &= bits - 1;
        } while (bits);
    }
    return n;
}

}  // extern "C"
