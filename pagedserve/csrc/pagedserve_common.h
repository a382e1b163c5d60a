// What the CPU kernels share: ISA detection, bfloat16 <-> float32 conversion (scalar and
// vector), horizontal sums, the SIMD structs kernels are templated over (VecScalar, Vec256,
// Vec512, VecBest), and how many OpenMP threads a parallel region gets.
//
// ISA: the sources compile with -march=native (pagedserve/cpp_build.py), so the compiler's
// macros say what this machine runs. One name per level, used by every kernel:
//
//     PAGEDSERVE_AVX512       AVX-512F                    16 floats per vector
//     PAGEDSERVE_AVX2         AVX2 + FMA                   8 floats per vector
//     PAGEDSERVE_AVX512BF16   AVX-512 BF16 + BW            vdpbf16ps (int8 linear)
//     (none)                  scalar code only
//
// A variant build (`cpp_build.load(kernel, ("-mno-avx512f",), namespace=...)`) turns a level
// off, so the AVX2 path of a kernel can be tested on an AVX-512 machine.
//
// Op namespace: every source registers TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m); the loader
// defines the macro (the kernel's default namespace, or a variant's own), so several builds of
// one source load into one process.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#if defined(__AVX512F__)
#define PAGEDSERVE_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PAGEDSERVE_AVX2 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_AVX512BF16 1
#endif
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)
#include <immintrin.h>
#endif

#ifndef PAGEDSERVE_OPS_NAMESPACE
#error "PAGEDSERVE_OPS_NAMESPACE must be defined (pagedserve/cpp_build.py defines it)"
#endif

namespace pagedserve {

using bf16 = c10::BFloat16;

// The widest SIMD level of this build: "avx512", "avx2" or "scalar" (each op library's isa()).
inline std::string isa_name() {
#if defined(PAGEDSERVE_AVX512)
  return "avx512";
#elif defined(PAGEDSERVE_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

// ---- scalar conversions --------------------------------------------------------------------

inline float to_f(float v) { return v; }
inline float to_f(bf16 v) { return static_cast<float>(v); }
template <class T>
inline T from_f(float v) { return static_cast<T>(v); }

// ---- vector bfloat16: widening is a 16-bit left shift; narrowing rounds to nearest even ----

#if defined(PAGEDSERVE_AVX2)
inline __m256 widen_bf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load_bf16x8(const bf16* p) {
  return widen_bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// v's bits plus the round-to-nearest-even increment: the bf16 value is the high 16 bits.
inline __m256i bf16_rounding_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
}
// v rounded to bfloat16, kept in float32 lanes (a bf16 step inside a float computation).
inline __m256 round_bf16x8(__m256 v) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(bf16_rounding_bits(v), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store_bf16x8(bf16* p, __m256 v) {  // values fit 16 bits after the shift
  const __m256i b = _mm256_srli_epi32(bf16_rounding_bits(v), 16);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), h);
}
// Cephes-style expf on 8 lanes: |rel err| ~ 2e-7 on x <= 0; inputs below -87.3 flush to
// ~1e-38 (paged attention's softmax, fused SiLU).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.3762626f));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
  return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
// out[i] = horizontal sum of a[i], i < 8: 6 hadds and 2 permutes instead of 8 hsums.
inline __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
  return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
}
#endif

#if defined(PAGEDSERVE_AVX512)
inline __m512 widen_bf16x16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_bf16x16(const bf16* p) {
  return widen_bf16x16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_bf16x16(bf16* p, __m512 v) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
#else
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
#endif
}
// out[i] = horizontal sum of a[i], i < 16: 15 unpack/shuffle + 15 adds instead of 16 hsums.
inline __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d p = _mm512_castps_pd(x[2 * i]), q = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(p, q)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(p, q)));
  }
  // y[i], 128-bit lane L, element e: lane-L partial sum of a[4i + e]; add the 4 lanes.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}
#endif

