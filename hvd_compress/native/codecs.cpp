// Fused CPU kernels of the packed codecs (1-bit, QSGD, TernGrad).
//
// Each encode reads its float32 chunk once: the chunk is cut into tiles of whole buckets
// (and whole packing groups) that stay in cache; per tile, bucket statistics, then the
// codes, then the packed bytes. Decode unpacks a tile's codes and scales them. Tiles run
// on an OpenMP team of the size the caller passes (torch's intra-op thread count), handed
// out dynamically, so that a core busy with another process does not hold up the rest.
//
// The byte layouts are those of hvd_compress/wire.py, bit for bit; the arithmetic of each
// code and decoded value is the torch reference's float32 operation sequence (built with
// -ffp-contract=off, so no fused multiply-adds). Bucket sums are accumulated in float64
// and rounded to float32 once, as the reference does. Random draws are a counter-based
// hash of (seed, bucket, element), so a result does not depend on the thread count.
//
// Plain C ABI, called through ctypes (hvd_compress/native/__init__.py).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kTileTarget = 16384;      // elements per tile, at least
constexpr int64_t kParallelMin = 1 << 16;   // smaller chunks run on the calling thread
constexpr float kTiny = std::numeric_limits<float>::min();

int64_t gcd(int64_t a, int64_t b) {
  while (b) {
    int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

// ---------------------------------------------------------------------------------------
// Layouts (wire.py): 'bits' 1..8 are unsigned codes, packed within bytes when bits divides
// 8, else as bit planes; bits == 0 means trits, five base-3 digits per byte.

struct Tables {
  uint64_t bit_bytes[256];  // byte -> its 8 bits as 8 bytes (LSB first)
  uint64_t trit_digits[256];  // byte -> its 5 base-3 digits as bytes
  Tables() {
    for (int b = 0; b < 256; ++b) {
      uint64_t w = 0, d = 0;
      for (int t = 0; t < 8; ++t) w |= static_cast<uint64_t>((b >> t) & 1) << (8 * t);
      for (int t = 0, v = b; t < 5; ++t, v /= 3) d |= static_cast<uint64_t>(v % 3) << (8 * t);
      bit_bytes[b] = w;
      trit_digits[b] = d;
    }
  }
};
const Tables kTables;

// The LSBs of 8 bytes (each 0 or 1) gathered into one byte, byte t -> bit t.
inline uint8_t gather_bits(uint64_t w) {
  return static_cast<uint8_t>((w * 0x0102040810204080ULL) >> 56);
}

struct Layout {
  int bits;
  int64_t n;

  int64_t group() const {  // elements per packing group
    if (bits == 0) return 5;
    return 8 % bits == 0 ? 8 / bits : 8;
  }
  bool planes() const { return bits != 0 && 8 % bits != 0; }
  int64_t plane_bytes() const { return (n + 7) / 8; }
  int64_t nbytes() const {
    if (bits == 0) return (n + 4) / 5;
    if (planes()) return bits * plane_bytes();
    return (n + group() - 1) / group();
  }

  // Pack codes[0, count) of the elements from e0 (both multiples of group()) into out.
  void pack(const uint8_t* __restrict codes, int64_t e0, int64_t count, uint8_t* __restrict out) const {
    if (bits == 0) {
      uint8_t* o = out + e0 / 5;
      for (int64_t j = 0; j < count / 5; ++j) {
        const uint8_t* c = codes + 5 * j;
        o[j] = static_cast<uint8_t>(c[0] + 3 * c[1] + 9 * c[2] + 27 * c[3] + 81 * c[4]);
      }
    } else if (planes()) {
      for (int p = 0; p < bits; ++p) {
        uint8_t* o = out + p * plane_bytes() + e0 / 8;
        for (int64_t j = 0; j < count / 8; ++j) {
          uint64_t w;
          std::memcpy(&w, codes + 8 * j, 8);
          o[j] = gather_bits((w >> p) & 0x0101010101010101ULL);
        }
      }
    } else {
      switch (bits) {
        case 1: pack_within<1>(codes, count, out + e0 / 8); break;
        case 2: pack_within<2>(codes, count, out + e0 / 4); break;
        case 4: pack_within<4>(codes, count, out + e0 / 2); break;
        default: std::memcpy(out + e0, codes, count); break;
      }
    }
  }

  // Unpack the codes of elements [e0, e0 + count) (multiples of group()) into codes, which
  // has 8 bytes of slack past count.
  void unpack(const uint8_t* __restrict in, int64_t e0, int64_t count, uint8_t* __restrict codes) const {
    if (bits == 0) {
      const uint8_t* b = in + e0 / 5;
      for (int64_t j = 0; j < count / 5; ++j) std::memcpy(codes + 5 * j, &kTables.trit_digits[b[j]], 8);
    } else if (planes()) {
      std::memset(codes, 0, count);
      for (int p = 0; p < bits; ++p) {
        const uint8_t* b = in + p * plane_bytes() + e0 / 8;
        for (int64_t j = 0; j < count / 8; ++j) {
          uint64_t w;
          std::memcpy(&w, codes + 8 * j, 8);
          w |= kTables.bit_bytes[b[j]] << p;
          std::memcpy(codes + 8 * j, &w, 8);
        }
      }
    } else {
      switch (bits) {
        case 1: {
          const uint8_t* b = in + e0 / 8;
          for (int64_t j = 0; j < count / 8; ++j) std::memcpy(codes + 8 * j, &kTables.bit_bytes[b[j]], 8);
          break;
        }
        case 2: unpack_within<2>(in + e0 / 4, count, codes); break;
        case 4: unpack_within<4>(in + e0 / 2, count, codes); break;
        default: std::memcpy(codes, in + e0, count); break;
      }
    }
  }

  template <int B>
  static void pack_within(const uint8_t* __restrict codes, int64_t count, uint8_t* __restrict out) {
    constexpr int K = 8 / B;
    if (B == 1) {
      for (int64_t j = 0; j < count / 8; ++j) {
        uint64_t w;
        std::memcpy(&w, codes + 8 * j, 8);
        out[j] = gather_bits(w);
      }
      return;
    }
    for (int64_t j = 0; j < count / K; ++j) {
      unsigned byte = 0;
      for (int t = 0; t < K; ++t) byte |= static_cast<unsigned>(codes[K * j + t]) << (B * t);
      out[j] = static_cast<uint8_t>(byte);
    }
  }

  template <int B>
  static void unpack_within(const uint8_t* __restrict in, int64_t count, uint8_t* __restrict codes) {
    constexpr int K = 8 / B;
    constexpr unsigned mask = (1u << B) - 1;
    for (int64_t j = 0; j < count / K; ++j)
      for (int t = 0; t < K; ++t) codes[K * j + t] = static_cast<uint8_t>((in[j] >> (B * t)) & mask);
  }
};

// ---------------------------------------------------------------------------------------
// Bucket statistics, float64 accumulation in eight lanes.

template <class F>
double sum64(const float* x, int64_t len, F term) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= len; i += 8)
    for (int k = 0; k < 8; ++k) acc[k] += term(static_cast<double>(x[i + k]));
  for (int k = 0; i < len; ++i, ++k) acc[k] += term(static_cast<double>(x[i]));
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// |v| as its bits: non-negative floats order as their bit patterns, and NaNs above +inf.
inline uint32_t abs_bits(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b & 0x7fffffffU;
}

// max_i |f(v_i)|, NaN if any f(v_i) is NaN (as torch's amax): an integer maximum of the bits.
template <class F>
float max_abs(const float* __restrict x, int64_t len, F f) {
  uint32_t m = 0;
  for (int64_t i = 0; i < len; ++i) {
    const uint32_t b = abs_bits(f(x[i]));
    m = b > m ? b : m;
  }
  float out;
  std::memcpy(&out, &m, 4);
  return out;
}

// Random draws. Element j of bucket b draws lowbias32(j ^ k_b) (a 32-bit mixer by Chris
// Wellons), 24 bits of it as a float in [0, 1); k_b is the b-th output of splitmix64
// seeded with the caller's seed. One hash per element, and no dependence on the threads.
inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352dU;
  h ^= h >> 15;
  h *= 0x846ca68bU;
  h ^= h >> 16;
  return h;
}

