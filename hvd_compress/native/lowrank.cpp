// A low-rank tensor written out or taken off: PowerSGD's commit on the CPU
// (hvd_compress.schemes.base.LowRank.write and .subtract_from).
//
// hvdc_lowrank_apply: out (n x m, contiguous) receives, for every entry,
//
//     acc = L[i,0] * R[j,0] + L[i,1] * R[j,1] + ... + L[i,r-1] * R[j,r-1]
//
// summed in that order, each product rounded to float32 and then added (no fused
// multiply-add: the library is built with -ffp-contract=off), and then either
// out = scale * acc (write) or out = out - acc (subtract). The same bits whatever the thread
// count (rows are split among threads, each row computed alone) and on every x86-64 CPU,
// which MKL's rank-r GEMM (torch.addmm) does not promise. It is also faster: with r of a few
// columns this one pass over `out` runs near copy speed where the GEMM did not
// (docs/results/lowrank-commit-48b5da6/README.md). The scheme's two products with the
// gradient (B^T M, M Q) stay with MKL: kernels of this kind were no faster there.
//
// R comes as its transpose, r x m contiguous (PowerSGD keeps Q that way), so every row of
// out reads r contiguous rows of it, which stay in the L1 cache; L is read with its strides
// (a factor may be a transposed view).

#include <algorithm>
#include <cstdint>

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

}  // extern "C"
