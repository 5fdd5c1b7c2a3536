// Routed-expert matvecs straight from GGUF-quantized planes, for XLA:CPU through the typed FFI.
//
// y[i, t, r] = sum_c W_{ids[i]}[r, c] * x[i or 0, t, c]  for the n experts ids[i] (an id outside [0, E) gives
// zeros), W held as glm53 planes: every field a uint32 plane [E, n_words, rows], rows (outputs) contiguous.
// A tile of L output rows is decoded one block at a time into a small f32 buffer (vectorized over the rows, it
// stays in L1) and multiplied into the T accumulators of those rows; nothing the size of a matrix is written.
// Weights are decoded exactly as glm53.quant.dequant / reencode do (products of an f16 scale and small
// integers, exact in f32); accumulation is f32. Work (expert, row tile) is split over a small thread pool.
//
// Built by kernels/moe/cpu_ffi.py on first use (c++ -O3 -march=native -std=c++17 -shared -fPIC).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // output rows per tile
constexpr int kMaxFields = 5;

// The format codes are glm53.quant.registry's `cpu_code`s (kernels/moe/cpu_ffi.py FORMAT_CODES); a test reads this
// enum, n_fields and the decode switch from the source and checks them against the registry.
enum Format : int64_t { IQ2_S = 1, IQ3_S = 2, IQ2_S_R = 3, IQ3_S_R = 4, IQ4_XS = 5, Q8_0 = 6, Q4_K = 7 };

int block_size(int64_t fmt) { return fmt == Q8_0 ? 32 : 256; }
int n_fields(int64_t fmt) {
  switch (fmt) {
    case IQ2_S: case IQ3_S: return 5;
    case IQ2_S_R: case IQ4_XS: case Q4_K: return 4;
    case IQ3_S_R: return 3;
    case Q8_0: return 2;
    default: return -1;
  }
}
bool needs_table(int64_t fmt) { return fmt == IQ2_S || fmt == IQ3_S; }

float half_to_float(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  uint32_t bits;
  if (e == 0) {
    if (m == 0) {
      bits = sign;
    } else {  // subnormal: m * 2^-24, exact in f32
      float v = static_cast<float>(m) * (1.0f / 16777216.0f);
      std::memcpy(&bits, &v, 4);
      bits |= sign;
    }
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112) << 23) | (m << 13);
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

// One expert matrix: field planes at that expert (word w, row r -> f[k][w * rows + r]).
struct Mat {
  const uint32_t* f[kMaxFields];
  const uint32_t* table;  // IQ2_S: 2 grid words per entry; IQ3_S: 1
  int64_t rows, nb, k, kp;  // k blocks per block-split group, kp paired words per group
};

inline uint32_t paired(const Mat& m, int fi, int64_t b, int64_t r) {
  const int64_t g = b / m.k, bi = b % m.k;
  const uint32_t v = m.f[fi][(g * m.kp + bi / 2) * m.rows + r];
  return (bi & 1) ? (v >> 16) : (v & 0xffffu);
}

// Block decoders: tile[j * LN + l] = weight j of block b of row r0 + l.

template <int LN>
void dec_iq2_s_r(const Mat& m, int64_t b, int64_t r0, float* tile) {  // d, scales, signs, levels
  float db[16][LN];
  for (int l = 0; l < LN; ++l) {
    const float d = half_to_float(paired(m, 0, b, r0 + l));
    for (int i = 0; i < 16; ++i) {
      const uint32_t s = (m.f[1][(b * 2 + i / 8) * m.rows + r0 + l] >> (4 * (i % 8))) & 15;
      db[i][l] = d * (0.5f + static_cast<float>(s)) * 0.25f;
    }
  }
  for (int k = 0; k < 16; ++k) {
    const uint32_t* lv = m.f[3] + (b * 16 + k) * m.rows + r0;
    const uint32_t* sg = m.f[2] + (b * 8 + k / 2) * m.rows + r0;
    const int sh = 16 * (k & 1);
    for (int j = 0; j < 16; ++j) {
      float* out = tile + (16 * k + j) * LN;
      for (int l = 0; l < LN; ++l) {
        const int c = static_cast<int>((lv[l] >> (2 * j)) & 3);
        int g = 8 + 17 * c + (c >> 1);
        g = ((sg[l] >> (sh + j)) & 1) ? -g : g;
        out[l] = static_cast<float>(g) * db[k][l];
      }
    }
  }
}