struct Key {
  uint64_t seed;
  uint32_t bucket_key(int64_t b) const {
    uint64_t z = seed + static_cast<uint64_t>(b + 1) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
  }
  static float uniform(uint32_t bucket_key, int64_t j) {
    return static_cast<float>(mix32(static_cast<uint32_t>(j) ^ bucket_key) >> 8) * 0x1p-24f;
  }
};

// ---------------------------------------------------------------------------------------
// Codecs: encode_bucket writes a bucket's codes and returns its float32 scale; decoding
// maps code c of a bucket to float(a * c + b) * decode_scale(scale). Loop bodies use local
// copies and branch-free selects so that they vectorise.

struct OneBit {
  static constexpr int a = 2, b = -1;
  float encode_bucket(const float* __restrict x, int64_t len, int64_t,
                      uint8_t* __restrict codes) const {
    const double sum = sum64(x, len, [](double v) { return std::fabs(v); });
    for (int64_t i = 0; i < len; ++i) codes[i] = x[i] >= 0.0f;
    return static_cast<float>(sum / static_cast<double>(len));
  }
  float decode_scale(float scale) const { return scale; }
};

struct Qsgd {
  int levels;
  bool l2;
  Key key;
  static constexpr int a = 1;
  int b() const { return -levels; }
  float encode_bucket(const float* __restrict x, int64_t len, int64_t bucket,
                      uint8_t* __restrict codes) const {
    const float norm = l2 ? static_cast<float>(std::sqrt(sum64(x, len, [](double v) { return v * v; })))
                          : max_abs(x, len, [](float v) { return v; });
    const float d = norm < kTiny ? kTiny : norm;
    const int levels_ = levels;
    const float s = static_cast<float>(levels_);
    const float inv = s / d;
    const uint32_t k = key.bucket_key(bucket);
    for (int64_t i = 0; i < len; ++i) {
      const float y = std::fabs(x[i]) * inv;
      // floor, clamp to [0, s], NaN -> 0: y + u >= 0 unless NaN, so clamping first and
      // truncating is the same (and vectorises, where floorf does not here).
      float t = y + Key::uniform(k, i);
      t = t > s ? s : t;
      t = t >= 0.0f ? t : 0.0f;
      const int l = static_cast<int>(t);
      codes[i] = static_cast<uint8_t>(x[i] < 0.0f ? levels_ - l : levels_ + l);
    }
    return norm;
  }
  float decode_scale(float norm) const { return norm / static_cast<float>(levels); }
};

