// Skinny linear layers (a decode step: M <= 8 rows) that stream the weight at memory speed.
//
// A decode step at batch 1 reads every weight once and does 2 FLOPs per weight, so its
// linear layers are bound by how fast the weight streams from DRAM. oneDNN's prepacked GEMM
// (blocked for ~64 rows) reads a one-row product at well under the machine's bandwidth;
// this kernel walks the weight once, front to back, per thread, and does all M rows'
// multiply-adds on each weight vector while it is in registers.
//
// Weight layout, shared with csrc/int8_linear_cpu.cpp ("pair tiles"):
//   w (N/16, K/2, 16, 2): tiles of 16 output channels, stored k-pair by k-pair:
//   w[t, p, j, e] = W[16 t + j, 2 p + e]. A tile is one contiguous run of 32 K elements.
// Element types: float32, bfloat16 (full-precision layers) or int8 (weight-only int8).
//
// Per (tile, pair), the 32 elements become four 8-lane float vectors, each 4 channels x
// the 2 k of the pair; multiplied by the broadcast pair (x[m, 2p], x[m, 2p+1]) x 4 they
// accumulate per (channel, k parity); one horizontal add per channel pair at the end.
// Register tile: MT rows x 4 vectors (x U pairs in flight for M = 1, so 8 independent
// accumulation chains hide the FMA latency).
//
// x may have any leading dimensions (..., K); y is (..., N).
//
// Arithmetic (float32 multiply-adds, only the summation order differs from torch):
//   gemv_dense: y = x W^T (+ bias), float32 sums, rounded once to x's dtype.
//   gemv_int8:  y = float(bf16( bf16(x) q^T )) * scale (+ bias), float32: the arithmetic of
//               pagedserve/quantization/int8.py (int8 and bf16 values multiply exactly in
//               float32); the epilogue's multiply and add stay separate (built with
//               -ffp-contract=off) so they round as torch's do.
// AVX2 + FMA only, so one build serves every x86 CPU of the last decade; AVX-512 would not
// help a loop bound by memory bandwidth.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "pagedserve_common.h"

namespace {

constexpr int kTile = 16;          // output channels per tile
constexpr int64_t kMaxRows = 8;    // the op refuses more (larger batches: the GEMM path)

#if defined(PAGEDSERVE_AVX2)

// Loaders: the 8 elements (p, 8 v .. 8 v + 7) of a tile as floats, v in 0..3.
struct LoadF32 {
  const float* w;
  inline __m256 operator()(int64_t p, int v) const { return _mm256_loadu_ps(w + p * 32 + v * 8); }
};
struct LoadBF16 {
  const uint16_t* w;
  inline __m256 operator()(int64_t p, int v) const {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 32 + v * 8));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
struct LoadI8 {
  const int8_t* w;
  inline __m256 operator()(int64_t p, int v) const {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + p * 32 + v * 8));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
};

// (c0k0, c0k1, c1k0, c1k1 | c2.., c3..) and the same for channels 4..7 -> c0..c7.
inline __m256 fold_pairs(__m256 a, __m256 b) {
  __m256 h = _mm256_hadd_ps(a, b);  // c0 c1 c4 c5 | c2 c3 c6 c7
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

// MT rows of x (float32, rows `ldx` apart) times one tile: out[i * 16 + j], float32 sums.
template <int MT, int U, class Load>
inline void tile_dot(const float* x, int64_t ldx, int64_t pairs, const Load& load, float* out) {
  __m256 acc[U][MT][4];
  for (int u = 0; u < U; ++u)
    for (int i = 0; i < MT; ++i)
      for (int v = 0; v < 4; ++v) acc[u][i][v] = _mm256_setzero_ps();
  auto step = [&](int u, int64_t p) {
    __m256 xb[MT];
    for (int i = 0; i < MT; ++i)
      xb[i] = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x + i * ldx + 2 * p)));
    for (int v = 0; v < 4; ++v) {
      __m256 w = load(p, v);
      for (int i = 0; i < MT; ++i) acc[u][i][v] = _mm256_fmadd_ps(w, xb[i], acc[u][i][v]);
    }
  };
  int64_t p = 0;
  for (; p + U <= pairs; p += U)
    for (int u = 0; u < U; ++u) step(u, p + u);
  for (; p < pairs; ++p) step(0, p);
  for (int i = 0; i < MT; ++i) {
    for (int v = 0; v < 4; ++v)
      for (int u = 1; u < U; ++u) acc[0][i][v] = _mm256_add_ps(acc[0][i][v], acc[u][i][v]);
    _mm256_storeu_ps(out + i * kTile, fold_pairs(acc[0][i][0], acc[0][i][1]));
    _mm256_storeu_ps(out + i * kTile + 8, fold_pairs(acc[0][i][2], acc[0][i][3]));
  }
}

