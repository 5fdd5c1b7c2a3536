// Few-row f32 matmuls that stream the weights once, for XLA:CPU through the typed FFI.
//
// y[i, t, n] = sum_k x[i or 0, t, k] * W_{ids[i]}[k, n]  for the n matrices ids[i] of W [E, K, N] (an id outside
// [0, E) gives zeros); the dense Linear is E = 1, ids = [0]. Routed slots sorted by expert (x [n, 1, K], one
// row per slot) read each expert once per run of equal ids.
//
// Why: XLA:CPU runs a [T, K] x [K, N] dot with T > 1 as an Eigen GEMM, which packs the weight matrix first;
// with the weights coming from memory (a decode step reads every weight once) an 8-row dot costs several times
// a 1-row one. Here the weights are read once, row by row (k outer, contiguous), and multiplied into the
// accumulators of up to 8 tokens at a time, which stay in L1 (a block of kBlock columns per token).
//
// Every output element is one chain of fused multiply-adds in ascending k, whatever T, the token's position in
// the batch, the column block or the thread: a row's result does not depend on the other rows (batching
// changes nothing, bit for bit). The column tail (N % lanes) runs as one masked vector; the vector paths
// (AVX-512, AVX2 + FMA) and the scalar build all use a single-rounding fma.
//
// Built by kernels/matmul/cpu_ffi.py on first use (c++ -O3 -march=native -std=c++17 -shared -fPIC).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }
#else
inline void prefetch(const float* p) { __builtin_prefetch(p); }
#endif