struct TernGrad {
  double clip;  // <= 0: no clipping
  Key key;
  static constexpr int a = 1, b = -1;
  float encode_bucket(const float* __restrict x, int64_t len, int64_t bucket,
                      uint8_t* __restrict codes) const {
    float bound = std::numeric_limits<float>::infinity();
    if (clip > 0) {
      const double n = static_cast<double>(len);
      const double mean = sum64(x, len, [](double v) { return v; }) / n;
      const double var = sum64(x, len, [mean](double v) { return (v - mean) * (v - mean); }) / n;
      bound = static_cast<float>(clip * std::sqrt(var));
    }
    if (bound != bound) {  // the values clip to NaN (torch.minimum), which sends 0
      std::memset(codes, 1, len);
      return bound;
    }
    // torch.maximum(torch.minimum(v, bound), -bound); NaN stays NaN.
    auto clipped = [bound](float v) {
      const float r = v > bound ? bound : v;
      return r < -bound ? -bound : r;
    };
    const float scale = max_abs(x, len, clipped);
    const float inv = 1.0f / (scale < kTiny ? kTiny : scale);
    const uint32_t k = key.bucket_key(bucket);
    for (int64_t i = 0; i < len; ++i) {
      const float r = clipped(x[i]);
      const int keep = Key::uniform(k, i) < std::fabs(r) * inv;
      codes[i] = static_cast<uint8_t>(1 + keep * ((r > 0.0f) - (r < 0.0f)));
    }
    return scale;
  }
  float decode_scale(float scale) const { return scale; }
};

template <class C>
int decode_a(const C&) { return C::a; }
int decode_b(const OneBit&) { return OneBit::b; }
int decode_b(const Qsgd& c) { return c.b(); }
int decode_b(const TernGrad&) { return TernGrad::b; }

// ---------------------------------------------------------------------------------------
// The tile loops.

// Tiles hold whole buckets and whole packing groups, at least kTileTarget elements.
struct Tiling {
  int64_t tile, tiles;
  Tiling(int64_t n, int64_t bucket, int64_t group) {
    const int64_t unit = bucket / gcd(bucket, group) * group;
    tile = unit * (unit >= kTileTarget ? 1 : (kTileTarget + unit - 1) / unit);
    tiles = (n + tile - 1) / tile;
  }
};

int team(int64_t n, int threads) { return n >= kParallelMin && threads > 1 ? threads : 1; }