// All M rows times tile `t`: sums[m * 16 + j] for channels 16 t + j.
template <class Load>
inline void tile_all_rows(const float* x, int64_t M, int64_t K, const Load& load, float* sums) {
  const int64_t pairs = K / 2;
  if (M == 1) return tile_dot<1, 2>(x, K, pairs, load, sums);
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) tile_dot<3, 1>(x + m * K, K, pairs, load, sums + m * kTile);
  if (M - m == 2) tile_dot<2, 1>(x + m * K, K, pairs, load, sums + m * kTile);
  if (M - m == 1) tile_dot<1, 2>(x + m * K, K, pairs, load, sums + m * kTile);
}

// Runs `body(t, sums)` for every tile, tiles split across threads in contiguous ranges
// (each thread streams one run of the weight); chunks of at least ~32 KiB of weight.
template <class Body>
void for_tiles(int64_t tiles, int64_t tile_bytes, int64_t M, Body body) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{32} << 10) / std::max<int64_t>(1, tile_bytes));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    float sums[kMaxRows * kTile];
    for (int64_t t = t0; t < t1; ++t) body(t, sums);
  });
  (void)M;
}

// x (M, K) in float32; bf16 inputs widen (and int8 rounds fp32 inputs to bf16) first.
at::Tensor x_as_float(const at::Tensor& x, bool round_to_bf16) {
  if (x.scalar_type() == at::kFloat && !round_to_bf16) return x;
  if (x.scalar_type() == at::kFloat) return x.to(at::kBFloat16).to(at::kFloat);
  return x.to(at::kFloat);
}

template <class Load, class Elem>
void dense_impl(const at::Tensor& xf, const Elem* w, int64_t tiles, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = xf.size(0), K = xf.size(1), N = tiles * kTile;
  const float* xd = xf.data_ptr<float>();
  at::Tensor bf = bias.defined() ? bias.to(at::kFloat).contiguous() : bias;
  const float* bd = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const bool out_bf16 = y.scalar_type() == at::kBFloat16;
  float* yf = out_bf16 ? nullptr : y.data_ptr<float>();
  auto* yb = out_bf16 ? reinterpret_cast<c10::BFloat16*>(y.data_ptr()) : nullptr;
  const int64_t tile_elems = K * kTile;
  for_tiles(tiles, tile_elems * static_cast<int64_t>(sizeof(Elem)), M, [&](int64_t t, float* sums) {
    tile_all_rows(xd, M, K, Load{w + t * tile_elems}, sums);
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < kTile; ++j) {
        const int64_t n = t * kTile + j;
        float v = sums[m * kTile + j];
        if (bd) v += bd[n];
        if (out_bf16) yb[m * N + n] = c10::BFloat16(v);
        else yf[m * N + n] = v;
      }
  });
}

#endif  // PAGEDSERVE_AVX2