template <int LN>
void dec_iq3_s_r(const Mat& m, int64_t b, int64_t r0, float* tile) {  // d, scales, codes
  float db[8][LN];
  for (int l = 0; l < LN; ++l) {
    const float d = half_to_float(paired(m, 0, b, r0 + l));
    const uint32_t sw = m.f[1][b * m.rows + r0 + l];
    for (int i = 0; i < 8; ++i) db[i][l] = d * (1.0f + 2.0f * static_cast<float>((sw >> (4 * i)) & 15));
  }
  for (int k = 0; k < 32; ++k) {
    const uint32_t* cw = m.f[2] + (b * 32 + k) * m.rows + r0;
    for (int j = 0; j < 8; ++j) {
      float* out = tile + (8 * k + j) * LN;
      for (int l = 0; l < LN; ++l) {
        const int n = static_cast<int>((cw[l] >> (4 * j)) & 15);
        out[l] = static_cast<float>(2 * n - 15) * db[k / 4][l];
      }
    }
  }
}

inline uint32_t byte_of(const Mat& m, int fi, int64_t words_per_block, int64_t b, int i, int64_t r) {
  return (m.f[fi][(b * words_per_block + i / 4) * m.rows + r] >> (8 * (i % 4))) & 0xff;
}

template <int LN>
void dec_iq2_s(const Mat& m, int64_t b, int64_t r0, float* tile) {  // d, qs, signs, qh, scales
  float d[LN];
  for (int l = 0; l < LN; ++l) d[l] = half_to_float(paired(m, 0, b, r0 + l));
  for (int g = 0; g < 32; ++g) {
    uint32_t lo[LN], hi[LN], sg[LN];
    float db[LN];
    for (int l = 0; l < LN; ++l) {
      const int64_t r = r0 + l;
      const uint32_t idx = byte_of(m, 1, 8, b, g, r) | (((byte_of(m, 3, 2, b, g / 4, r) >> (2 * (g % 4))) & 3) << 8);
      lo[l] = m.table[2 * idx];
      hi[l] = m.table[2 * idx + 1];
      sg[l] = byte_of(m, 2, 8, b, g, r);
      const uint32_t s = (byte_of(m, 4, 2, b, g / 4, r) >> (4 * ((g / 2) % 2))) & 15;
      db[l] = d[l] * (0.5f + static_cast<float>(s)) * 0.25f;
    }
    for (int j = 0; j < 8; ++j) {
      float* out = tile + (8 * g + j) * LN;
      for (int l = 0; l < LN; ++l) {
        int v = static_cast<int>(((j < 4 ? lo[l] : hi[l]) >> (8 * (j % 4))) & 0xff);
        v = ((sg[l] >> j) & 1) ? -v : v;
        out[l] = static_cast<float>(v) * db[l];
      }
    }
  }
}

template <int LN>
void dec_iq3_s(const Mat& m, int64_t b, int64_t r0, float* tile) {  // d, qs, qh, signs, scales
  float db[8][LN];
  for (int l = 0; l < LN; ++l) {
    const float d = half_to_float(paired(m, 0, b, r0 + l));
    const uint32_t sw = m.f[4][b * m.rows + r0 + l];
    for (int i = 0; i < 8; ++i) db[i][l] = d * (1.0f + 2.0f * static_cast<float>((sw >> (4 * i)) & 15));
  }
  for (int w = 0; w < 16; ++w) {  // word w of qs: grid entries 4w .. 4w+3
    const uint32_t* qs = m.f[1] + (b * 16 + w) * m.rows + r0;
    const uint32_t* qh = m.f[2] + (b * 2 + w / 8) * m.rows + r0;
    const uint32_t* sw = m.f[3] + (b * 8 + w / 2) * m.rows + r0;
    for (int e = 0; e < 4; ++e) {
      const int i = 4 * w + e;  // entry i: weights 4i .. 4i+3, signs bits 4i % 32 .. of sign word i / 8
      uint32_t gw[LN];
      for (int l = 0; l < LN; ++l) gw[l] = m.table[((qs[l] >> (8 * e)) & 0xff) | (((qh[l] >> (i % 32)) & 1) << 8)];
      for (int j = 0; j < 4; ++j) {
        float* out = tile + (4 * i + j) * LN;
        const int ss = (4 * i + j) % 32;
        for (int l = 0; l < LN; ++l) {
          int v = static_cast<int>((gw[l] >> (8 * j)) & 0xff);
          v = ((sw[l] >> ss) & 1) ? -v : v;
          out[l] = static_cast<float>(v) * db[i / 8][l];
        }
      }
    }
  }
}