// fn(codes, e0, count, padded) for every tile: elements [e0, e0 + count), padded to whole
// packing groups; codes is the thread's scratch, 8 bytes longer than a tile.
template <class F>
void for_each_tile(const Layout& layout, int64_t bucket, int threads, F fn) {
  const Tiling tiling(layout.n, bucket, layout.group());
#pragma omp parallel num_threads(team(layout.n, threads))
  {
    std::vector<uint8_t> codes(tiling.tile + 8);
#pragma omp for schedule(dynamic, 4)
    for (int64_t t = 0; t < tiling.tiles; ++t) {
      const int64_t e0 = t * tiling.tile;
      const int64_t count = std::min(tiling.tile, layout.n - e0);
      const int64_t padded = (count + layout.group() - 1) / layout.group() * layout.group();
      fn(codes.data(), e0, count, padded);
    }
  }
}

template <class C>
void encode(const C& codec, const float* x, int64_t n, int64_t bucket, int bits, uint8_t* out,
            int threads) {
  const Layout layout{bits, n};
  uint8_t* scales = out + layout.nbytes();
  for_each_tile(layout, bucket, threads, [&](uint8_t* codes, int64_t e0, int64_t count,
                                             int64_t padded) {
    for (int64_t b0 = e0; b0 < e0 + count; b0 += bucket) {
      const float scale =
          codec.encode_bucket(x + b0, std::min(bucket, n - b0), b0 / bucket, codes + (b0 - e0));
      std::memcpy(scales + 4 * (b0 / bucket), &scale, 4);
    }
    std::memset(codes + count, 0, padded - count);
    layout.pack(codes, e0, padded, out);
  });
}

// One tile of a payload: its codes unpacked into codes, then fn(b0, codes of the bucket,
// its length, its decode scale) for each bucket from element b0. The value code c of a
// bucket decodes to is decoded(a, b, c, scale).
template <class C, class F>
void decode_tile(const C& codec, const Layout& layout, const uint8_t* payload, int64_t bucket,
                 uint8_t* codes, int64_t e0, int64_t count, int64_t padded, F fn) {
  const uint8_t* scales = payload + layout.nbytes();
  layout.unpack(payload, e0, padded, codes);
  for (int64_t b0 = e0; b0 < e0 + count; b0 += bucket) {
    float stored;
    std::memcpy(&stored, scales + 4 * (b0 / bucket), 4);
    fn(b0, codes + (b0 - e0), std::min(bucket, layout.n - b0), codec.decode_scale(stored));
  }
}

inline float decoded(int a, int b, uint8_t c, float scale) {
  return static_cast<float>(a * c + b) * scale;
}

// decoded(a, b, c, scale) of a codec's bucket, as a function of the code c.
template <class C>
auto decoder(const C& codec, float scale) {
  const int a = decode_a(codec), b = decode_b(codec);
  return [a, b, scale](uint8_t c) { return decoded(a, b, c, scale); };
}

// 1-bit's two values, selected (no conversion, no product): float(2c - 1) * scale is
// scale or -scale exactly, and a NaN scale times -1 is that NaN (the product returns its
// NaN operand), not its negation.
inline auto decoder(const OneBit&, float scale) {
  const float negative = scale != scale ? scale : -scale;
  return [scale, negative](uint8_t c) { return c ? scale : negative; };
}

// For every element i of a payload: store(out, i, decoded value).
template <class C, class Store>
void map_decoded(const C& codec, const uint8_t* payload, int64_t n, int64_t bucket, int bits,
                 float* out, int threads, Store store) {
  const Layout layout{bits, n};
  for_each_tile(layout, bucket, threads, [&](uint8_t* codes, int64_t e0, int64_t count,
                                             int64_t padded) {
    decode_tile(codec, layout, payload, bucket, codes, e0, count, padded,
                [&](int64_t b0, const uint8_t* __restrict c, int64_t len, float scale) {
                  float* __restrict o = out + b0;
                  const auto value = decoder(codec, scale);
                  for (int64_t i = 0; i < len; ++i) store(o, i, value(c[i]));
                });
  });
}

template <class C>
void decode(const C& codec, const uint8_t* payload, int64_t n, int64_t bucket, int bits,
            float* out, int threads) {
  map_decoded(codec, payload, n, bucket, bits, out, threads,
              [](float* __restrict o, int64_t i, float d) { o[i] = d; });
}