// ---- SIMD layer: one struct per ISA with the same static interface --------------------------
//
// Kernels are templates over V (VecScalar, Vec256, Vec512; VecBest is the widest this build
// runs): V::W floats per register V::R, loads and stores of float and bf16 (masked tails with
// load_n), fma / fnma, min / max / floor, exp (Cephes-style), horizontal sums, and reduce(a):
// out[i] = hsum of a[i] for W registers. kUnroll: independent accumulator chains a dot-product
// loop keeps so that FMA latency hides (32 registers on AVX-512, 16 on AVX2).

struct VecScalar {  // portable fallback (also used where a length is not a multiple of W)
  static constexpr int W = 1, kUnroll = 4;
  using R = float;
  static R zero() { return 0.f; }
  static R set1(float x) { return x; }
  static R load(const float* p) { return *p; }
  static R load(const bf16* p) { return static_cast<float>(*p); }
  template <class T>
  static R load_n(const T* p, int n) { return n > 0 ? load(p) : 0.f; }
  static void store(float* p, R v) { *p = v; }
  static void store(bf16* p, R v) { *p = static_cast<bf16>(v); }
  static R fma(R a, R b, R c) { return a * b + c; }
  static R mul(R a, R b) { return a * b; }
  static R add(R a, R b) { return a + b; }
  static R sub(R a, R b) { return a - b; }
  static R max_(R a, R b) { return std::max(a, b); }
  static R exp(R x) { return std::exp(x); }
  static R reduce(const R* acc) { return acc[0]; }
  static float hsum(R v) { return v; }
  static float hmax(R v) { return v; }
  static void prefetch(const void*) {}
};

#if defined(PAGEDSERVE_AVX512)
struct Vec512 {
  static constexpr int W = 16, kUnroll = 4;  // 32 registers: 4 x 4 accumulators + loads
  using R = __m512;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static R widen(__m256i h) { return widen_bf16x16(h); }
  static R load(const bf16* p) { return load_bf16x16(p); }
  static R load_n(const float* p, int n) { return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p); }
  static R load_n(const bf16* p, int n) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return widen(_mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p));
#else
    alignas(32) bf16 tmp[16] = {};
    std::memcpy(tmp, p, sizeof(bf16) * n);
    return load(tmp);
