// PowerSGD's CPU arithmetic with a gradient matrix M (n x m, rows ld apart) and thin
// factors of r columns, each sum in a stated order: the same bits on every thread count and
// every x86-64 CPU, which MKL's GEMM does not promise. On an AMD EPYC they are faster than
// it on the zoo's shapes; on the Xeon, slower at the transformer's small ones
// (docs/results/lowrank-commit-48b5da6, lowrank-products-18c3108, intel-check-6ec8897).
// Each product is rounded to float32 and then added (no fused multiply-add: the library is
// built with -ffp-contract=off).
//
// hvdc_lowrank_apply, the commit (hvd_compress.schemes.base.LowRank.write, .subtract_from):
// out (n x m, contiguous) receives, for every entry,
//
//     acc = L[i,0] * R[j,0] + L[i,1] * R[j,1] + ... + L[i,r-1] * R[j,r-1]
//
// in that order, then out = scale * acc (write) or out = out - acc (subtract). R comes as
// its transpose, r x m contiguous (PowerSGD keeps Q that way), so every row of out reads r
// contiguous rows of it, which stay in the L1 cache; L is read with its strides.
//
// hvdc_lowrank_right, the round P = M Q (hvd_compress.schemes.powersgd): for each row i and
// column k, the products M[i,j] Q[j,k] of the first m - m % 16 entries go to 16 lanes, lane
// l taking the j with j % 16 == l in order; the lanes are added in order 0..15; then the
// last m % 16 products in order (with no whole group: the products in order).
//
// hvdc_lowrank_left, the round Q = M^T P (B^T M with B = P, n x r): out[k][j] =
// B[0,k] M[0,j] + B[1,k] M[1,j] + ... over the rows in order.

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

// One row for a rank known at compile time: the r products of an entry stay in registers
// and `out` is read (subtract) and written once.
template <int R>
void row_fixed(const float* c, const float* rt, int64_t m, float* __restrict o, float scale,
               bool subtract) {
    if (subtract) {
        for (int64_t j = 0; j < m; ++j) {
            float acc = c[0] * rt[j];
            for (int k = 1; k < R; ++k) acc = acc + c[k] * rt[k * m + j];
            o[j] = o[j] - acc;
        }
    } else {
        for (int64_t j = 0; j < m; ++j) {
            float acc = c[0] * rt[j];
            for (int k = 1; k < R; ++k) acc = acc + c[k] * rt[k * m + j];
            o[j] = scale * acc;
        }
    }
}

// Any other rank: the sums of a block of columns in a buffer, one term at a time (the same
// order, so the same bits as row_fixed would give).
constexpr int64_t kColumns = 512;

void row_any(const float* c, int64_t r, const float* rt, int64_t m, float* __restrict o,
             float scale, bool subtract) {
    alignas(64) float acc[kColumns];
    for (int64_t j0 = 0; j0 < m; j0 += kColumns) {
        const int64_t w = std::min(kColumns, m - j0);
        for (int64_t j = 0; j < w; ++j) acc[j] = c[0] * rt[j0 + j];
        for (int64_t k = 1; k < r; ++k) {
            const float ck = c[k];
            const float* rk = rt + k * m + j0;
            for (int64_t j = 0; j < w; ++j) acc[j] = acc[j] + ck * rk[j];
        }
        float* oo = o + j0;
        if (subtract)
            for (int64_t j = 0; j < w; ++j) oo[j] = oo[j] - acc[j];
        else
            for (int64_t j = 0; j < w; ++j) oo[j] = scale * acc[j];
    }
}

// 16 floats as one value: the vector extension's arithmetic is lane by lane, whatever vector
// registers the CPU has (one AVX-512 register, two AVX2 ones).
typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16;
inline v16 load16(const float* p) {
    v16 v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }

// hvdc_lowrank_right's sums of row mi with the R columns of Q (rows of qt, m apart).
template <int R>
void right_row(const float* mi, const float* qt, int64_t m, float* sums) {
    v16 acc[R];
    const int64_t whole = m / kLanes * kLanes;
    if (whole > 0) {
        const v16 x = load16(mi);
        for (int k = 0; k < R; ++k) acc[k] = x * load16(qt + k * m);
        for (int64_t j = kLanes; j < whole; j += kLanes) {
            const v16 y = load16(mi + j);
            for (int k = 0; k < R; ++k) acc[k] = acc[k] + y * load16(qt + k * m + j);
        }
    }
    for (int k = 0; k < R; ++k) {
        float s = 0.0f;
        int64_t j = 0;
        if (whole > 0) {
            s = acc[k][0];
            for (int l = 1; l < kLanes; ++l) s = s + acc[k][l];
            j = whole;
        } else if (m > 0) {
            s = mi[0] * qt[k * m];
            j = 1;
        }
        for (; j < m; ++j) s = s + mi[j] * qt[k * m + j];
        sums[k] = s;
    }
}

// hvdc_lowrank_left over rows [i0, i1) for 2 x kLanes columns from j, the sums so far in
// out (none before row 0): the R x 32 sums stay in registers across the rows.
template <int R>
void left_strip(const float* b, int64_t i0, int64_t i1, int64_t b_row, int64_t b_col,
                const float* mat, int64_t ld, int64_t j, float* out, int64_t m) {
    v16 a0[R], a1[R];
    int64_t i = i0;
    if (i0 == 0) {
        const v16 x0 = load16(mat + j), x1 = load16(mat + j + kLanes);
        for (int k = 0; k < R; ++k) {
            const float c = b[k * b_col];
            a0[k] = c * x0;
            a1[k] = c * x1;
        }
        i = 1;
    } else {
        for (int k = 0; k < R; ++k) {
            a0[k] = load16(out + k * m + j);
            a1[k] = load16(out + k * m + j + kLanes);
        }
    }
    for (; i < i1; ++i) {
        const float* mi = mat + i * ld + j;
        const v16 x0 = load16(mi), x1 = load16(mi + kLanes);
        for (int k = 0; k < R; ++k) {
            const float c = b[i * b_row + k * b_col];
            a0[k] = a0[k] + c * x0;
            a1[k] = a1[k] + c * x1;
        }
    }
    for (int k = 0; k < R; ++k) {
        store16(out + k * m + j, a0[k]);
        store16(out + k * m + j + kLanes, a1[k]);
    }
}