// out = decode(payload) * factor: decode, then a float32 product by factor per element (the
// averaged gradient written straight from the payload), bit for bit the two passes.
template <class C>
void scaled(const C& codec, const uint8_t* payload, int64_t n, int64_t bucket, int bits,
            float* out, int threads, float factor) {
  map_decoded(codec, payload, n, bucket, bits, out, threads,
              [factor](float* __restrict o, int64_t i, float d) { o[i] = d * factor; });
}

// The float64 sum of every decoded value of a payload (NaN when one is NaN, or infinities
// of both signs meet), reading only the payload: each tile's sum in element order, then
// the tiles' sums in tile order, so the result does not depend on the thread count.
template <class C>
double total(const C& codec, const uint8_t* payload, int64_t n, int64_t bucket, int bits,
             int threads) {
  const Layout layout{bits, n};
  const Tiling tiling(n, bucket, layout.group());
  std::vector<double> sums(tiling.tiles, 0.0);
  const int a = decode_a(codec), b = decode_b(codec);
  for_each_tile(layout, bucket, threads, [&](uint8_t* codes, int64_t e0, int64_t count,
                                             int64_t padded) {
    double sum = 0.0;
    decode_tile(codec, layout, payload, bucket, codes, e0, count, padded,
                [&](int64_t, const uint8_t* __restrict c, int64_t len, float scale) {
                  // Integer code sums first: sum_i (a c_i + b) * scale, exactly as a
                  // double when the codes' sum is exact (it is: at most 255 * len).
                  int64_t codes_sum = 0;
                  for (int64_t i = 0; i < len; ++i) codes_sum += c[i];
                  const double units = static_cast<double>(a * codes_sum + b * len);
                  sum += units * static_cast<double>(scale);
                });
    sums[e0 / tiling.tile] = sum;
  });
  double out = 0.0;
  for (const double s : sums) out += s;
  return out;
}

// 1-bit's total from its sign bits alone: a bucket of len codes with k ones decodes to
// (2k - len) * scale in sum, k a popcount of the bucket's bits (their whole bytes, then
// the low bits of a last partial byte: bits past the bucket are never counted). The same
// integer units and the same float64 additions in the same tile and bucket order as the
// template above, so the same double, without unpacking a code.
double total(const OneBit&, const uint8_t* payload, int64_t n, int64_t bucket, int,
             int threads) {
  const Layout layout{1, n};
  const Tiling tiling(n, bucket, layout.group());
  const uint8_t* scales = payload + layout.nbytes();
  std::vector<double> sums(tiling.tiles, 0.0);
#pragma omp parallel for num_threads(team(n, threads)) schedule(dynamic, 4)
  for (int64_t t = 0; t < tiling.tiles; ++t) {
    const int64_t e0 = t * tiling.tile;
    const int64_t end = std::min(e0 + tiling.tile, n);
    double sum = 0.0;
    for (int64_t b0 = e0; b0 < end; b0 += bucket) {
      const int64_t len = std::min(bucket, n - b0);
      const uint8_t* bits = payload + b0 / 8;  // b0 is a multiple of 8 (bucket is)
      const int64_t whole = len / 8;
      int64_t ones = 0, j = 0;
      for (; j + 8 <= whole; j += 8) {
        uint64_t w;
        std::memcpy(&w, bits + j, 8);
        ones += __builtin_popcountll(w);
      }
      for (; j < whole; ++j) ones += __builtin_popcount(bits[j]);
      if (len % 8) ones += __builtin_popcount(bits[whole] & ((1u << (len % 8)) - 1));
      float scale;
      std::memcpy(&scale, scales + 4 * (b0 / bucket), 4);
      const double units = static_cast<double>(OneBit::a * ones + OneBit::b * len);
      sum += units * static_cast<double>(scale);
    }
    sums[t] = sum;
  }
  double out = 0.0;
  for (const double s : sums) out += s;
  return out;
}

// The fused error-feedback passes. Each value a decode writes is float(a * c + b) *
// decode_scale(scale), and these kernels use exactly that value, so they equal the unfused
// sequence (decode into a tensor, then torch's float32 add or subtract) bit for bit: one
// IEEE operation per element in a fixed order, with no fused multiply-add (-ffp-contract=
// off), whichever vector width the compiler chose.