#if defined(__AVX512F__)
using V = __m512;
constexpr int kWidth = 16;
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vset(float a) { return _mm512_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
using Mask = __mmask16;
inline Mask vmask(int64_t m) { return static_cast<Mask>((1u << m) - 1); }  // the first m lanes, m < 16
inline V vload(const float* p, Mask k) { return _mm512_maskz_loadu_ps(k, p); }
inline void vstore(float* p, V v, Mask k) { _mm512_mask_storeu_ps(p, k, v); }
#elif defined(__AVX2__) && defined(__FMA__)
using V = __m256;
constexpr int kWidth = 8;
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vset(float a) { return _mm256_set1_ps(a); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
using Mask = __m256i;
inline Mask vmask(int64_t m) {  // the first m lanes, m < 8
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(m)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline V vload(const float* p, Mask k) { return _mm256_maskload_ps(p, k); }
inline void vstore(float* p, V v, Mask k) { _mm256_maskstore_ps(p, k, v); }
#else
using V = float;
constexpr int kWidth = 1;
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V v) { *p = v; }
inline V vset(float a) { return a; }
inline V vfma(V a, V b, V c) { return std::fma(a, b, c); }
using Mask = bool;  // kWidth 1: never a partial vector
inline Mask vmask(int64_t m) { return m > 0; }
inline V vload(const float* p, Mask k) { return k ? *p : 0.0f; }
inline void vstore(float* p, V v, Mask k) { if (k) *p = v; }
#endif

#ifndef GLM53_AHEAD
#define GLM53_AHEAD 8
#endif
constexpr int64_t kAhead = GLM53_AHEAD;  // weight rows prefetched ahead of the ones being multiplied (see below)
constexpr int64_t kBlock = 256;        // columns per work item: 8 tokens' accumulators = 8 KiB
constexpr int64_t kTokens = 8;         // tokens per pass over a column block
constexpr int64_t kParallel = 1 << 20; // weights (elements) of a call below which it runs on the caller alone

// y[t * N + n] for TN tokens x[t * K + k] and columns [n0, n1) of w [K, N]: k ascending, 4 rows at a time.
template <int TN>
void block(const float* x, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1, float* y) {
  for (int t = 0; t < TN; ++t) std::memset(y + t * N + n0, 0, (n1 - n0) * sizeof(float));
  const int64_t nv = n0 + (n1 - n0) / kWidth * kWidth;
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* w0 = w + k * N;
    V xs[TN][4];
    for (int t = 0; t < TN; ++t)
      for (int j = 0; j < 4; ++j) xs[t][j] = vset(x[t * K + k + j]);
    const float* ahead = w + std::min(k + kAhead, K - 4) * N;  // rows kAhead further on (the last 4 at the end)
    for (int64_t n = n0; n < nv; n += kWidth) {
      const V a = vload(w0 + n), b = vload(w0 + N + n), c = vload(w0 + 2 * N + n), d = vload(w0 + 3 * N + n);
      if (n % 16 == 0)
        for (int j = 0; j < 4; ++j) prefetch(ahead + j * N + n);
      for (int t = 0; t < TN; ++t) {
        V acc = vload(y + t * N + n);
        acc = vfma(a, xs[t][0], acc);
        acc = vfma(b, xs[t][1], acc);
        acc = vfma(c, xs[t][2], acc);
        acc = vfma(d, xs[t][3], acc);
        vstore(y + t * N + n, acc);
      }
    }
    if (nv < n1) {  // the last n1 - nv < kWidth columns: masked loads and stores
      const Mask m = vmask(n1 - nv);
      const V a = vload(w0 + nv, m), b = vload(w0 + N + nv, m), c = vload(w0 + 2 * N + nv, m),
              d = vload(w0 + 3 * N + nv, m);
      for (int t = 0; t < TN; ++t) {
        V acc = vload(y + t * N + nv, m);
        acc = vfma(a, xs[t][0], acc);
        acc = vfma(b, xs[t][1], acc);
        acc = vfma(c, xs[t][2], acc);
        acc = vfma(d, xs[t][3], acc);
        vstore(y + t * N + nv, acc, m);
      }
    }
  }
  for (; k < K; ++k) {
    const float* w0 = w + k * N;
    for (int64_t n = n0; n < nv; n += kWidth) {
      const V a = vload(w0 + n);
      for (int t = 0; t < TN; ++t) vstore(y + t * N + n, vfma(a, vset(x[t * K + k]), vload(y + t * N + n)));
    }
    if (nv < n1) {
      const Mask m = vmask(n1 - nv);
      const V a = vload(w0 + nv, m);
      for (int t = 0; t < TN; ++t) vstore(y + t * N + nv, vfma(a, vset(x[t * K + k]), vload(y + t * N + nv, m)), m);
    }
  }
}

void tokens(const float* x, int64_t T, int64_t K, const float* w, int64_t N, int64_t n0, int64_t n1, float* y) {
  for (int64_t t0 = 0; t0 < T; t0 += kTokens) {
    const float* xt = x + t0 * K;
    float* yt = y + t0 * N;
    switch (std::min(kTokens, T - t0)) {
      case 1: block<1>(xt, K, w, N, n0, n1, yt); break;
      case 2: block<2>(xt, K, w, N, n0, n1, yt); break;
      case 3: block<3>(xt, K, w, N, n0, n1, yt); break;
      case 4: block<4>(xt, K, w, N, n0, n1, yt); break;
      case 5: block<5>(xt, K, w, N, n0, n1, yt); break;
      case 6: block<6>(xt, K, w, N, n0, n1, yt); break;
      case 7: block<7>(xt, K, w, N, n0, n1, yt); break;
      default: block<8>(xt, K, w, N, n0, n1, yt); break;
    }
  }
}

ffi::Error RowMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y, int64_t threads) {
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  const int64_t n = ids.element_count();
  if (xd.size() != 3 || wd.size() != 3 || yd.size() != 3)
    return ffi::Error::InvalidArgument("glm53_rowmm: x [1 or n, T, K], w [E, K, N], y [n, T, N] expected");
  const int64_t T = xd[1], K = xd[2], E = wd[0], N = wd[2];
  if (wd[1] != K || yd[0] != n || yd[1] != T || yd[2] != N || (xd[0] != 1 && xd[0] != n))
    return ffi::Error::InvalidArgument("glm53_rowmm: x [1 or n, T, K] / w [E, K, N] / y [n, T, N] mismatch");
  const int32_t* id = ids.typed_data();
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Units of work: the ids i0 .. i1 - 1 of one matrix. With x per id and T = 1 (one row per id, routed
  // slots sorted by expert), a run of equal consecutive ids is one unit whose rows x[i0 .. i1) are contiguous,
  // so the matrix is read once for the whole run; otherwise every id is a unit of its own.
  const bool runs = xd[0] == n && n > 1 && T == 1;
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i)
    if (!runs || i == 0 || id[i] != id[i - 1]) starts.push_back(i);
  starts.push_back(n);
  const int64_t units = static_cast<int64_t>(starts.size()) - 1;
  const int64_t blocks = (N + kBlock - 1) / kBlock;
  auto item = [&](int64_t it) {
    const int64_t u = it / blocks, n0 = (it % blocks) * kBlock, n1 = std::min(N, n0 + kBlock);
    const int64_t i0 = starts[u], i1 = starts[u + 1];
    const int64_t rows = runs ? i1 - i0 : T;
    float* out = yp + i0 * T * N;
    const int32_t e = id[i0];
    if (e < 0 || e >= E) {
      for (int64_t t = 0; t < rows; ++t) std::memset(out + t * N + n0, 0, (n1 - n0) * sizeof(float));
      return;
    }
    tokens(xp + (xd[0] == 1 ? 0 : i0) * T * K, rows, K, wp + e * K * N, N, n0, n1, out);
  };
  const int64_t items = units * blocks;
  if (threads <= 1 || n * K * N < kParallel) {
    for (int64_t it = 0; it < items; ++it) item(it);
  } else {
    glm53::pool(static_cast<int>(threads)).run(items, item);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Glm53RowMatmul, RowMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [1 or n, T, K]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [n]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [E, K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [n, T, N]
                                  .Attr<int64_t>("threads"));