// IQ4_NL levels (gguf-py's kvalues) as floats: a 32-bit table lookup vectorizes, a byte one does not
alignas(64) constexpr float kIQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

template <int LN>
void dec_iq4_xs(const Mat& m, int64_t b, int64_t r0, float* tile) {  // d, scales_h, scales_l, qs
  float dl[8][LN];
  for (int l = 0; l < LN; ++l) {
    const float d = half_to_float(paired(m, 0, b, r0 + l));
    const uint32_t sh = paired(m, 1, b, r0 + l), sl = m.f[2][b * m.rows + r0 + l];
    for (int i = 0; i < 8; ++i) {
      const int ls = static_cast<int>(((sl >> (4 * i)) & 15) | (((sh >> (2 * i)) & 3) << 4));
      dl[i][l] = d * static_cast<float>(ls - 32);
    }
  }
  for (int w = 0; w < 32; ++w) {  // word w of qs: bytes 4w .. 4w+3 = bytes of run ib = w / 4
    const uint32_t* q = m.f[3] + (b * 32 + w) * m.rows + r0;
    const int ib = w / 4, base = 32 * ib + 4 * (w % 4);
    for (int j = 0; j < 8; ++j) {  // byte j % 4, nibble j / 4 -> weight base + j % 4 + 16 (j / 4)
      float* out = tile + (base + (j % 4) + 16 * (j / 4)) * LN;
      const int sh = 8 * (j % 4) + 4 * (j / 4);
      for (int l = 0; l < LN; ++l) out[l] = kIQ4NL[(q[l] >> sh) & 15] * dl[ib][l];
    }
  }
}

template <int LN>
void dec_q8_0(const Mat& m, int64_t b, int64_t r0, float* tile) {  // d, qs
  float d[LN];
  for (int l = 0; l < LN; ++l) d[l] = half_to_float(paired(m, 0, b, r0 + l));
  for (int w = 0; w < 8; ++w) {
    const uint32_t* q = m.f[1] + (b * 8 + w) * m.rows + r0;
    for (int j = 0; j < 4; ++j) {
      float* out = tile + (4 * w + j) * LN;
      for (int l = 0; l < LN; ++l) out[l] = static_cast<float>(static_cast<int8_t>((q[l] >> (8 * j)) & 0xff)) * d[l];
    }
  }
}

template <int LN>
void dec_q4_k(const Mat& m, int64_t b, int64_t r0, float* tile) {  // d, dmin, scales, qs
  float dl[8][LN], ml[8][LN];
  for (int l = 0; l < LN; ++l) {
    const int64_t r = r0 + l;
    const float d = half_to_float(paired(m, 0, b, r)), dmin = half_to_float(paired(m, 1, b, r));
    uint32_t s[12];
    for (int i = 0; i < 12; ++i) s[i] = byte_of(m, 2, 3, b, i, r);
    for (int j = 0; j < 8; ++j) {
      uint32_t sc, mn;
      if (j < 4) {
        sc = s[j] & 63;
        mn = s[j + 4] & 63;
      } else {
        sc = (s[j + 4] & 15) | ((s[j - 4] >> 2) & 0x30);
        mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
      }
      dl[j][l] = d * static_cast<float>(sc);
      ml[j][l] = dmin * static_cast<float>(mn);
    }
  }
  for (int w = 0; w < 32; ++w) {  // bytes 4w .. 4w+3 of qs: c = w / 8, weights 64 c + 32 k + (4w % 32) + j
    const uint32_t* q = m.f[3] + (b * 32 + w) * m.rows + r0;
    const int c = w / 8, lo = (4 * w) % 32;
    for (int j = 0; j < 8; ++j) {
      const int kk = j / 4, sb = 2 * c + kk;
      float* out = tile + (64 * c + 32 * kk + lo + j % 4) * LN;
      const int sh = 8 * (j % 4) + 4 * kk;
      for (int l = 0; l < LN; ++l) out[l] = dl[sb][l] * static_cast<float>((q[l] >> sh) & 15) - ml[sb][l];
    }
  }
}