// x (..., K) as a contiguous (M, K) matrix (a view when it already is one): the reshape
// happens here, not as Python ops around every call.
at::Tensor rows_view(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() >= 1, op, ": x must have a last (K) dimension");
  at::Tensor x2 = x.reshape({-1, x.size(-1)}).contiguous();
  TORCH_CHECK(x2.size(0) <= kMaxRows, op, ": at most ", kMaxRows, " rows, got ", x2.size(0));
  return x2;
}

// y's shape: x's, with the last dimension N.
std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return shape;
}

void check_common(const at::Tensor& x, const at::Tensor& w, const char* op) {
  TORCH_CHECK(w.dim() == 4 && w.is_contiguous() && w.size(1) * 2 == x.size(1) && w.size(2) == kTile &&
                  w.size(3) == 2,
              op, ": w must be contiguous pair tiles (N/16, K/2, 16, 2) with K = x.size(1)");
}

at::Tensor gemv_dense(const at::Tensor& x_in, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const at::Tensor x = rows_view(x_in, "gemv_dense");
  check_common(x, w, "gemv_dense");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gemv_dense: x must be float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "gemv_dense: w must be float32 or bfloat16");
  const int64_t N = w.size(0) * kTile;
  at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || b.numel() == N, "gemv_dense: bias must have N elements");
  at::Tensor y = at::empty(out_shape(x_in, N), x.options());
#if defined(PAGEDSERVE_AVX2)
  if (x.size(0) == 0) return y;
  at::Tensor xf = x_as_float(x, false).contiguous();
  if (w.scalar_type() == at::kFloat)
    dense_impl<LoadF32>(xf, w.data_ptr<float>(), w.size(0), b, y);
  else
    dense_impl<LoadBF16>(xf, reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(0), b, y);
#else
  TORCH_CHECK(false, "gemv_dense: this build has no AVX2/FMA support");
#endif
  return y;
}

at::Tensor gemv_int8(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scale,
                     const c10::optional<at::Tensor>& bias) {
  const at::Tensor x = rows_view(x_in, "gemv_int8");
  check_common(x, w, "gemv_int8");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "gemv_int8: x must be float32 or bfloat16");
  TORCH_CHECK(w.scalar_type() == at::kChar, "gemv_int8: w must be int8");
  const int64_t N = w.size(0) * kTile;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "gemv_int8: scale must be (N,) float32");
  at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == N),
              "gemv_int8: bias must be (N,) float32");
  at::Tensor y = at::empty(out_shape(x_in, N), x.options().dtype(at::kFloat));
#if defined(PAGEDSERVE_AVX2)
  const int64_t M = x.size(0), K = x.size(1), tiles = w.size(0);
  if (M == 0) return y;
  at::Tensor xf = x_as_float(x, true).contiguous();
  const float* xd = xf.data_ptr<float>();
  const int8_t* wd = w.data_ptr<int8_t>();
  const float* sd = scale.data_ptr<float>();
  const float* bd = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  for_tiles(tiles, K * kTile, M, [&](int64_t t, float* sums) {
    tile_all_rows(xd, M, K, LoadI8{wd + t * K * kTile}, sums);
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < kTile; ++j) {
        const int64_t n = t * kTile + j;
        float v = static_cast<float>(c10::BFloat16(sums[m * kTile + j])) * sd[n];
        if (bd) v = v + bd[n];
        yd[m * N + n] = v;
      }
  });
#else
  TORCH_CHECK(false, "gemv_int8: this build has no AVX2/FMA support");
#endif
  return y;
}

bool available() {
#if defined(PAGEDSERVE_AVX2)
  return true;
#else
  return false;
#endif
}

int64_t max_rows() { return kMaxRows; }

}  // namespace

TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m) {
  m.def("gemv_dense(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("gemv_int8(Tensor x, Tensor w, Tensor scale, Tensor? bias) -> Tensor");
  m.def("available() -> bool", &available);
  m.def("max_rows() -> int", &max_rows);
  m.impl("gemv_dense", c10::DispatchKey::CPU, &gemv_dense);
  m.impl("gemv_int8", c10::DispatchKey::CPU, &gemv_int8);
}
