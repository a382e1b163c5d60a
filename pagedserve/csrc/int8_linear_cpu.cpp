// Weight-only int8 linear for CPUs with AVX512-BF16:
//
//     y[m, n] = float(bf16( sum_k bf16(x[m, k]) * q[n, k] )) * scale[n]  (+ bias[n])
//
// the arithmetic pagedserve/quantization/int8.py defines: int8 values are exact in bf16, the
// products are summed in float32 (vdpbf16ps), the sum is rounded to bf16 once, then scaled in
// float32. The same numbers torch's `_weight_int8pack_mm` gives, at any batch size, but:
//   * it reads the int8 weight once per block of rows (decode batches are memory-bound: a
//     quarter of the fp32 bytes), and
//   * it multiplies in bf16 pairs, twice the multiply-adds per instruction of fp32 FMA, so a
//     prefill is not slower than fp32 either.
//
// Layouts:
//   x       (M, K) bfloat16, contiguous, K even (read as dwords = pairs (x[m,2p], x[m,2p+1]))
//   packed  (N/16, K/2, 16, 2) int8 = q viewed as tiles of 16 output channels, each tile
//           stored k-pair by k-pair: packed[t, p, j, e] = q[16 t + j, 2 p + e]; 32 bytes per
//           (tile, pair) become one bf16 vector of 16 pairs, the operand vdpbf16ps wants.
//   scale   (N,) float32; bias (N,) float32 or empty
//   y       (M, N) float32
//
// Per thread: a range of groups of NT = 3 tiles (48 output channels). For each block of up
// to kRowBlock rows the group's weights are converted int8 -> bf16 once into a thread-local
// buffer (K/2 x 48 dwords, L2-resident), then every MT = 8 row tile runs an 8 x 48 register
// tile over it: per k-pair 3 weight loads, 8 broadcasts, 24 vdpbf16ps.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "pagedserve_common.h"

namespace {

constexpr int kTile = 16;       // output channels per packed tile (one zmm of fp32)
constexpr int kGroup = 3;       // tiles per register tile (NT)
constexpr int kRows = 8;        // rows per register tile (MT)
constexpr int64_t kRowBlock = 128;  // rows sharing one conversion of a group's weights
constexpr int64_t kDirectRows = 4;  // up to this many rows, convert in registers (no buffer)

#if defined(PAGEDSERVE_AVX512BF16)

// Converts tiles [t0, t0 + nt) of the packed int8 weight to bf16 pairs in `buf`, laid out
// [pair][tile][16 dwords] so the micro-kernel reads nt consecutive vectors per k-pair.
template <int MT, int NT>
inline void store_tile(__m512 (&acc)[MT][NT], float* y, int64_t y_stride, const float* scale,
                       const float* bias) {
  for (int j = 0; j < NT; ++j) {
    __m512 s = _mm512_loadu_ps(scale + j * kTile);
    __m512 b = bias ? _mm512_loadu_ps(bias + j * kTile) : _mm512_setzero_ps();
    for (int i = 0; i < MT; ++i) {
      // Round the float32 sum to bf16 (nearest-even, like torch) and widen it back.
      __m256bh r = _mm512_cvtneps_pbh(acc[i][j]);
      __m512 v = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i&>(r)), 16));
      // Scale, then add the bias, each rounded (no FMA): the same float32 steps as torch.
      constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      v = _mm512_mul_round_ps(v, s, kRne);
      if (bias) v = _mm512_add_round_ps(v, b, kRne);
      _mm512_storeu_ps(y + i * y_stride + j * kTile, v);
    }
  }
}

// 32 int8 = 16 channels x one k-pair -> the bf16 vector vdpbf16ps multiplies (exact).
inline __m512bh to_bf16(const int8_t* src) {
  __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
  __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo));
  __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi));
  // The low 16 bf16 come from the second operand: element order is kept.
  return _mm512_cvtne2ps_pbh(fhi, flo);
}

void convert_group(const int8_t* packed, int64_t pairs, int64_t t0, int nt, __m512bh* buf) {
  for (int j = 0; j < nt; ++j) {
    const int8_t* src = packed + (t0 + j) * pairs * 32;
    for (int64_t p = 0; p < pairs; ++p) buf[p * kGroup + j] = to_bf16(src + p * 32);
  }
}

// An MT x (NT x 16) register tile over all k-pairs; x rows are `pairs` dwords apart and
// weight(p, j) gives tile j's bf16 vector of pair p (from the converted buffer, or converted
// in registers).
template <int MT, int NT, class Weight>
inline void tile_kernel(const uint32_t* x, int64_t pairs, Weight weight, float* y, int64_t y_stride,
                        const float* scale, const float* bias) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[NT];
    for (int j = 0; j < NT; ++j) wv[j] = weight(p, j);
    for (int i = 0; i < MT; ++i) {
      __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * pairs + p]));
      for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  store_tile<MT, NT>(acc, y, y_stride, scale, bias);
}