// The same sums for any rank and columns [j0, j1), one entry at a time.
void left_columns(const float* b, int64_t i0, int64_t i1, int64_t r, int64_t b_row,
                  int64_t b_col, const float* mat, int64_t ld, int64_t j0, int64_t j1,
                  float* out, int64_t m) {
    for (int64_t i = i0; i < i1; ++i) {
        const float* mi = mat + i * ld;
        for (int64_t k = 0; k < r; ++k) {
            const float ck = b[i * b_row + k * b_col];
            float* ok = out + k * m;
            if (i == 0)
                for (int64_t j = j0; j < j1; ++j) ok[j] = ck * mi[j];
            else
                for (int64_t j = j0; j < j1; ++j) ok[j] = ok[j] + ck * mi[j];
        }
    }
}

}  // namespace

extern "C" {

// hvdc_lowrank_apply: see the top of this file. left_row and left_col are L's strides in
// elements; r <= kMaxRank (the caller checks, hvd_compress.native.tensors.lowrank_apply).
constexpr int64_t kMaxRank = 256;

void hvdc_lowrank_apply(const float* left, int64_t n, int64_t r, int64_t left_row,
                        int64_t left_col, const float* right_t, int64_t m, float* out,
                        float scale, int subtract, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && n * m >= (int64_t(1) << 18))
    for (int64_t i = 0; i < n; ++i) {
        float c[kMaxRank];
        for (int64_t k = 0; k < r; ++k) c[k] = left[i * left_row + k * left_col];
        float* o = out + i * m;
        const bool sub = subtract != 0;
        switch (r) {
            case 1: row_fixed<1>(c, right_t, m, o, scale, sub); break;
            case 2: row_fixed<2>(c, right_t, m, o, scale, sub); break;
            case 3: row_fixed<3>(c, right_t, m, o, scale, sub); break;
            case 4: row_fixed<4>(c, right_t, m, o, scale, sub); break;
            case 8: row_fixed<8>(c, right_t, m, o, scale, sub); break;
            default: row_any(c, r, right_t, m, o, scale, sub);
        }
    }
}

// hvdc_lowrank_right: out[i * out_row + k * out_col] = the sums of row i of M with column k
// of Q (given as qt, r x m contiguous), in the order stated at the top. Rows are split among
// threads.
void hvdc_lowrank_right(const float* mat, int64_t ld, int64_t n, int64_t m, const float* qt,
                        int64_t r, float* out, int64_t out_row, int64_t out_col,
                        int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && n * m >= (int64_t(1) << 18))
    for (int64_t i = 0; i < n; ++i) {
        float sums[kMaxRank];
        const float* mi = mat + i * ld;
        switch (r) {
            case 1: right_row<1>(mi, qt, m, sums); break;
            case 2: right_row<2>(mi, qt, m, sums); break;
            case 4: right_row<4>(mi, qt, m, sums); break;
            case 8: right_row<8>(mi, qt, m, sums); break;
            default:  // a column at a time: the same sums
                for (int64_t k = 0; k < r; ++k) right_row<1>(mi, qt + k * m, m, sums + k);
        }
        for (int64_t k = 0; k < r; ++k) out[i * out_row + k * out_col] = sums[k];
    }
}

// hvdc_lowrank_left: out (r x m, contiguous) = B^T M, B (n x r) read with its strides, each
// sum over the rows in order. The rows go in chunks of about 256 KiB of M, each chunk's
// strips of 32 columns taking it from the cache; the columns are split among threads.
void hvdc_lowrank_left(const float* b, int64_t n, int64_t r, int64_t b_row, int64_t b_col,
                       const float* mat, int64_t ld, int64_t m, float* out, int threads) {
    const int64_t width = 2 * kLanes, strips = (r == 1 || r == 2 || r == 4 || r == 8)
                                                   ? m / width : 0;
    const int64_t chunk = std::max<int64_t>(8, (int64_t(1) << 16) / std::max<int64_t>(m, 1));
    for (int64_t i0 = 0; i0 < n; i0 += chunk) {
        const int64_t i1 = std::min(n, i0 + chunk);
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1 && n * m >= (int64_t(1) << 18))
        for (int64_t s = 0; s <= strips; ++s) {
            if (s == strips) {  // the columns past the last whole strip
                left_columns(b, i0, i1, r, b_row, b_col, mat, ld, strips * width, m, out, m);
                continue;
            }
            const int64_t j = s * width;
            switch (r) {
                case 1: left_strip<1>(b, i0, i1, b_row, b_col, mat, ld, j, out, m); break;
                case 2: left_strip<2>(b, i0, i1, b_row, b_col, mat, ld, j, out, m); break;
                case 4: left_strip<4>(b, i0, i1, b_row, b_col, mat, ld, j, out, m); break;
                default: left_strip<8>(b, i0, i1, b_row, b_col, mat, ld, j, out, m);
            }
        }
    }
}

}  // extern "C"