// Encode elements [e0, e0 + count) of x (one tile, codes its scratch) into out, and
// overwrite them with x - decode(encode(x)) in the same pass (the decoded values are never
// written).
template <class C>
void encode_residual_tile(const C& codec, const Layout& layout, float* x, int64_t bucket,
                          uint8_t* out, uint8_t* codes, int64_t e0, int64_t count,
                          int64_t padded) {
  uint8_t* scales = out + layout.nbytes();
  for (int64_t b0 = e0; b0 < e0 + count; b0 += bucket) {
    const int64_t len = std::min(bucket, layout.n - b0);
    uint8_t* __restrict c = codes + (b0 - e0);
    const float stored = codec.encode_bucket(x + b0, len, b0 / bucket, c);
    std::memcpy(scales + 4 * (b0 / bucket), &stored, 4);
    const auto value = decoder(codec, codec.decode_scale(stored));
    float* __restrict v = x + b0;
    for (int64_t i = 0; i < len; ++i) v[i] = v[i] - value(c[i]);
  }
  std::memset(codes + count, 0, padded - count);
  layout.pack(codes, e0, padded, out);
}

// x <- x - decode(payload), in place: error feedback's residual from the payload sent.
template <class C>
void subtract(const C& codec, const uint8_t* payload, int64_t n, int64_t bucket, int bits,
              float* x, int threads) {
  map_decoded(codec, payload, n, bucket, bits, x, threads,
              [](float* __restrict v, int64_t i, float d) { v[i] = v[i] - d; });
}

// out = ((decode(p_0) + decode(p_1)) + ... + decode(p_{count-1})) [+ residual]: the sum of
// the payloads in the order given (then the residual, if not null). With encoded not null,
// the sum is then encoded into it and out becomes sum - decode(encoded), the reducing
// rank's new residual: the step of the compressed all-reduce, one pass per tile (a tile is
// summed, encoded and corrected while it is in cache).
template <class C>
void reduce(const C& codec, const uint8_t* const* payloads, int64_t count, int64_t n,
            int64_t bucket, int bits, float* out, const float* residual, uint8_t* encoded,
            int threads) {
  const Layout layout{bits, n};
  for_each_tile(layout, bucket, threads, [&](uint8_t* codes, int64_t e0, int64_t tile,
                                             int64_t padded) {
    // Each payload's loop adds its values in order; the last one adds the residual too
    // (the same additions in the same order as a pass of its own).
    for (int64_t w = 0; w < count; ++w) {
      const bool last = w == count - 1 && residual != nullptr;
      decode_tile(codec, layout, payloads[w], bucket, codes, e0, tile, padded,
                  [&](int64_t b0, const uint8_t* __restrict c, int64_t len, float scale) {
                    float* __restrict o = out + b0;
                    const float* __restrict r = last ? residual + b0 : nullptr;
                    const auto value = decoder(codec, scale);
                    if (w == 0 && last)
                      for (int64_t i = 0; i < len; ++i) o[i] = value(c[i]) + r[i];
                    else if (w == 0)
                      for (int64_t i = 0; i < len; ++i) o[i] = value(c[i]);
                    else if (last)
                      for (int64_t i = 0; i < len; ++i) o[i] = (o[i] + value(c[i])) + r[i];
                    else
                      for (int64_t i = 0; i < len; ++i) o[i] = o[i] + value(c[i]);
                  });
    }
    if (encoded != nullptr)
      encode_residual_tile(codec, layout, out, bucket, encoded, codes, e0, tile, padded);
  });
}

}  // namespace