template <int LN>
void decode(int64_t fmt, const Mat& m, int64_t b, int64_t r0, float* tile) {
  switch (fmt) {
    case IQ2_S: return dec_iq2_s<LN>(m, b, r0, tile);
    case IQ3_S: return dec_iq3_s<LN>(m, b, r0, tile);
    case IQ2_S_R: return dec_iq2_s_r<LN>(m, b, r0, tile);
    case IQ3_S_R: return dec_iq3_s_r<LN>(m, b, r0, tile);
    case IQ4_XS: return dec_iq4_xs<LN>(m, b, r0, tile);
    case Q8_0: return dec_q8_0<LN>(m, b, r0, tile);
    case Q4_K: return dec_q4_k<LN>(m, b, r0, tile);
  }
}

typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));  // one tile row of weights

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// acc[t] += sum_j tile[j] * xb[t][j] over a block of bs weights, for TN tokens (registers; one token: four
// partial sums so the additions do not wait on each other).
template <int TN>
inline void accumulate(const float* tile, const float* const* xb, int bs, vf* acc) {
  if constexpr (TN == 1) {
    vf a0 = acc[0], a1 = {}, a2 = {}, a3 = {};
    const float* x = xb[0];
    for (int j = 0; j < bs; j += 4) {
      a0 += load(tile + j * kLanes) * x[j];
      a1 += load(tile + (j + 1) * kLanes) * x[j + 1];
      a2 += load(tile + (j + 2) * kLanes) * x[j + 2];
      a3 += load(tile + (j + 3) * kLanes) * x[j + 3];
    }
    acc[0] = (a0 + a1) + (a2 + a3);
  } else {
    vf a[TN];
    for (int t = 0; t < TN; ++t) a[t] = acc[t];
    for (int j = 0; j < bs; ++j) {
      const vf w = load(tile + j * kLanes);
      for (int t = 0; t < TN; ++t) a[t] += w * xb[t][j];
    }
    for (int t = 0; t < TN; ++t) acc[t] = a[t];
  }
}

template <int TN>
void tile_tokens(int64_t fmt, const Mat& m, int64_t r0, const float* x, int64_t cols, float* tile, float* out) {
  const int bs = block_size(fmt);
  vf acc[TN];
  for (int t = 0; t < TN; ++t) acc[t] = vf{};
  for (int64_t b = 0; b < m.nb; ++b) {
    decode<kLanes>(fmt, m, b, r0, tile);
    const float* xb[TN];
    for (int t = 0; t < TN; ++t) xb[t] = x + t * cols + b * bs;
    accumulate<TN>(tile, xb, bs, acc);
  }
  for (int t = 0; t < TN; ++t) std::memcpy(out + t * m.rows + r0, &acc[t], sizeof(vf));
}

// Rows [r0, r0 + LN) of one expert: out[t * rows + r] for the T tokens of x (x[t * cols + c]).
template <int LN>
void tile_matvec(int64_t fmt, const Mat& m, int64_t r0, const float* x, int64_t t_count, int64_t cols, float* out) {
  const int bs = block_size(fmt);
  alignas(64) float tile[256 * LN];
  if constexpr (LN == kLanes) {
    for (int64_t t0 = 0; t0 < t_count; t0 += 8) {  // up to 8 tokens per pass over the weights
      const float* xt = x + t0 * cols;
      float* ot = out + t0 * m.rows;
      switch (std::min<int64_t>(8, t_count - t0)) {
        case 1: tile_tokens<1>(fmt, m, r0, xt, cols, tile, ot); break;
        case 2: tile_tokens<2>(fmt, m, r0, xt, cols, tile, ot); break;
        case 3: tile_tokens<3>(fmt, m, r0, xt, cols, tile, ot); break;
        case 4: tile_tokens<4>(fmt, m, r0, xt, cols, tile, ot); break;
        case 5: tile_tokens<5>(fmt, m, r0, xt, cols, tile, ot); break;
        case 6: tile_tokens<6>(fmt, m, r0, xt, cols, tile, ot); break;
        case 7: tile_tokens<7>(fmt, m, r0, xt, cols, tile, ot); break;
        default: tile_tokens<8>(fmt, m, r0, xt, cols, tile, ot); break;
      }
    }
    return;
  }
  for (int64_t t = 0; t < t_count; ++t) {  // the rows past the last whole tile, one at a time
    float acc[LN] = {};
    for (int64_t b = 0; b < m.nb; ++b) {
      decode<LN>(fmt, m, b, r0, tile);
      const float* xb = x + t * cols + b * bs;
      for (int j = 0; j < bs; ++j)
        for (int l = 0; l < LN; ++l) acc[l] += tile[j * LN + l] * xb[j];
    }
    for (int l = 0; l < LN; ++l) out[t * m.rows + r0 + l] = acc[l];
  }
}