#endif
  }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static void store(bf16* p, R v) { store_bf16x16(p, v); }  // nearest even
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R fnma(R a, R b, R c) { return _mm512_fnmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R min_(R a, R b) { return _mm512_min_ps(a, b); }
  static R max_(R a, R b) { return _mm512_max_ps(a, b); }
  static R floor_(R a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static R pow2i(R n) {
    __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  // exp8's Cephes steps at AVX-512's width: |rel err| ~ 2e-7 on x <= 0; inputs below -87.3
  // flush to ~1e-38.
  static R exp(R x) {
    x = min_(max_(x, set1(-87.3365f)), set1(88.3762626f));
    R fx = floor_(fma(x, set1(1.44269504f), set1(0.5f)));
    x = fnma(fx, set1(0.693359375f), x);
    x = fnma(fx, set1(-2.12194440e-4f), x);
    R y = set1(1.9875691500e-4f);
    y = fma(y, x, set1(1.3981999507e-3f));
    y = fma(y, x, set1(8.3334519073e-3f));
    y = fma(y, x, set1(4.1665795894e-2f));
    y = fma(y, x, set1(1.6666665459e-1f));
    y = fma(y, x, set1(5.0000001201e-1f));
    y = fma(y, mul(x, x), add(x, set1(1.f)));
    return mul(y, pow2i(fx));
  }
  static float hsum(R v) { return _mm512_reduce_add_ps(v); }
  static float hmax(R v) { return _mm512_reduce_max_ps(v); }
  static R reduce(const R* a) { return reduce16(a); }  // out[i] = hsum of a[i]
  // Into L2 (T1): T0 measured 2x slower in attention, the next tile evicting the current one from L1.
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};
#endif

#if defined(PAGEDSERVE_AVX2)
struct Vec256 {
  static constexpr int W = 8, kUnroll = 2;  // 16 registers: 4 x 2 accumulators + loads
  using R = __m256;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static R load(const bf16* p) { return load_bf16x8(p); }
  static R load_n(const float* p, int n) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(p, mask);
  }
  static R load_n(const bf16* p, int n) {
    alignas(16) bf16 tmp[8] = {};
    std::memcpy(tmp, p, sizeof(bf16) * n);
    return load(tmp);
  }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static void store(bf16* p, R v) { store_bf16x8(p, v); }  // nearest even
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R fnma(R a, R b, R c) { return _mm256_fnmadd_ps(a, b, c); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R min_(R a, R b) { return _mm256_min_ps(a, b); }
  static R max_(R a, R b) { return _mm256_max_ps(a, b); }
  static R floor_(R a) { return _mm256_floor_ps(a); }
  static R pow2i(R n) {
    __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  static R exp(R x) { return exp8(x); }
  static float hsum(R v) { return hsum8(v); }
  static float hmax(R v) { return hmax8(v); }
  static R reduce(const R* a) { return reduce8(a); }  // out[i] = hsum of a[i]
  static void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
};
#endif

#if defined(PAGEDSERVE_AVX512)
using VecBest = Vec512;
#elif defined(PAGEDSERVE_AVX2)
using VecBest = Vec256;
#else
using VecBest = VecScalar;
#endif

// ---- elementwise helpers (the fused ops and the GEMV kernel's fused MoE share them) ---------

// exp(x) for float32, branch-free so loops over it vectorize: 2^n * p(r), r in [-ln2/2, ln2/2],
// a degree-6 polynomial (Cephes' expf coefficients), ~1 ulp; inputs clamped to the finite range.
inline float exp_f(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);  // vminps / vmaxps
  // Round to nearest by the 1.5 * 2^23 trick (|x * log2 e| < 2^22 here): vectorizes, where
  // std::nearbyint is a libm call.
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r) + 1.f;
  int32_t bits;
  std::memcpy(&bits, &p, 4);
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

#if defined(PAGEDSERVE_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) { return load_bf16x8(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16* p, __m256 v) { store_bf16x8(p, v); }
// v rounded to T's precision, kept as float (the T(...) of a formula).
inline __m256 round_to(float, __m256 v) { return v; }
inline __m256 round_to(bf16, __m256 v) { return round_bf16x8(v); }
#endif


// out[i] = T(T(silu(gate[i])) * up[i]) for i < n: transformers' act_fn(gate) * up in dtype T.
template <class T>
inline void silu_mul_row(const T* gate, const T* up, T* out, int64_t n) {
  int64_t i = 0;
#if defined(PAGEDSERVE_AVX2)
  for (; i + 8 <= n; i += 8) {
    const __m256 g = load8(gate + i);
    // The vector exp is paged attention's (the loop around the scalar exp_f below did not
    // vectorize: 8 rows of SmolLM2's SiLU took 50-90 us); the tail keeps exp_f.
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 act = round_to(T{}, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
    store8(out + i, _mm256_mul_ps(act, load8(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = to_f(gate[i]);
    const float act = to_f(from_f<T>(g / (1.f + exp_f(-g))));
    out[i] = from_f<T>(act * to_f(up[i]));
  }
}

// ---- OpenMP chunking -----------------------------------------------------------------------

// Threads for a parallel region of `tasks` independent tasks holding `work` units in all:
// never more than torch's thread count or the tasks, and, with `min_work_per_thread` > 0,
// one fewer thread per missing share of work (waking a thread costs ~2 us, so a small call
// runs on fewer threads; 1 means run inline).
inline int region_threads(int64_t tasks, int64_t work = 0, int64_t min_work_per_thread = 0) {
  int64_t threads = std::min<int64_t>(at::get_num_threads(), tasks);
  if (min_work_per_thread > 0) threads = std::min(threads, std::max<int64_t>(1, work / min_work_per_thread));
  return int(std::max<int64_t>(threads, 1));
}

// at::parallel_for grain for rows of `cols` elements: ~64 KB of work per chunk, so a decode's
// few rows stay on one thread.
inline int64_t grain_rows(int64_t cols) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1)); }

}  // namespace pagedserve