extern "C" {

// Every kernel takes (input, element count, bucket size, output, threads, options...); the
// output holds the payload's bytes (encode) or the element count of floats (decode).

void hvdc_onebit_encode(const float* x, int64_t n, int64_t bucket, uint8_t* out, int threads) {
  encode(OneBit{}, x, n, bucket, 1, out, threads);
}

void hvdc_onebit_decode(const uint8_t* payload, int64_t n, int64_t bucket, float* out,
                        int threads) {
  decode(OneBit{}, payload, n, bucket, 1, out, threads);
}

void hvdc_qsgd_encode(const float* x, int64_t n, int64_t bucket, uint8_t* out, int threads,
                      int bits, int l2, uint64_t seed) {
  encode(Qsgd{(1 << (bits - 1)) - 1, l2 != 0, Key{seed}}, x, n, bucket, bits, out, threads);
}

void hvdc_qsgd_decode(const uint8_t* payload, int64_t n, int64_t bucket, float* out,
                      int threads, int bits) {
  decode(Qsgd{(1 << (bits - 1)) - 1, false, Key{0}}, payload, n, bucket, bits, out, threads);
}

void hvdc_terngrad_encode(const float* x, int64_t n, int64_t bucket, uint8_t* out, int threads,
                          double clip, uint64_t seed) {
  encode(TernGrad{clip, Key{seed}}, x, n, bucket, 0, out, threads);
}

void hvdc_terngrad_decode(const uint8_t* payload, int64_t n, int64_t bucket, float* out,
                          int threads) {
  decode(TernGrad{0.0, Key{0}}, payload, n, bucket, 0, out, threads);
}

// scaled (above) takes decode's arguments with the float factor before decode's options.

void hvdc_onebit_scaled(const uint8_t* payload, int64_t n, int64_t bucket, float* out,
                        int threads, float factor) {
  scaled(OneBit{}, payload, n, bucket, 1, out, threads, factor);
}

void hvdc_qsgd_scaled(const uint8_t* payload, int64_t n, int64_t bucket, float* out,
                      int threads, float factor, int bits) {
  scaled(Qsgd{(1 << (bits - 1)) - 1, false, Key{0}}, payload, n, bucket, bits, out, threads,
         factor);
}

void hvdc_terngrad_scaled(const uint8_t* payload, int64_t n, int64_t bucket, float* out,
                          int threads, float factor) {
  scaled(TernGrad{0.0, Key{0}}, payload, n, bucket, 0, out, threads, factor);
}

// total (above) takes decode's arguments with one double as its output.

void hvdc_onebit_total(const uint8_t* payload, int64_t n, int64_t bucket, double* out,
                       int threads) {
  *out = total(OneBit{}, payload, n, bucket, 1, threads);
}

void hvdc_qsgd_total(const uint8_t* payload, int64_t n, int64_t bucket, double* out,
                     int threads, int bits) {
  *out = total(Qsgd{(1 << (bits - 1)) - 1, false, Key{0}}, payload, n, bucket, bits, threads);
}

void hvdc_terngrad_total(const uint8_t* payload, int64_t n, int64_t bucket, double* out,
                         int threads) {
  *out = total(TernGrad{0.0, Key{0}}, payload, n, bucket, 0, threads);
}

// The fused error-feedback kernels (see subtract and reduce above): subtract takes
// decode's arguments, x in place of its output; reduce takes an array of ``count`` payload
// pointers as its input, then (count, residual or null, encoded or null) and encode's
// options (the codec that decodes the payloads also encodes the sum).

void hvdc_onebit_subtract(const uint8_t* payload, int64_t n, int64_t bucket, float* x,
                          int threads) {
  subtract(OneBit{}, payload, n, bucket, 1, x, threads);
}

void hvdc_onebit_reduce(const uint8_t* const* payloads, int64_t n, int64_t bucket, float* out,
                        int threads, int64_t count, const float* residual, uint8_t* encoded) {
  reduce(OneBit{}, payloads, count, n, bucket, 1, out, residual, encoded, threads);
}

void hvdc_qsgd_subtract(const uint8_t* payload, int64_t n, int64_t bucket, float* x,
                        int threads, int bits) {
  subtract(Qsgd{(1 << (bits - 1)) - 1, false, Key{0}}, payload, n, bucket, bits, x, threads);
}

void hvdc_qsgd_reduce(const uint8_t* const* payloads, int64_t n, int64_t bucket, float* out,
                      int threads, int64_t count, const float* residual, uint8_t* encoded,
                      int bits, int l2, uint64_t seed) {
  reduce(Qsgd{(1 << (bits - 1)) - 1, l2 != 0, Key{seed}}, payloads, count, n, bucket, bits,
         out, residual, encoded, threads);
}

void hvdc_terngrad_subtract(const uint8_t* payload, int64_t n, int64_t bucket, float* x,
                            int threads) {
  subtract(TernGrad{0.0, Key{0}}, payload, n, bucket, 0, x, threads);
}

void hvdc_terngrad_reduce(const uint8_t* const* payloads, int64_t n, int64_t bucket,
                          float* out, int threads, int64_t count, const float* residual,
                          uint8_t* encoded, double clip, uint64_t seed) {
  reduce(TernGrad{clip, Key{seed}}, payloads, count, n, bucket, 0, out, residual, encoded,
         threads);
}

}  // extern "C"