ffi::Error QMatvec(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs planes,
                   ffi::ResultBuffer<ffi::F32> y, int64_t fmt, int64_t rows, int64_t cols, int64_t splits,
                   int64_t threads) {
  const int nf = n_fields(fmt);
  if (nf < 0) return ffi::Error::InvalidArgument("glm53_qmatvec: unknown format code");
  const size_t want = static_cast<size_t>(nf) + (needs_table(fmt) ? 1 : 0);
  if (planes.size() != want) return ffi::Error::InvalidArgument("glm53_qmatvec: wrong number of plane operands");
  const auto xd = x.dimensions(), yd = y->dimensions();
  const int64_t n = ids.element_count();
  if (xd.size() != 3 || yd.size() != 3 || xd[2] != cols || yd[0] != n || yd[2] != rows || xd[1] != yd[1] ||
      (xd[0] != 1 && xd[0] != n))
    return ffi::Error::InvalidArgument("glm53_qmatvec: x [1 or n, T, cols] / y [n, T, rows] shape mismatch");
  const int64_t t_count = xd[1], bs = block_size(fmt);
  if (cols % bs || rows < 1) return ffi::Error::InvalidArgument("glm53_qmatvec: bad shape");
  Mat base{};
  base.rows = rows;
  base.nb = cols / bs;
  if (splits < 1 || base.nb % splits) return ffi::Error::InvalidArgument("glm53_qmatvec: bad block_splits");
  base.k = base.nb / splits;
  base.kp = (base.k + 1) / 2;
  int64_t n_experts = -1;
  std::vector<int64_t> stride(nf);
  for (int i = 0; i < nf; ++i) {
    auto a = planes.get<ffi::Buffer<ffi::U32>>(i);
    if (a.has_error()) return a.error();
    const auto d = a->dimensions();
    if (d.size() != 3 || d[2] != rows) return ffi::Error::InvalidArgument("glm53_qmatvec: plane is not [E, words, rows]");
    if (n_experts < 0) n_experts = d[0];
    if (d[0] != n_experts) return ffi::Error::InvalidArgument("glm53_qmatvec: planes disagree on E");
    base.f[i] = a->typed_data();
    stride[i] = d[1] * d[2];
  }
  if (needs_table(fmt)) {
    auto tb = planes.get<ffi::Buffer<ffi::U32>>(nf);
    if (tb.has_error()) return tb.error();
    base.table = tb->typed_data();
  }
  const int32_t* id = ids.typed_data();
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  const int64_t tiles = rows / kLanes, tail = rows % kLanes, per = tiles + (tail ? 1 : 0);
  // items: (expert i, group of row tiles); about 4 items per thread per expert for balance
  const int64_t group = std::max<int64_t>(1, per / 8);
  const int64_t groups = (per + group - 1) / group;
  auto item = [&](int64_t it) {
    const int64_t i = it / groups, g0 = (it % groups) * group, g1 = std::min(per, g0 + group);
    const int32_t e = id[i];
    float* out = yp + i * t_count * rows;
    if (e < 0 || e >= n_experts) {
      for (int64_t t = 0; t < t_count; ++t)
        for (int64_t r = g0 * kLanes; r < std::min(rows, g1 * kLanes); ++r) out[t * rows + r] = 0.0f;
      return;
    }
    Mat m = base;
    for (int f = 0; f < nf; ++f) m.f[f] = base.f[f] + e * stride[f];
    const float* xi = xp + (xd[0] == 1 ? 0 : i) * t_count * cols;
    for (int64_t g = g0; g < g1; ++g) {
      if (g < tiles) {
        tile_matvec<kLanes>(fmt, m, g * kLanes, xi, t_count, cols, out);
      } else {
        for (int64_t r = tiles * kLanes; r < rows; ++r) tile_matvec<1>(fmt, m, r, xi, t_count, cols, out);
      }
    }
  };
  const int64_t n_items = n * groups;
  if (threads <= 1) {
    for (int64_t it = 0; it < n_items; ++it) item(it);
  } else {
    glm53::pool(static_cast<int>(threads)).run(n_items, item);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm53QMatvec, QMatvec,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [1 or n, T, cols]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [n]
                                  .RemainingArgs()               // planes (format order), then the grid table
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [n, T, rows]
                                  .Attr<int64_t>("fmt")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("threads"));