// tile_kernel for a run-time tile shape: mt rows (1 .. kRows), nt tiles (1 .. kGroup).
template <class Weight>
void run_tile(int mt, int nt, const uint32_t* x, int64_t pairs, Weight weight, float* y,
              int64_t y_stride, const float* scale, const float* bias) {
  auto with_nt = [&](auto nt_c) {
    constexpr int NT = decltype(nt_c)::value;
    switch (mt) {
#define PAGEDSERVE_CASE(R) \
  case R:                  \
    return tile_kernel<R, NT>(x, pairs, weight, y, y_stride, scale, bias);
      PAGEDSERVE_CASE(1)
      PAGEDSERVE_CASE(2)
      PAGEDSERVE_CASE(3)
      PAGEDSERVE_CASE(4)
      PAGEDSERVE_CASE(5)
      PAGEDSERVE_CASE(6)
      PAGEDSERVE_CASE(7)
      PAGEDSERVE_CASE(8)
#undef PAGEDSERVE_CASE
    }
  };
  if (nt == 3) with_nt(std::integral_constant<int, 3>{});
  else if (nt == 2) with_nt(std::integral_constant<int, 2>{});
  else with_nt(std::integral_constant<int, 1>{});
}

void linear_impl(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                 const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = x.size(0), pairs = x.size(1) / 2, tiles = packed.size(0);
  const auto* xd = reinterpret_cast<const uint32_t*>(x.data_ptr());
  const int8_t* wd = packed.data_ptr<int8_t>();
  const float* sd = scale.data_ptr<float>();
  const float* bd = bias.defined() && bias.numel() ? bias.data_ptr<float>() : nullptr;
  float* yd = y.data_ptr<float>();
  const int64_t N = tiles * kTile;
  const int64_t groups = (tiles + kGroup - 1) / kGroup;
  // Threads only pay off when each has a few groups' worth of multiply-adds.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, M * pairs * 96));
  if (M <= kDirectRows) {  // few rows: converting in registers beats a trip through a buffer
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t t0 = g * kGroup, n0 = t0 * kTile;
        const int nt = static_cast<int>(std::min<int64_t>(kGroup, tiles - t0));
        const int8_t* w = wd + t0 * pairs * 32;
        auto weight = [&](int64_t p, int j) { return to_bf16(w + (j * pairs + p) * 32); };
        run_tile(static_cast<int>(M), nt, xd, pairs, weight, yd + n0, N, sd + n0, bd ? bd + n0 : nullptr);
      }
    });
    return;
  }
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    std::vector<__m512bh> buf(static_cast<size_t>(pairs * kGroup));
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t t0 = g * kGroup;
        const int nt = static_cast<int>(std::min<int64_t>(kGroup, tiles - t0));
        convert_group(wd, pairs, t0, nt, buf.data());
        const int64_t n0 = t0 * kTile;
        for (int64_t m = m0; m < m1; m += kRows) {
          const int mt = static_cast<int>(std::min<int64_t>(kRows, m1 - m));
          const __m512bh* w = buf.data();
          auto weight = [w](int64_t p, int j) { return w[p * kGroup + j]; };
          run_tile(mt, nt, xd + m * pairs, pairs, weight, yd + m * N + n0, N, sd + n0,
                   bd ? bd + n0 : nullptr);
        }
      }
    }
  });
}

#endif  // PAGEDSERVE_AVX512BF16

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int8_linear: x must be a contiguous (M, K) bfloat16 tensor");
  TORCH_CHECK(x.size(1) % 2 == 0, "int8_linear: K must be even, got ", x.size(1));
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) / 2 && packed.size(2) == kTile && packed.size(3) == 2,
              "int8_linear: packed must be (N/16, K/2, 16, 2) int8, contiguous");
  const int64_t N = packed.size(0) * kTile;
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "int8_linear: scale must be (N,) float32");
  at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  TORCH_CHECK(!b.defined() || (b.scalar_type() == at::kFloat && b.is_contiguous() && b.numel() == N),
              "int8_linear: bias must be (N,) float32");
  at::Tensor y = at::empty({x.size(0), N}, x.options().dtype(at::kFloat));
#if defined(PAGEDSERVE_AVX512BF16)
  if (x.size(0) > 0) linear_impl(x, packed, scale, b, y);
#else
  TORCH_CHECK(false, "int8_linear: this build has no AVX512-BF16 support");
#endif
  return y;
}

bool available() {
#if defined(PAGEDSERVE_AVX512BF16)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias) -> Tensor");
  m.def("available() -> bool", &available);
  m.impl("int8_linear", c10::DispatchKey::CPU, &int8_linear);
}
