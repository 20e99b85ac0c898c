// Top-k's candidate selection on a worker (hvd_compress/schemes/topk.py, largest_of): the
// indices of the entries of a float32 vector whose magnitude reaches a threshold, in one
// pass over the signed values (no |x| array, no mask). Single-threaded: a rank's exchange
// runs beside its training thread and the other ranks of its host.
#include <cmath>
#include <cstdint>

namespace {
// Entries tested together before looking for which one passed: few pass (about 3 k of n,
// k = n / 1000 at top-k 0.1%), so most blocks are one vectorised test and a branch.
constexpr int64_t kSelectBlock = 64;
}  // namespace

extern "C" {
// The increasing indices i of x[0..n) with |x[i]| >= threshold (false for a NaN entry, and
// for every entry when threshold is NaN), written to out while fewer than `capacity` have
// been found; returns how many passed, which may exceed `capacity` (the caller then asks
// again with room for that many).
int64_t hvdc_select_magnitude(const float* __restrict x, int64_t n, float threshold,
                              int64_t* __restrict out, int64_t capacity) {
    int64_t count = 0;
    int64_t i = 0;
    for (; i + kSelectBlock <= n; i += kSelectBlock) {
        const float* block = x + i;
        int any = 0;
        for (int64_t j = 0; j < kSelectBlock; ++j) any |= std::fabs(block[j]) >= threshold;
        if (!any) continue;
        for (int64_t j = 0; j < kSelectBlock; ++j) {
            if (std::fabs(block[j]) >= threshold) {
                if (count < capacity) out[count] = i + j;
                ++count;
            }
        }
    }
    for (; i < n; ++i) {
        if (std::fabs(x[i]) >= threshold) {
            if (count < capacity) out[count] = i;
            ++count;
        }
    }
    return count;
}
}  // extern "C"
