// Skinny linear layers (decode steps: M <= 32 rows) that stream the weight at memory speed.
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
//
// Group-wise ops (a scale per `group` consecutive input columns of each output channel) use
// "channel tiles" instead: a vector holds 8 output channels at one k, so a group's partial sums
// need no horizontal add and its 16 scales are one contiguous load:
//   gemv_int8_grouped  q (N/16, K, 16) int8:  q[t, k, j] = Q[16 t + j, k]  (1 byte per weight)
//                      scale (N/16, K/group, 16) float16
//                      y = sum_g scale[n, g] * sum_{k in g} x[k] q[n, k]   (+ bias)
//                      or float32 (N/16, K/group, 2, 16) (s, l0), groups of 16 allowed: W = q s + l0 (a GGUF file's
//                      K-quants and Q5_1 repacked exactly, quantization/gguf_blocks.py), with
//                      y += l0 * sum_{k in g} x[k] per group as below
//   gemv_int4_grouped  q (N/16, K, 8) uint8: byte j of (t, k) = Q[16t+j, k] | Q[16t+8+j, k] << 4
//                      scales_zeros (N/16, K/group, 2, 16) bfloat16: [.., 0, j] scale, [.., 1, j] zero
//                      W = (Q - 8) * scale + zero (pagedserve's int4), or float16 (d, m):
//                      W = Q * d + m (a GGUF file's Q4_1 / Q4_0 blocks, exactly), or float32
//                      (s, l0): W = Q * s + l0 (Q4_K: s = d sc, l0 = -dmin m, exact). Per group
//                      (llama.cpp's Q4_1 trick), with level 0 = zero - 8 scale or m:
//                      y = sum_g scale * sum_k x q + level0 * sum_k x  (+ bias)
// Both: x float32 (bf16 widened), float32 products and sums (the weights' values exactly,
// only the summation order differs from x @ dequantized(W)^T), y rounded once to x's dtype.
//   gemv_int8_q8       q (N/16, K/4, 16, 4) int8 ("quad tiles"), scale as gemv_int8_grouped:
//                      x quantized per row and block of 32 to int8 (float32 scale absmax / 127),
//                      int8 x int8 dot products exact in int32 (llama.cpp's q8_0 x q8_0 on AVX2),
//                      y = sum_blocks float(dot) * (scale * d_x) (+ bias), rounded to x's dtype.
//   gemv_bits_q8       4 / 5 / 6-bit "bit quads" (a GGUF file's K-quants, Q5_0, Q5_1) x int8 x,
//                      any row count; gemv_bits_q8_parts: a fused layer in parts of different
//                      bits and parameter forms (one per run of shards of a type), x rounded once.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedserve_common.h"

namespace {

using pagedserve::bf16;

constexpr int kTile = 16;          // output channels per tile
// The op refuses more rows (larger steps: the GEMM path). Up to 32 rows one pass over the
// weight with the next-tile prefetch beat oneDNN's packed GEMM (float32, 1.6x at 16 rows) and
// the widened bf16 GEMM (3x) on the 125M model's layers; benchmarks/gemv_rows.py builds a
// variant with a higher limit (-DPAGEDSERVE_GEMV_MAX_ROWS=64) to find the crossover.
#ifndef PAGEDSERVE_GEMV_MAX_ROWS
#define PAGEDSERVE_GEMV_MAX_ROWS 32
#endif
constexpr int64_t kMaxRows = PAGEDSERVE_GEMV_MAX_ROWS;

// The three forms of super-block parameters (KParams, KPackedParams), told apart by their bytes
// per tile and super-block B: affine 80 + 32 G, centered 32 + 16 G, packed 256 (G = 8).
enum class SuperForm { kInvalid, kCentered, kAffine, kPacked };
struct SuperLayout {
  SuperForm form;
  int64_t groups;  // G, groups per super-block
};
constexpr int64_t kPackedSuperBytes = 256;  // KPackedParams' B (G = 8)
inline SuperLayout super_layout(int64_t B) {
  SuperLayout l{SuperForm::kInvalid, 0};
  if (B == kPackedSuperBytes) l = {SuperForm::kPacked, 8};
  else if (B >= 112 && (B - 80) % 32 == 0) l = {SuperForm::kAffine, (B - 80) / 32};
  else if (B >= 48 && (B - 32) % 16 == 0) l = {SuperForm::kCentered, (B - 32) / 16};
  if (l.groups <= 0 || l.groups > 16 || 256 % l.groups != 0) l = {SuperForm::kInvalid, 0};
  return l;
}

#if defined(PAGEDSERVE_AVX2)

using pagedserve::hmax8;
using pagedserve::hsum8;
using pagedserve::load_bf16x8;

// Fully unrolls the loop that follows. The register tiles (acc[u][i][v]) must be indexed by
// compile-time constants to live in registers; when GCC judged a kernel too large to unroll on
// its own it kept them on the stack, and every multiply-add waited on a store and a reload
// (a batch-1 bf16 tile ran at half the speed of the same loop in a small test program).
#define PAGEDSERVE_UNROLL _Pragma("GCC unroll 16")
// The same hazard one level up: a register block's helpers (the group's dot products, the fold,
// the group parameters) must inline into its loop, or their accumulators go through memory on
// every call. GCC left them out of line in this large file (objdump: `call quad_group512<4, 12,
// ...>` and a call to the fold per group), and the int8-activation K-quant kernel ran at ~half
// of what its loop does alone; FORCE_INLINE makes that the compiler's only choice, and
// NOINLINE keeps each register block's loop a function of its own, so the switch over block
// sizes that calls them does not grow past what the compiler will inline.
// `-DPAGEDSERVE_FORCE_INLINING=0` builds without (benchmarks/bits_q8_width.py --variant).
#ifndef PAGEDSERVE_FORCE_INLINING
#define PAGEDSERVE_FORCE_INLINING 1
#endif
#if PAGEDSERVE_FORCE_INLINING
#define PAGEDSERVE_FORCE_INLINE inline __attribute__((always_inline))
#define PAGEDSERVE_NOINLINE __attribute__((noinline))
#define PAGEDSERVE_LAMBDA_INLINE __attribute__((always_inline))
#else
#define PAGEDSERVE_FORCE_INLINE inline
#define PAGEDSERVE_NOINLINE inline
#define PAGEDSERVE_LAMBDA_INLINE
#endif

// Software prefetch this many bytes ahead of where a thread reads its run of the weight. The
// hardware prefetchers alone kept one thread's stream at ~70-85% of what a plain sum reads
// (they stop at every 4 KiB page and ramp up again); a request 1 KiB ahead keeps more lines in
// flight (benchmarks/weight_stream.py builds the kernel without it, -DPAGEDSERVE_PREFETCH_AHEAD=0,
// to compare).
// Prefetching past the weight's end is harmless: a prefetch never faults.
#ifndef PAGEDSERVE_PREFETCH_AHEAD
#define PAGEDSERVE_PREFETCH_AHEAD 1024
#endif
constexpr int64_t kPrefetchAhead = PAGEDSERVE_PREFETCH_AHEAD;

// Prefetches the cache lines `bytes` long from `p`, kPrefetchAhead in front.
inline void prefetch_ahead(const void* p, int64_t bytes) {
  if constexpr (kPrefetchAhead > 0)
    for (int64_t b = 0; b < bytes; b += 64)
      _mm_prefetch(static_cast<const char*>(p) + b + kPrefetchAhead, _MM_HINT_T0);
}

// Several rows: a tile's row blocks each walk it, the first from DRAM, the later ones from the
// caches, compute-bound. Left alone the DRAM stream idled while the later blocks computed and
// the next tile's first block stalled on it (8 bf16 rows took the time of the stream PLUS the
// arithmetic); instead every block requests a share of the NEXT tile, spread over its walk
// (`stride` bytes further each step), so the stream runs under all the blocks' arithmetic.
// `-DPAGEDSERVE_NEXT_TILE=0` builds it without (benchmarks/weight_stream.py compares).
#ifndef PAGEDSERVE_NEXT_TILE
#define PAGEDSERVE_NEXT_TILE 1
#endif
struct NextTile {
  const char* base = nullptr;
  int64_t stride = 0;
  inline void at(int64_t step) const {
    if (!PAGEDSERVE_NEXT_TILE || !base) return;
    const char* p = base + step * stride;
    _mm_prefetch(p, _MM_HINT_T0);
    for (int64_t b = 64; b < stride; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  }
  // Block `block` of `blocks` over a tile of `tile_bytes` walked in `steps` steps, `next` the
  // next tile's start. A single block streams its own tile (prefetch_ahead): nothing to share.
  static NextTile share(const void* next, int64_t tile_bytes, int64_t steps, int64_t block, int64_t blocks) {
    if (blocks <= 1) return {};
    return NextTile{static_cast<const char*>(next) + block * tile_bytes / blocks, tile_bytes / (blocks * steps)};
  }
};

// Loaders: the 8 elements (p, 8 v .. 8 v + 7) of a tile as floats, v in 0..3; `prefetch(p)`
// asks for the weight kPrefetchAhead bytes past pair p's (a cache line per 64 bytes).
struct LoadF32 {
  const float* w;
  inline __m256 operator()(int64_t p, int v) const { return _mm256_loadu_ps(w + p * 32 + v * 8); }
  // None: float32 reads two lines a pair, and its stream ran ~12% faster on the hardware
  // prefetchers alone than with requests ahead (benchmarks/weight_stream.py, batch 1).
  inline void prefetch(int64_t) const {}
};
struct LoadBF16 {
  const uint16_t* w;
  inline __m256 operator()(int64_t p, int v) const {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + p * 32 + v * 8));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  inline void prefetch(int64_t p) const { prefetch_ahead(w + p * 32, 64); }
};
struct LoadI8 {
  const int8_t* w;
  inline __m256 operator()(int64_t p, int v) const {
    __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + p * 32 + v * 8));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
  // 32 bytes a pair: every other pair starts a line.
  inline void prefetch(int64_t p) const { if ((p & 1) == 0) prefetch_ahead(w + p * 32, 64); }
};

// (c0k0, c0k1, c1k0, c1k1 | c2.., c3..) and the same for channels 4..7 -> c0..c7.
inline __m256 fold_pairs(__m256 a, __m256 b) {
  __m256 h = _mm256_hadd_ps(a, b);  // c0 c1 c4 c5 | c2 c3 c6 c7
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(h), 0xD8));
}

// MT rows of x (float32, rows `ldx` apart) times one tile: out[i * 16 + j], float32 sums.
// Prefetch: whether this pass asks for the weight ahead (the first row block of a tile only;
// later blocks find it in the caches, and the extra instructions cost compute-bound passes).
template <int MT, int U, class Load, bool Prefetch = true>
inline void tile_dot(const float* x, int64_t ldx, int64_t pairs, const Load& load, float* out,
                     const NextTile& next = {}) {
  __m256 acc[U][MT][4];
  PAGEDSERVE_UNROLL
  for (int u = 0; u < U; ++u)
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i)
      PAGEDSERVE_UNROLL
      for (int v = 0; v < 4; ++v) acc[u][i][v] = _mm256_setzero_ps();
  auto step = [&](int u, int64_t p) {
    if constexpr (Prefetch) load.prefetch(p);
    next.at(p);
    __m256 xb[MT];
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i)
      xb[i] = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(x + i * ldx + 2 * p)));
    PAGEDSERVE_UNROLL
    for (int v = 0; v < 4; ++v) {
      __m256 w = load(p, v);
      PAGEDSERVE_UNROLL
      for (int i = 0; i < MT; ++i) acc[u][i][v] = _mm256_fmadd_ps(w, xb[i], acc[u][i][v]);
    }
  };
  int64_t p = 0;
  for (; p + U <= pairs; p += U)
    PAGEDSERVE_UNROLL
    for (int u = 0; u < U; ++u) step(u, p + u);
  for (; p < pairs; ++p) step(0, p);
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    PAGEDSERVE_UNROLL
    for (int v = 0; v < 4; ++v)
      for (int u = 1; u < U; ++u) acc[0][i][v] = _mm256_add_ps(acc[0][i][v], acc[u][i][v]);
    _mm256_storeu_ps(out + i * kTile, fold_pairs(acc[0][i][0], acc[0][i][1]));
    _mm256_storeu_ps(out + i * kTile + 8, fold_pairs(acc[0][i][2], acc[0][i][3]));
  }
}

// The 32 bf16 of pair p of a tile as floats: e0 / o0 the pair's k0 / k1 for channels 0-7,
// e1 / o1 for channels 8-15 (the shift / mask below).
struct BF16Pair {
  __m256 e0, o0, e1, o1;
  inline BF16Pair(const uint16_t* w, int64_t p, __m256i high) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 32 + 16));
    e0 = _mm256_castsi256_ps(_mm256_slli_epi32(b0, 16));
    o0 = _mm256_castsi256_ps(_mm256_and_si256(b0, high));
    e1 = _mm256_castsi256_ps(_mm256_slli_epi32(b1, 16));
    o1 = _mm256_castsi256_ps(_mm256_and_si256(b1, high));
  }
};

// bfloat16 tiles: 16 bf16 of a pair (8 channels x 2 k) are 8 32-bit lanes (c k0 | c k1 << 16);
// a shift left by 16 gives k0's weights as floats and a mask of the low half k1's, so 16
// weights cost 2 integer ops (the generic loader's zero-extend + shift costs 4) and each
// accumulator holds one channel's sum: no horizontal adds at the end.
template <int MT, int U, bool Prefetch = true>
inline void tile_dot_bf16(const float* x, int64_t ldx, int64_t pairs, const uint16_t* w, float* out,
                          const NextTile& next = {}) {
  __m256 acc[U][MT][4];
  PAGEDSERVE_UNROLL
  for (int u = 0; u < U; ++u)
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i)
      PAGEDSERVE_UNROLL
      for (int v = 0; v < 4; ++v) acc[u][i][v] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto step = [&](int u, int64_t p) {
    if constexpr (Prefetch) prefetch_ahead(w + p * 32, 64);
    next.at(p);
    const BF16Pair pw(w, p, high);
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) {
      const __m256 xe = _mm256_broadcast_ss(x + i * ldx + 2 * p), xo = _mm256_broadcast_ss(x + i * ldx + 2 * p + 1);
      acc[u][i][0] = _mm256_fmadd_ps(pw.e0, xe, acc[u][i][0]);
      acc[u][i][1] = _mm256_fmadd_ps(pw.o0, xo, acc[u][i][1]);
      acc[u][i][2] = _mm256_fmadd_ps(pw.e1, xe, acc[u][i][2]);
      acc[u][i][3] = _mm256_fmadd_ps(pw.o1, xo, acc[u][i][3]);
    }
  };
  int64_t p = 0;
  for (; p + U <= pairs; p += U)
    PAGEDSERVE_UNROLL
    for (int u = 0; u < U; ++u) step(u, p + u);
  for (; p < pairs; ++p) step(0, p);
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    PAGEDSERVE_UNROLL
    for (int v = 0; v < 4; ++v)
      for (int u = 1; u < U; ++u) acc[0][i][v] = _mm256_add_ps(acc[0][i][v], acc[u][i][v]);
    _mm256_storeu_ps(out + i * kTile, _mm256_add_ps(acc[0][i][0], acc[0][i][1]));
    _mm256_storeu_ps(out + i * kTile + 8, _mm256_add_ps(acc[0][i][2], acc[0][i][3]));
  }
}

// bfloat16, 3 or more rows: MT rows times the whole tile, each row two accumulators (channels
// 0-7 and 8-15) that take both k of a pair. The 2-row blocks above keep the pair's k apart
// instead (4 accumulators a row); 8 chains of one multiply-add each per pair are just enough to
// cover the FMA latency at 2 a cycle, and every stall showed. Here MT = 4 gives 8 chains of two
// per pair with the 16 multiply-adds of a pair spread over them, 8 accumulators + the pair's
// 4 weight vectors + a broadcast + the mask (14 registers); the weight's shift and mask are
// shared by 4 rows instead of 2. A decode step's weight pass ran 1.20x faster at 8 rows, 1.15x
// at 32, 1.07x at 3 (5 rows: equal); MT = 5 or 6, and halves of a tile with 8 rows, ran no better
// or spilled. `-DPAGEDSERVE_BF16_ROW_BLOCKS4=0` builds the 2-row blocks for every row count
// (benchmarks/gemv_variants.py compares builds).
#ifndef PAGEDSERVE_BF16_ROW_BLOCKS4
#define PAGEDSERVE_BF16_ROW_BLOCKS4 1
#endif
template <int MT, bool Prefetch>
inline void tile_dot_bf16_rows(const float* x, int64_t ldx, int64_t pairs, const uint16_t* w, float* out,
                               const NextTile& next) {
  __m256 acc[MT][2];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    if constexpr (Prefetch) prefetch_ahead(w + p * 32, 64);
    next.at(p);
    const BF16Pair pw(w, p, high);
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) {
      const __m256 xe = _mm256_broadcast_ss(x + i * ldx + 2 * p);
      acc[i][0] = _mm256_fmadd_ps(pw.e0, xe, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(pw.e1, xe, acc[i][1]);
    }
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) {
      const __m256 xo = _mm256_broadcast_ss(x + i * ldx + 2 * p + 1);
      acc[i][0] = _mm256_fmadd_ps(pw.o0, xo, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(pw.o1, xo, acc[i][1]);
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    _mm256_storeu_ps(out + i * kTile, acc[i][0]);
    _mm256_storeu_ps(out + i * kTile + 8, acc[i][1]);
  }
}

// All M rows times tile `t`: sums[m * 16 + j] for channels 16 t + j.
template <class Load>
inline void tile_all_rows(const float* x, int64_t M, int64_t K, const Load& load, float* sums) {
  const int64_t pairs = K / 2;
  if (M == 1) return tile_dot<1, 2>(x, K, pairs, load, sums);
  // Row blocks of 3 (12 accumulators, the 16 AVX2 registers nearly full) only where 6 or more
  // rows amortize them; 4 rows ran 1.2x faster as 2 + 2 than as 3 + 1 (benchmarks/gemv_micro.py).
  // Every block has U = 1, so a row's sums do not depend on the block it falls in.
  const int64_t triples = M >= 6 ? M / 3 : 0, rest = M - 3 * triples;
  const int64_t blocks = triples + rest / 2 + rest % 2, tile_bytes = pairs * 32 * int64_t{sizeof(*load.w)};
  const auto* next = reinterpret_cast<const char*>(load.w) + tile_bytes;
  auto share = [&](int64_t block) { return NextTile::share(next, tile_bytes, pairs, block, blocks); };
  int64_t m = 0, block = 0;
  if (triples > 0) {
    tile_dot<3, 1>(x, K, pairs, load, sums, share(block++));
    for (m = 3; m + 3 <= M; m += 3) tile_dot<3, 1, Load, false>(x + m * K, K, pairs, load, sums + m * kTile, share(block++));
  } else {
    tile_dot<2, 1>(x, K, pairs, load, sums, share(block++));
    m = 2;
  }
  for (; m + 2 <= M; m += 2) tile_dot<2, 1, Load, false>(x + m * K, K, pairs, load, sums + m * kTile, share(block++));
  if (M - m == 1) tile_dot<1, 2, Load, false>(x + m * K, K, pairs, load, sums + m * kTile, share(block++));
}
inline void tile_all_rows(const float* x, int64_t M, int64_t K, const LoadBF16& load, float* sums) {
  const int64_t pairs = K / 2;
  if (M == 1) return tile_dot_bf16<1, 2>(x, K, pairs, load.w, sums);
  if (!PAGEDSERVE_BF16_ROW_BLOCKS4) {  // the earlier layout: blocks of 2 rows (and a last 1)
    const int64_t blocks = (M + 1) / 2, tile_bytes = pairs * 64;
    const uint16_t* next = load.w + pairs * 32;
    tile_dot_bf16<2, 1>(x, K, pairs, load.w, sums, NextTile::share(next, tile_bytes, pairs, 0, blocks));
    int64_t m = 2;
    for (; m + 2 <= M; m += 2)
      tile_dot_bf16<2, 1, false>(x + m * K, K, pairs, load.w, sums + m * kTile,
                                 NextTile::share(next, tile_bytes, pairs, m / 2, blocks));
    if (M - m == 1)
      tile_dot_bf16<1, 2, false>(x + m * K, K, pairs, load.w, sums + m * kTile,
                                 NextTile::share(next, tile_bytes, pairs, m / 2, blocks));
    return;
  }
  // Row blocks: 4 (or a last 3) rows in tile_dot_bf16_rows; a last 2 or 1 in tile_dot_bf16,
  // whose split accumulators suit few rows (2 rows alone: 8 accumulators + 4 weights + 2
  // broadcasts + the mask fit the 16 AVX2 registers; blocks of 3 that way spilled).
  const int64_t wide = M - M % 4 + (M % 4 == 3 ? 3 : 0);  // rows in blocks of 4 (and a last 3)
  const int64_t rest = M - wide, blocks = (wide + 3) / 4 + (rest > 0 ? 1 : 0), tile_bytes = pairs * 64;
  const uint16_t* next = load.w + pairs * 32;
  auto share = [&](int64_t block) { return NextTile::share(next, tile_bytes, pairs, block, blocks); };
  int64_t m = 0, block = 0;
  for (; m < wide; m += 4, ++block) {
    const int64_t rows = std::min<int64_t>(4, wide - m);
    const float* xm = x + m * K;
    float* out = sums + m * kTile;
    if (rows == 4 && block == 0) tile_dot_bf16_rows<4, true>(xm, K, pairs, load.w, out, share(block));
    else if (rows == 4) tile_dot_bf16_rows<4, false>(xm, K, pairs, load.w, out, share(block));
    else if (block == 0) tile_dot_bf16_rows<3, true>(xm, K, pairs, load.w, out, share(block));
    else tile_dot_bf16_rows<3, false>(xm, K, pairs, load.w, out, share(block));
  }
  if (rest == 2 && block == 0) tile_dot_bf16<2, 1>(x, K, pairs, load.w, sums, share(block));
  else if (rest == 2) tile_dot_bf16<2, 1, false>(x + m * K, K, pairs, load.w, sums + m * kTile, share(block));
  else if (rest == 1) tile_dot_bf16<1, 2, false>(x + m * K, K, pairs, load.w, sums + m * kTile, share(block));
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

// Where a tile's results go: y (M, N) float32 or bfloat16, plus an optional float32 bias.
struct TileOut {
  float* yf;
  c10::BFloat16* yb;
  const float* bias;
  int64_t N;
  TileOut(at::Tensor& y, const float* b, int64_t n)
      : yf(y.scalar_type() == at::kBFloat16 ? nullptr : y.data_ptr<float>()),
        yb(y.scalar_type() == at::kBFloat16 ? reinterpret_cast<c10::BFloat16*>(y.data_ptr()) : nullptr),
        bias(b), N(n) {}
  TileOut(float* f, c10::BFloat16* b16, int64_t n) : yf(f), yb(b16), bias(nullptr), N(n) {}
  // y[m, 16 t + j] = tot[m * 16 + j] (+ bias), rounded once to y's dtype, 8 lanes at a time
  // (a scalar bf16 conversion per element cost SmolLM2's 8-row bf16 LM head ~0.5 ms of 6.7).
  // Rows m0 .. m0 + M - 1 of y (tot's row 0 is y's row m0).
  inline void store(const float* tot, int64_t M, int64_t t, int64_t m0 = 0) const {
    const int64_t n0 = t * kTile;
    const __m256 b0 = bias ? _mm256_loadu_ps(bias + n0) : _mm256_setzero_ps();
    const __m256 b1 = bias ? _mm256_loadu_ps(bias + n0 + 8) : _mm256_setzero_ps();
    for (int64_t m = 0; m < M; ++m) {
      __m256 v0 = _mm256_loadu_ps(tot + m * kTile), v1 = _mm256_loadu_ps(tot + m * kTile + 8);
      if (bias) {
        v0 = _mm256_add_ps(v0, b0);
        v1 = _mm256_add_ps(v1, b1);
      }
      const int64_t at = (m0 + m) * N + n0;
      if (yb) {
        store_bf16x8(yb + at, v0);
        store_bf16x8(yb + at + 8, v1);
      } else {
        _mm256_storeu_ps(yf + at, v0);
        _mm256_storeu_ps(yf + at + 8, v1);
      }
    }
  }

 private:
  // c10::BFloat16's rounding, NaN kept a quiet NaN as it does.
  static inline void store_bf16x8(c10::BFloat16* p, __m256 v) {
    const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000));
    pagedserve::store_bf16x8(p, _mm256_blendv_ps(v, nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
};

template <class Load, class Elem>
void dense_impl(const at::Tensor& xf, const Elem* w, int64_t tiles, const at::Tensor& bias, at::Tensor& y) {
  const int64_t M = xf.size(0), K = xf.size(1), N = tiles * kTile;
  const float* xd = xf.data_ptr<float>();
  at::Tensor bf = bias.defined() ? bias.to(at::kFloat).contiguous() : bias;
  const float* bd = bf.defined() ? bf.data_ptr<float>() : nullptr;
  const TileOut out(y, bd, N);
  const int64_t tile_elems = K * kTile;
  for_tiles(tiles, tile_elems * static_cast<int64_t>(sizeof(Elem)), M, [&](int64_t t, float* sums) {
    tile_all_rows(xd, M, K, Load{w + t * tile_elems}, sums);
    out.store(sums, M, t);
  });
}

// ---- bfloat16 x bfloat16 with AVX512-BF16 (vdpbf16ps) ---------------------------------------
//
// A bf16 model's rows times bf16 pair tiles: a pair tile's 16 channels x 2 k are one 512-bit
// vector, the row's k-pair (two bf16, 32 bits) broadcast to every lane, and vdpbf16ps adds both
// exact products of each lane into its float32 accumulator: 16 channels x 2 k in one instruction
// (an AVX2 FMA does 8 x 1, after widening the weight). Only for bf16 rows: a float32 row would
// have to be rounded to bf16 first, and a float32 model never computes in bf16. The instruction
// flushes denormals (inputs and result) to zero; otherwise float32 sums as on the AVX2 path, in
// another order. `-DPAGEDSERVE_DENSE_DPBF16=0` builds the AVX2 path for them
// (benchmarks/isa_variants.py compares).
#ifndef PAGEDSERVE_DENSE_DPBF16
#if defined(PAGEDSERVE_AVX512BF16)
#define PAGEDSERVE_DENSE_DPBF16 1
#else
#define PAGEDSERVE_DENSE_DPBF16 0
#endif
#endif
#if PAGEDSERVE_DENSE_DPBF16
// MT rows (k-pairs `ldx` uint32 apart) times one tile: out[i * 16 + j]. U accumulators a row
// keep U * MT >= 4 chains in flight (vdpbf16ps latency over its issue rate).
template <int MT>
inline void tile_dpbf16(const uint32_t* x, int64_t ldx, int64_t pairs, const uint16_t* w, float* out,
                        bool prefetch, const NextTile& next) {
  constexpr int U = MT >= 4 ? 1 : (MT == 1 ? 4 : 2);
  __m512 acc[U][MT];
  PAGEDSERVE_UNROLL
  for (int u = 0; u < U; ++u)
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) acc[u][i] = _mm512_setzero_ps();
  auto step = [&](int u, int64_t p) {
    if (prefetch) prefetch_ahead(w + p * 32, 64);
    next.at(p);
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + p * 32);
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i)
      acc[u][i] = _mm512_dpbf16_ps(acc[u][i], wv, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + p])));
  };
  int64_t p = 0;
  for (; p + U <= pairs; p += U)
    PAGEDSERVE_UNROLL
    for (int u = 0; u < U; ++u) step(u, p + u);
  for (; p < pairs; ++p) step(0, p);
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    for (int u = 1; u < U; ++u) acc[0][i] = _mm512_add_ps(acc[0][i], acc[u][i]);
    _mm512_storeu_ps(out + i * kTile, acc[0][i]);
  }
}

// M rows (k-pairs `pairs` uint32 apart) times the tile at wt: sums[m * 16 + j]. Rows in blocks
// of up to 8 (8 accumulators + the weight + a broadcast of 32 registers); the first block
// streams the tile, every block requests its share of the next (see NextTile).
inline void dpbf16_tile(const uint32_t* xp, int64_t M, int64_t pairs, const uint16_t* wt, float* sums) {
  const int64_t tile_bytes = pairs * 64, blocks = (M + 7) / 8;
  for (int64_t m = 0, block = 0; m < M; m += 8, ++block) {
    const NextTile next = NextTile::share(wt + pairs * 32, tile_bytes, pairs, block, blocks);
    const uint32_t* xm = xp + m * pairs;
    float* o = sums + m * kTile;
    const bool first = block == 0;
    switch (std::min<int64_t>(8, M - m)) {
      case 8: tile_dpbf16<8>(xm, pairs, pairs, wt, o, first, next); break;
      case 7: tile_dpbf16<7>(xm, pairs, pairs, wt, o, first, next); break;
      case 6: tile_dpbf16<6>(xm, pairs, pairs, wt, o, first, next); break;
      case 5: tile_dpbf16<5>(xm, pairs, pairs, wt, o, first, next); break;
      case 4: tile_dpbf16<4>(xm, pairs, pairs, wt, o, first, next); break;
      case 3: tile_dpbf16<3>(xm, pairs, pairs, wt, o, first, next); break;
      case 2: tile_dpbf16<2>(xm, pairs, pairs, wt, o, first, next); break;
      default: tile_dpbf16<1>(xm, pairs, pairs, wt, o, first, next); break;
    }
  }
}

// x (M, K) bf16 times every tile (dpbf16_tile), tiles split over threads.
inline void dense_dpbf16(const at::Tensor& x, const uint16_t* w, int64_t tiles, const at::Tensor& bias,
                         at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = tiles * kTile, pairs = K / 2;
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr());
  at::Tensor bf = bias.defined() ? bias.to(at::kFloat).contiguous() : bias;
  const TileOut out(y, bf.defined() ? bf.data_ptr<float>() : nullptr, N);
  for_tiles(tiles, pairs * 64, M, [&](int64_t t, float* sums) {
    dpbf16_tile(xp, M, pairs, w + t * pairs * 32, sums);
    out.store(sums, M, t);
  });
}
#endif

// ---- group-wise int8 / int4 ("channel tiles") -------------------------------------------

// 16 int8 weights of channels 16 t .. 16 t + 15 at one k, as two float vectors.
struct ChanI8 {
  const int8_t* w;  // the tile: K x 16 bytes
  static constexpr int64_t kBytesPerK = 16;
  const void* at(int64_t k) const { return w + k * 16; }
  inline void operator()(int64_t k, __m256& lo, __m256& hi) const {
    // Two 8-byte loads: each folds into its sign extension (no shuffle to reach the high half).
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 16))));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 16 + 8))));
  }
};
// 16 int4 weights (8 bytes: channel j low nibble, channel 8 + j high nibble) as floats in [0, 15].
struct ChanI4 {
  const uint8_t* w;  // the tile: K x 8 bytes
  static constexpr int64_t kBytesPerK = 8;
  const void* at(int64_t k) const { return w + k * 8; }
  inline void operator()(int64_t k, __m256& lo, __m256& hi) const {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * 8)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
};
// 16 weights of 5 or 6 bits (a GGUF file's Q5_0 / Q5_1 / Q5_K / Q6_K, as few bytes as the
// file's): ChanI4's 8 bytes of low nibbles, then the high bits of the 16 channels, HB = Bits - 4
// per channel, in one little-endian word of 2 * HB bytes (channel j's at bits HB j ..).
template <int Bits>
struct ChanBits {
  static constexpr int kHigh = Bits - 4;
  const uint8_t* w;  // the tile: K x (8 + 2 * kHigh) bytes
  static constexpr int64_t kBytesPerK = 8 + 2 * kHigh;
  const void* at(int64_t k) const { return w + k * kBytesPerK; }
  inline void operator()(int64_t k, __m256& lo, __m256& hi) const {
    const uint8_t* p = w + k * kBytesPerK;
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    uint32_t word = 0;
    std::memcpy(&word, p + 8, 2 * kHigh);
    const __m256i v = _mm256_set1_epi32(static_cast<int>(word));
    const __m256i mask = _mm256_set1_epi32((1 << kHigh) - 1);
    const __m256i shift_lo = kHigh == 1 ? _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
                                        : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i shift_hi = _mm256_add_epi32(shift_lo, _mm256_set1_epi32(8 * kHigh));
    const __m256i h_lo = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(v, shift_lo), mask), 4);
    const __m256i h_hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(v, shift_hi), mask), 4);
    lo = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(15)), h_lo));
    hi = _mm256_cvtepi32_ps(_mm256_or_si256(_mm256_srli_epi32(b, 4), h_hi));
  }
};

// Per group of `group` k and MT rows: acc[i] = sum_k x[i, k] * w[k, 0..15] (float32), with U
// k in flight for few rows (2 * U * MT independent FMA chains hide the latency); then
// epilogue(g, acc) folds the group into the row totals.
// `prefetch`: the first row block of a tile only (see tile_dot); once a group, so a plain flag.
template <int MT, int U, class Load, class Epilogue>
inline void chan_groups(const float* x, int64_t ldx, int64_t K, int64_t group, const Load& load,
                        Epilogue epilogue, bool prefetch = true, const NextTile& next = {}) {
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    __m256 acc[U][MT][2];
    PAGEDSERVE_UNROLL
    for (int u = 0; u < U; ++u)
      PAGEDSERVE_UNROLL
      for (int i = 0; i < MT; ++i) acc[u][i][0] = acc[u][i][1] = _mm256_setzero_ps();
    if (prefetch) prefetch_ahead(load.at(g0), group * Load::kBytesPerK);
    next.at(g);
    for (int64_t k = g0; k < g0 + group; k += U)  // group % U == 0 (group is a multiple of 32)
      PAGEDSERVE_UNROLL
      for (int u = 0; u < U; ++u) {
        __m256 lo, hi;
        load(k + u, lo, hi);
        PAGEDSERVE_UNROLL
        for (int i = 0; i < MT; ++i) {
          const __m256 xb = _mm256_broadcast_ss(x + i * ldx + k + u);
          acc[u][i][0] = _mm256_fmadd_ps(lo, xb, acc[u][i][0]);
          acc[u][i][1] = _mm256_fmadd_ps(hi, xb, acc[u][i][1]);
        }
      }
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i)
      for (int u = 1; u < U; ++u) {
        acc[0][i][0] = _mm256_add_ps(acc[0][i][0], acc[u][i][0]);
        acc[0][i][1] = _mm256_add_ps(acc[0][i][1], acc[u][i][1]);
      }
    epilogue(g, acc[0], MT);
  }
}

// Runs chan_groups over all M rows in blocks of at most 4 (registers), the row block's first
// row index passed to the epilogue as `m0`. (Blocks of 5, 10 accumulators, ran 2.5% slower on
// the model's weight pass at 8 and 16 rows, though faster on weights held in the caches.)
template <class Load, class Epilogue>
inline void chan_all_rows(const float* x, int64_t M, int64_t K, int64_t group, const Load& load,
                          Epilogue epilogue) {
  auto at = [&](int64_t m0) {
    return [&, m0](int64_t g, __m256 (*acc)[2], int mt) { epilogue(m0, g, acc, mt); };
  };
  if (M == 1) return chan_groups<1, 4>(x, K, K, group, load, at(0));
  if (M == 2) return chan_groups<2, 2>(x, K, K, group, load, at(0));
  const int64_t blocks = (M + 3) / 4, tile_bytes = K * Load::kBytesPerK;
  auto share = [&](int64_t m0) {
    return NextTile::share(load.at(K), tile_bytes, K / group, m0 / 4, blocks);
  };
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) chan_groups<4, 1>(x + m * K, K, K, group, load, at(m), m == 0, share(m));
  if (M - m == 3) chan_groups<3, 1>(x + m * K, K, K, group, load, at(m), m == 0, share(m));
  if (M - m == 2) chan_groups<2, 2>(x + m * K, K, K, group, load, at(m), m == 0, share(m));
  if (M - m == 1) chan_groups<1, 4>(x + m * K, K, K, group, load, at(m), m == 0, share(m));
}

inline __m256 load_half8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(f);
#endif
}

// A group's 16 parameters as two float vectors: float16 (Q8_0 / Q5_0 / IQ4_NL scales, exact)
// or float32 (a K-quant's d * sub-block scale, exact in float32, not in float16).
inline void load_param16(const c10::Half* p, __m256& a, __m256& b) { a = load_half8(p); b = load_half8(p + 8); }
inline void load_param16(const float* p, __m256& a, __m256& b) { a = _mm256_loadu_ps(p); b = _mm256_loadu_ps(p + 8); }

// A group's 16 scales and level-0 values (the weight of q = 0) from its (2, 16) parameters:
// bfloat16 (scale, zero) of W = (q - 8) scale + zero: level 0 = zero - 8 scale (exact in
// float32 for bf16 inputs); float16 (d, m) of GGUF's W = q d + m, or float32 (s, l0) of a
// K-quant's W = q s + l0 (Q4_K / Q5_K: s = d sc, l0 = -dmin m): level 0 = m / l0.
inline void group_affine(const bf16* p, __m256& s0, __m256& s1, __m256& l0, __m256& l1) {
  const __m256 eight = _mm256_set1_ps(8.0f);
  s0 = load_bf16x8(p);
  s1 = load_bf16x8(p + 8);
  l0 = _mm256_fnmadd_ps(eight, s0, load_bf16x8(p + 16));
  l1 = _mm256_fnmadd_ps(eight, s1, load_bf16x8(p + 24));
}
template <class P>
inline void group_affine(const P* p, __m256& s0, __m256& s1, __m256& l0, __m256& l1) {
  load_param16(p, s0, s1);
  load_param16(p + 16, l0, l1);
}

// Per row and group: the sum of x over the group (what each group's level 0 multiplies).
std::vector<float> group_sums(const float* xd, int64_t M, int64_t K, int64_t groups) {
  const int64_t group = K / groups;
  std::vector<float> xsum(M * groups, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t k = g * group; k < (g + 1) * group; k += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(xd + m * K + k));
      xsum[m * groups + g] = hsum8(a);
    }
  return xsum;
}

// Folds a group's partial sums acc (rows m0.., channels 0-7 / 8-15) into the row totals:
// tot += acc * s (+ l0 * sum_k x when the parameters are affine).
template <bool Affine>
inline void fold_group(float* tot, int64_t m0, int64_t g, int64_t groups, __m256 (*acc)[2], int mt,
                       __m256 s0, __m256 s1, __m256 l0, __m256 l1, const float* xsum) {
  for (int i = 0; i < mt; ++i) {
    float* o = tot + (m0 + i) * kTile;
    __m256 v0 = _mm256_fmadd_ps(acc[i][0], s0, _mm256_loadu_ps(o));
    __m256 v1 = _mm256_fmadd_ps(acc[i][1], s1, _mm256_loadu_ps(o + 8));
    if constexpr (Affine) {
      const __m256 xs = _mm256_set1_ps(xsum[(m0 + i) * groups + g]);
      v0 = _mm256_fmadd_ps(l0, xs, v0);
      v1 = _mm256_fmadd_ps(l1, xs, v1);
    }
    _mm256_storeu_ps(o, v0);
    _mm256_storeu_ps(o + 8, v1);
  }
}

// Param: c10::Half scales (N/16, K/group, 16); Affine: float (s, l0) pairs
// (N/16, K/group, 2, 16), W = q s + l0 (a GGUF file's Q5_1 / Q5_K, or Q4_K fused beside int8).
template <class Param, bool Affine>
void int8_grouped_impl(const at::Tensor& xf, const at::Tensor& q, const at::Tensor& scale,
                       const float* bias, at::Tensor& y) {
  const int64_t M = xf.size(0), K = xf.size(1), tiles = q.size(0), N = tiles * kTile;
  const int64_t groups = scale.size(1), group = K / groups, per_group = Affine ? 2 * kTile : kTile;
  const float* xd = xf.data_ptr<float>();
  const std::vector<float> xsum = Affine ? group_sums(xd, M, K, groups) : std::vector<float>();
  const int8_t* qd = q.data_ptr<int8_t>();
  const auto* sd = reinterpret_cast<const Param*>(scale.data_ptr());
  const TileOut out(y, bias, N);
  for_tiles(tiles, K * kTile, M, [&](int64_t t, float* tot) {
    std::fill(tot, tot + M * kTile, 0.0f);
    const Param* st = sd + t * groups * per_group;
    chan_all_rows(xd, M, K, group, ChanI8{qd + t * K * kTile},
                  [&](int64_t m0, int64_t g, __m256 (*acc)[2], int mt) {
                    __m256 s0, s1, l0 = _mm256_setzero_ps(), l1 = l0;
                    if constexpr (Affine) group_affine(st + g * per_group, s0, s1, l0, l1);
                    else load_param16(st + g * per_group, s0, s1);
                    fold_group<Affine>(tot, m0, g, groups, acc, mt, s0, s1, l0, l1, xsum.data());
                  });
    out.store(tot, M, t);
  });
}

// A group's parameters as s (scale) and l0 (level 0, the weight of q = 0) vectors for the
// 16 channels of tile t, group g, from one of the parameter forms below.
// Param pairs (N/16, K/group, 2, 16) (see group_affine), or with Centered a scale alone
// (N/16, K/group, 16): W = (q - 2^(Bits-1)) s, level 0 = -2^(Bits-1) s (exact in float32: a
// power of two times s), a GGUF file's Q5_0 / Q6_K in their own bytes.
template <class Param, bool Centered>
struct DenseParams {
  const Param* p;
  int64_t groups;
  float center;
  static constexpr int64_t kPerGroup = Centered ? kTile : 2 * kTile;
  DenseParams local() const { return *this; }
  PAGEDSERVE_FORCE_INLINE void operator()(int64_t t, int64_t g, __m256& s0, __m256& s1, __m256& l0, __m256& l1) const {
    const Param* st = p + (t * groups + g) * kPerGroup;
    if constexpr (Centered) {
      load_param16(st, s0, s1);
      const __m256 minus_center = _mm256_set1_ps(-center);
      l0 = _mm256_mul_ps(s0, minus_center);
      l1 = _mm256_mul_ps(s1, minus_center);
    } else {
      group_affine(st, s0, s1, l0, l1);
    }
  }
};

// A GGUF file's K-quant parameters in (nearly) the file's bytes ("super-block parameters"):
// per tile and super-block of 256 k, uint8 (N/16, K/256, B):
//   Affine (B = 80 + 32 G):  d float16[16], dmin float16[16], center uint8[16], then per group
//                            (G = 256 / group of them) sc int8[16], m int8[16]
//   centered (B = 32 + 16 G): d float16[16], then per group sc int8[16]; center 2^(Bits-1)
// s = d * sc and dm = dmin * m in float32, as gguf.dequantize computes them (one rounding
// each, the same float32 numbers the float32 (s, l0) form holds), l0 = -(center * s) - dm:
// Q4_K / Q5_K: center 0, so l0 = -dmin m; Q6_K fused beside them: dmin = m = 0, center 32,
// l0 = -32 s (exact). Q6_K alone: the centered form. Where float32 pairs cost 8 bytes per
// channel and group (Q4_K: 2 bits a weight over the file's 0.5), this is 0.66 bits a weight;
// a decode step reads ~the file's bytes.
template <bool Affine>
struct KParams {
  const uint8_t* p;
  int64_t per_sb;       // groups per super-block (G)
  int64_t sb_bytes;     // B
  int64_t sbs;          // super-blocks per tile (K / 256)
  float center;         // centered form: 2^(Bits-1)
  static constexpr int64_t kHead = Affine ? 80 : 32, kPerGroup = Affine ? 32 : 16;
  static inline __m256 i8x8(const uint8_t* b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
  }
  static inline __m256 u8x8(const uint8_t* b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b))));
  }
  static inline __m256 h8(const uint8_t* b) { return load_half8(reinterpret_cast<const c10::Half*>(b)); }
  // The super-block's d (and -dmin, center) as floats, converted once for its G groups: a copy
  // of this struct per thread and tile (`local`) keeps them (nullptr: none yet).
  mutable const uint8_t* cached = nullptr;
  mutable __m256 d0, d1, nmin0, nmin1, c0, c1;
  KParams local() const { return KParams{p, per_sb, sb_bytes, sbs, center}; }
  PAGEDSERVE_FORCE_INLINE void operator()(int64_t t, int64_t g, __m256& s0, __m256& s1, __m256& l0, __m256& l1) const {
    const uint8_t* sb = p + (t * sbs + g / per_sb) * sb_bytes;
    const uint8_t* gp = sb + kHead + (g % per_sb) * kPerGroup;
    if (sb != cached) {
      cached = sb;
      d0 = h8(sb), d1 = h8(sb + 16);
      if constexpr (Affine) {
        const __m256 sign = _mm256_set1_ps(-0.0f);
        nmin0 = _mm256_xor_ps(h8(sb + 32), sign), nmin1 = _mm256_xor_ps(h8(sb + 48), sign);
        c0 = u8x8(sb + 64), c1 = u8x8(sb + 72);
      }
    }
    s0 = _mm256_mul_ps(d0, i8x8(gp));
    s1 = _mm256_mul_ps(d1, i8x8(gp + 8));
    if constexpr (Affine) {
      // (-dmin) * m = -(dmin * m) exactly (a sign flip commutes with the rounding)
      l0 = _mm256_fnmadd_ps(c0, s0, _mm256_mul_ps(nmin0, i8x8(gp + 16)));
      l1 = _mm256_fnmadd_ps(c1, s1, _mm256_mul_ps(nmin1, i8x8(gp + 24)));
    } else {
      const __m256 minus_center = _mm256_set1_ps(-center);
      l0 = _mm256_mul_ps(s0, minus_center);
      l1 = _mm256_mul_ps(s1, minus_center);
    }
  }
};

// Q4_K / Q5_K alone ("packed"): the file's own 16 bytes per channel and super-block, where the
// affine form above spends 21 (its center byte, and sc / m a byte each): a decode step of a
// Q4_K_M file read 3.5% more than the file's Q4_K bytes. Per tile and super-block, B = 256:
//   d float16[16], dmin float16[16], then the 8 groups' sc and m, each as 6-bit planes:
//   96 bytes = low nibbles (16 bytes per group pair: group 2i low, 2i + 1 high nibble), then the
//   high 2 bits (16 bytes per 4 groups, group g at bits 2 (g % 4)); sc's planes, then m's.
// The same s = d * sc and l0 = -(dmin * m) as KParams<true> with center 0, bit for bit.
struct KPackedParams {
  const uint8_t* p;
  int64_t sbs;  // super-blocks per tile (K / 256)
  static constexpr int64_t kGroups = 8, kPlane = 96;
  mutable const uint8_t* cached = nullptr;
  mutable __m256 d0, d1, nmin0, nmin1;
  KPackedParams local() const { return KPackedParams{p, sbs}; }
  // Group g's 16 six-bit values of the plane at `plane`.
  static PAGEDSERVE_FORCE_INLINE __m128i six(const uint8_t* plane, int64_t g) {
    __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane + (g >> 1) * 16));
    __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(plane + 64 + (g >> 2) * 16));
    // 16-bit shifts: the mask drops what crosses from the neighbouring byte
    lo = _mm_and_si128(_mm_srl_epi16(lo, _mm_cvtsi64_si128(4 * (g & 1))), _mm_set1_epi8(15));
    hi = _mm_and_si128(_mm_srl_epi16(hi, _mm_cvtsi64_si128(2 * (g & 3))), _mm_set1_epi8(3));
    return _mm_or_si128(lo, _mm_slli_epi16(hi, 4));
  }
  static PAGEDSERVE_FORCE_INLINE __m256 lo8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
  static PAGEDSERVE_FORCE_INLINE __m256 hi8(__m128i v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)));
  }
  PAGEDSERVE_FORCE_INLINE void operator()(int64_t t, int64_t g, __m256& s0, __m256& s1, __m256& l0, __m256& l1) const {
    const uint8_t* sb = p + (t * sbs + g / kGroups) * kPackedSuperBytes;
    const int64_t gi = g % kGroups;
    if (sb != cached) {
      cached = sb;
      const __m256 sign = _mm256_set1_ps(-0.0f);
      d0 = load_half8(reinterpret_cast<const c10::Half*>(sb));
      d1 = load_half8(reinterpret_cast<const c10::Half*>(sb + 16));
      nmin0 = _mm256_xor_ps(load_half8(reinterpret_cast<const c10::Half*>(sb + 32)), sign);
      nmin1 = _mm256_xor_ps(load_half8(reinterpret_cast<const c10::Half*>(sb + 48)), sign);
    }
    const __m128i sc = six(sb + 64, gi), m = six(sb + 64 + kPlane, gi);
    s0 = _mm256_mul_ps(d0, lo8(sc));
    s1 = _mm256_mul_ps(d1, hi8(sc));
    l0 = _mm256_mul_ps(nmin0, lo8(m));
    l1 = _mm256_mul_ps(nmin1, hi8(m));
  }
};

// Load: ChanI4 or ChanBits<5 / 6>; Params: a form above, `groups` groups of K / groups k.
template <class Load, class Params>
void int4_grouped_impl(const at::Tensor& xf, const at::Tensor& q, int64_t groups, const Params& params,
                       const float* bias, at::Tensor& y) {
  const int64_t M = xf.size(0), K = xf.size(1), tiles = q.size(0), N = tiles * kTile;
  const int64_t group = K / groups;
  const float* xd = xf.data_ptr<float>();
  const std::vector<float> xsum = group_sums(xd, M, K, groups);
  const uint8_t* qd = q.data_ptr<uint8_t>();
  const TileOut out(y, bias, N);
  for_tiles(tiles, K * Load::kBytesPerK, M, [&](int64_t t, float* tot) {
    std::fill(tot, tot + M * kTile, 0.0f);
    const Params tile_params = params.local();
    chan_all_rows(xd, M, K, group, Load{qd + t * K * Load::kBytesPerK},
                  [&](int64_t m0, int64_t g, __m256 (*acc)[2], int mt) {
                    __m256 s0, s1, l0, l1;
                    tile_params(t, g, s0, s1, l0, l1);
                    fold_group<true>(tot, m0, g, groups, acc, mt, s0, s1, l0, l1, xsum.data());
                  });
    out.store(tot, M, t);
  });
}

// ---- channel tiles back to float32 weights (the GEMM path of a GGUF layer's prefill) -----
//
// W^T (K, N) float32 from channel tiles: per k the 16 channels of a tile are one contiguous
// run of the output, so each (tile, k) is two vector stores. q * s + l0 by one FMA (q * s is
// exact, so this is gguf's d * q - dm, one rounding), or (q - center) * s (exact difference,
// one rounding). Threads take tiles.
template <class Load, class Params>
void dequant_tiles_impl(const at::Tensor& q, int64_t groups, const Params& params, at::Tensor& wt) {
  const int64_t tiles = q.size(0), K = q.size(1), N = tiles * kTile, group = K / groups;
  const auto* qd = reinterpret_cast<const uint8_t*>(q.data_ptr());
  float* out = wt.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Load load{reinterpret_cast<decltype(Load::w)>(qd + t * K * Load::kBytesPerK)};
      const Params tile_params = params.local();
      for (int64_t g = 0; g < groups; ++g) {
        __m256 s0, s1, l0, l1;
        tile_params(t, g, s0, s1, l0, l1);
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          __m256 lo, hi;
          load(k, lo, hi);
          float* o = out + k * N + t * kTile;
          _mm256_storeu_ps(o, _mm256_fmadd_ps(lo, s0, l0));
          _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(hi, s1, l1));
        }
      }
    }
  });
}

// ---- group-wise int8 weights x int8 activations ("quad tiles", llama.cpp's q8_0 x q8_0) ----
//
// Each row of x is quantized per block of 32 columns (llama.cpp's quantize_row_q8_0, but the
// block scale stays float32): d = absmax / 127, xq = round_half_even(x * (1 / d)) in
// [-127, 127]. Weights in quad tiles, 16 channels x 4 consecutive k per 64 bytes:
//     q (N/16, K/4, 16, 4) int8:  q[t, c, j, e] = Q[16 t + j, 4 c + e]
// so a 32-byte vector is 8 channels x 4 k, and with x's 4 bytes at k broadcast to every
// lane, _mm256_maddubs_epi16 + _mm256_madd_epi16 give each channel's 4-k dot product in its
// own int32 lane (no horizontal sums). maddubs takes unsigned x signed bytes: |w| and x
// carrying w's sign (llama.cpp's _mm256_sign_epi8 trick); both stay in [-127, 127], so a pair
// sum (<= 2 * 127 * 127) never saturates int16: the block's dot product is exact in int32.
// Per block of 32 k and row: y += float(dot) * (scale_w * d_x), one float FMA per 8 channels.
// |w| is computed once per weight vector and shared by all rows of the call.

// Per row m: xq (M, K) int8 and dx (M, K/32) float32.
void quantize_rows_q8(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx) {
  const __m256 sign_mask = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* src = x + m * K + b * 32;
      __m256 v[4], amax = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(src + 8 * i);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
      }
      const float d = hmax8(amax) / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      dx[m * (K / 32) + b] = d;
      const __m256 idv = _mm256_set1_ps(id);
      __m256i r[4];
      for (int i = 0; i < 4; ++i)
        r[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      // pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane; permute restores it)
      const __m256i p01 = _mm256_packs_epi32(r[0], r[1]), p23 = _mm256_packs_epi32(r[2], r[3]);
      const __m256i p = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + m * K + b * 32), p);
    }
}

// MT rows (xq rows K apart, dx rows K/32 apart) times tile t: tot[i * 16 + j] += sum over
// blocks of float(dot) * scale[g, j] * dx[i, block].
// `prefetch`: the first row block of a tile only (see tile_dot).
// AVX512-VNNI with VL (Ice Lake / Zen 4 and later): vpdpbusd on 256-bit vectors. Set to 0 for
// the AVX2 instruction sequence on such a CPU (benchmarks/isa_variants.py compares the two).
#ifndef PAGEDSERVE_Q8_VNNI
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PAGEDSERVE_Q8_VNNI 1
#else
#define PAGEDSERVE_Q8_VNNI 0
#endif
#endif

template <int MT>
inline void q8_tile_rows(const int8_t* xq, const float* dx, int64_t K, int64_t group, const int8_t* qt,
                         const c10::Half* st, float* tot, bool prefetch, const NextTile& next) {
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  const int64_t blocks_per_group = group / 32;
  for (int64_t b = 0; b < K / 32; ++b) {
    __m256i acc[MT][2];
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
    const int8_t* wb = qt + b * 32 * kTile;  // 8 quads x 64 bytes
    if (prefetch) prefetch_ahead(wb, 32 * kTile);
    next.at(b);
    PAGEDSERVE_UNROLL
    for (int c = 0; c < 8; ++c) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + c * 64 + 32));
      const __m256i a0 = _mm256_sign_epi8(w0, w0), a1 = _mm256_sign_epi8(w1, w1);  // |w|
      PAGEDSERVE_UNROLL
      for (int i = 0; i < MT; ++i) {
        int32_t quad;
        std::memcpy(&quad, xq + i * K + b * 32 + c * 4, 4);
        const __m256i xb = _mm256_set1_epi32(quad);
#if PAGEDSERVE_Q8_VNNI
        // vpdpbusd: the 4 unsigned x signed byte products of each lane summed into its int32
        // in one instruction (maddubs + madd + add on AVX2); no int16 step, the same exact sum.
        acc[i][0] = _mm256_dpbusd_epi32(acc[i][0], a0, _mm256_sign_epi8(xb, w0));
        acc[i][1] = _mm256_dpbusd_epi32(acc[i][1], a1, _mm256_sign_epi8(xb, w1));
#else
        const __m256i p0 = _mm256_maddubs_epi16(a0, _mm256_sign_epi8(xb, w0));
        const __m256i p1 = _mm256_maddubs_epi16(a1, _mm256_sign_epi8(xb, w1));
        acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ones));
        acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ones));
#endif
      }
    }
    const c10::Half* sg = st + (b / blocks_per_group) * kTile;
    const __m256 s0 = load_half8(sg), s1 = load_half8(sg + 8);
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) {
      const __m256 d = _mm256_set1_ps(dx[i * (K / 32) + b]);
      float* o = tot + i * kTile;
      _mm256_storeu_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][0]), _mm256_mul_ps(s0, d), _mm256_loadu_ps(o)));
      _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][1]), _mm256_mul_ps(s1, d), _mm256_loadu_ps(o + 8)));
    }
  }
}

void int8_q8_impl(const at::Tensor& xf, const at::Tensor& q, const at::Tensor& scale, const float* bias,
                  at::Tensor& y) {
  const int64_t M = xf.size(0), K = xf.size(1), tiles = q.size(0), N = tiles * kTile;
  const int64_t groups = scale.size(1), group = K / groups;
  std::vector<int8_t> xq(M * K);
  std::vector<float> dx(M * (K / 32));
  quantize_rows_q8(xf.data_ptr<float>(), M, K, xq.data(), dx.data());
  const int8_t* qd = q.data_ptr<int8_t>();
  const auto* sd = reinterpret_cast<const c10::Half*>(scale.data_ptr());
  const TileOut out(y, bias, N);
  const int64_t nb = K / 32;
  for_tiles(tiles, K * kTile, M, [&](int64_t t, float* tot) {
    std::fill(tot, tot + M * kTile, 0.0f);
    const int8_t* qt = qd + t * K * kTile;
    const c10::Half* st = sd + t * groups * kTile;
    // Row blocks of at most 4 (8 int32 accumulators + 4 weight vectors in 16 registers).
    // The first block prefetches the tile ahead; every block requests its share of the next.
    const int64_t blocks = (M + 3) / 4;
    auto share = [&](int64_t m0) { return NextTile::share(qt + K * kTile, K * kTile, nb, m0 / 4, blocks); };
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      q8_tile_rows<4>(xq.data() + m * K, dx.data() + m * nb, K, group, qt, st, tot + m * kTile, m == 0, share(m));
    if (M - m == 3)
      q8_tile_rows<3>(xq.data() + m * K, dx.data() + m * nb, K, group, qt, st, tot + m * kTile, m == 0, share(m));
    if (M - m == 2)
      q8_tile_rows<2>(xq.data() + m * K, dx.data() + m * nb, K, group, qt, st, tot + m * kTile, m == 0, share(m));
    if (M - m == 1)
      q8_tile_rows<1>(xq.data() + m * K, dx.data() + m * nb, K, group, qt, st, tot + m * kTile, m == 0, share(m));
    out.store(tot, M, t);
  });
}

// The 4 / 5 / 6-bit tiles' parameter forms (checked by the op): `body(params, groups)` with
// the matching Params functor.
template <class Body>
void with_bits_params(const at::Tensor& sz, int64_t K, int bits, Body body) {
  const float center = static_cast<float>(1 << (bits - 1));
  const auto kind = sz.scalar_type();
  if (kind == at::kByte) {  // super-block parameters (KParams, KPackedParams)
    const int64_t B = sz.size(2), sbs = sz.size(1);
    const SuperLayout layout = super_layout(B);
    const int64_t G = layout.groups;
    const uint8_t* p = sz.data_ptr<uint8_t>();
    if (layout.form == SuperForm::kPacked) body(KPackedParams{p, sbs}, (K / 256) * G);
    else if (layout.form == SuperForm::kAffine) body(KParams<true>{p, G, B, sbs, center}, (K / 256) * G);
    else body(KParams<false>{p, G, B, sbs, center}, (K / 256) * G);
    return;
  }
  const int64_t groups = sz.size(1);
  const bool centered = sz.dim() == 3;
  const void* p = sz.data_ptr();
  if (kind == at::kBFloat16) body(DenseParams<bf16, false>{static_cast<const bf16*>(p), groups, center}, groups);
  else if (kind == at::kHalf && centered)
    body(DenseParams<c10::Half, true>{static_cast<const c10::Half*>(p), groups, center}, groups);
  else if (kind == at::kHalf) body(DenseParams<c10::Half, false>{static_cast<const c10::Half*>(p), groups, center}, groups);
  else if (centered) body(DenseParams<float, true>{static_cast<const float*>(p), groups, center}, groups);
  else body(DenseParams<float, false>{static_cast<const float*>(p), groups, center}, groups);
}

template <class Body>
void with_bits_load(int bits, Body body) {
  if (bits == 4) body(ChanI4{});
  else if (bits == 5) body(ChanBits<5>{});
  else body(ChanBits<6>{});
}

void int4_grouped_run(const at::Tensor& xf, const at::Tensor& q, const at::Tensor& sz, int bits, const float* bias,
                      at::Tensor& y) {
  with_bits_load(bits, [&](auto load) {
    using L = decltype(load);
    with_bits_params(sz, q.size(1), bits, [&](const auto& params, int64_t groups) {
      int4_grouped_impl<L>(xf, q, groups, params, bias, y);
    });
  });
}

// ---- 4 / 5 / 6-bit weights x int8 activations ("bit quads": llama.cpp's K-quant x q8_K) -----
//
// The channel tiles above widen every weight to float32 and spend two FMAs per weight and row:
// a batch-1 decode step of a K-quant file ran at ~half the machine's weight-read rate, bound by
// those instructions, not by memory. Here, as in llama.cpp, x is rounded to int8 per block of 32
// (`quantize_rows_q8`) and the weights stay integers: an int32 lane sums 4 products of one
// channel's 4 consecutive k (vpdpbusd, or maddubs + madd on AVX2), 128 weights per 64-byte
// load, and the float work is one multiply-add per group of 16 / 32 k and channel.
//
// Layout, q (N/16, K/32, B) uint8, per tile and block of 32 k:
//   nibbles, 256 bytes: per octet o (k 8o .. 8o+7 of the block) and half h (channels 8h .. 8h+7),
//     32 bytes: byte 4 j + e = (Q[8h+j, 8o+e] & 15) | (Q[8h+j, 8o+4+e] & 15) << 4, so a 32-byte
//     vector masked is 8 channels x k 8o..8o+3 (one int32 lane a channel), shifted 8o+4..8o+7;
//   5 bits (B = 320): then per half 32 bytes, byte 4 j + e: bit 2 o = Q[8h+j, 8o+e] >> 4,
//     bit 2 o + 1 = Q[8h+j, 8o+4+e] >> 4 (the 4 octets);
//   6 bits (B = 384): then per octet pair P (octets 2P, 2P+1) and half 32 bytes, byte 4 j + e:
//     2-bit fields Q >> 4 of (8(2P)+e, 8(2P)+4+e, 8(2P+1)+e, 8(2P+1)+4+e) at bits 0, 2, 4, 6.
// The same bytes a weight as the channel tiles (8 / 10 / 12 a k and tile): no requantizing, the
// file's values; `gemv.pack_bit_quads` writes it. Parameters: every form `with_bits_params`
// takes, groups of 16 or 32 k (a group never spans two activation blocks).
//
// Arithmetic: W = q s + l0 per group (centered forms: l0 = -center s), x ~ d xq per block:
//   y = sum_g (s * d) * sum_k q xq + l0 * (d * sum_k xq)   (+ bias)
// the integer sums exact; i.e. the exact product of the file's weights with the rounded x.
// Unsigned weights (0 .. 63) times signed x (-127 .. 127): AVX2's maddubs adds two products in
// int16 (<= 2 * 63 * 127), and two such sums still fit (<= 32004) before widening.

// The 32-byte half-vectors of octet o: weights of k 8o..8o+3 (lo) and 8o+4..8o+7 (hi).
template <int Bits>
struct BitQuads {
  static constexpr int64_t kBlockBytes = 256 + (Bits - 4) * 64;
  static inline __m256i ld(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  // o: octet 0..3 of the block at `blk`; h: half.
  template <int O>
  static PAGEDSERVE_FORCE_INLINE void get(const uint8_t* blk, int h, __m256i& lo, __m256i& hi) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i n = ld(blk + O * 64 + h * 32);
    lo = _mm256_and_si256(n, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(n, 4), m4);
    if constexpr (Bits == 5) {
      const __m256i hb = ld(blk + 256 + h * 32), bit = _mm256_set1_epi8(16);
      // bit 2 O -> bit 4, bit 2 O + 1 -> bit 4, all inside the byte (16-bit shifts, masked)
      lo = _mm256_or_si256(lo, _mm256_and_si256(shift<4 - 2 * O>(hb), bit));
      hi = _mm256_or_si256(hi, _mm256_and_si256(shift<3 - 2 * O>(hb), bit));
    } else if constexpr (Bits == 6) {
      const __m256i hb = ld(blk + 256 + (O / 2) * 64 + h * 32), two = _mm256_set1_epi8(0x30);
      lo = _mm256_or_si256(lo, _mm256_and_si256(shift<4 - 4 * (O % 2)>(hb), two));
      hi = _mm256_or_si256(hi, _mm256_and_si256(shift<2 - 4 * (O % 2)>(hb), two));
    }
  }
  template <int S>
  static inline __m256i shift(__m256i v) {
    if constexpr (S > 0) return _mm256_slli_epi16(v, S);
    else if constexpr (S < 0) return _mm256_srli_epi16(v, -S);
    else return v;
  }
};

// acc (int32 x 8) += per lane the 4 products of w's unsigned bytes and x's signed bytes.
inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
#if PAGEDSERVE_Q8_VNNI
  return _mm256_dpbusd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}
// acc += the products of (w0, x0) and (w1, x1): on AVX2 the two int16 pair sums add before
// widening (one madd for 64 products; see the bound above).
inline __m256i dot4x2(__m256i acc, __m256i w0, __m256i x0, __m256i w1, __m256i x1) {
#if PAGEDSERVE_Q8_VNNI
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, w0, x0), w1, x1);
#else
  const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(w0, x0), _mm256_maddubs_epi16(w1, x1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
#endif
}

// Row block of MT rows (xq rows K apart) times tile t over one group of G8 octets (G8 = 2 or 4)
// starting at octet `o0` of block `blk`: the int32 sums per row and channel (acc[i][half]).
template <int Bits, int MT, int G8, int O0>
PAGEDSERVE_FORCE_INLINE void quad_group(const uint8_t* blk, const int8_t* xq, int64_t K, __m256i (*acc)[2]) {
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  auto octet = [&](auto oc) PAGEDSERVE_LAMBDA_INLINE {
    constexpr int O = decltype(oc)::value;
    __m256i lo0, hi0, lo1, hi1;
    BitQuads<Bits>::template get<O>(blk, 0, lo0, hi0);
    BitQuads<Bits>::template get<O>(blk, 1, lo1, hi1);
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) {
      int32_t a, b;
      std::memcpy(&a, xq + i * K + 8 * O, 4);
      std::memcpy(&b, xq + i * K + 8 * O + 4, 4);
      const __m256i xa = _mm256_set1_epi32(a), xb = _mm256_set1_epi32(b);
      acc[i][0] = dot4x2(acc[i][0], lo0, xa, hi0, xb);
      acc[i][1] = dot4x2(acc[i][1], lo1, xa, hi1, xb);
    }
  };
  octet(std::integral_constant<int, O0>{});
  octet(std::integral_constant<int, O0 + 1>{});
  if constexpr (G8 == 4) {
    octet(std::integral_constant<int, O0 + 2>{});
    octet(std::integral_constant<int, O0 + 3>{});
  }
}

// sums[i] (16 floats a row, in registers) += acc * (s * d_i) + l0 * xs_i for a group's parameters.
template <int MT>
PAGEDSERVE_FORCE_INLINE void quad_fold(__m256 (*sums)[2], __m256i (*acc)[2], const float* d, int64_t ldd, const float* xs,
                      int64_t ldxs, __m256 s0, __m256 s1, __m256 l0, __m256 l1) {
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    const __m256 dv = _mm256_set1_ps(d[i * ldd]), xv = _mm256_set1_ps(xs[i * ldxs]);
    sums[i][0] = _mm256_fmadd_ps(l0, xv, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][0]), _mm256_mul_ps(s0, dv), sums[i][0]));
    sums[i][1] = _mm256_fmadd_ps(l1, xv, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i][1]), _mm256_mul_ps(s1, dv), sums[i][1]));
  }
}

// AVX512-VNNI (Ice Lake, Zen 4 and later): a tile's 16 channels in one 512-bit vector. A block
// octet's 64 bytes (both halves) are one load, one vpdpbusd does a row's 64 products, and a
// row's integer and float accumulators are one register each, so a register block holds 12
// rows (24 accumulators beside 2 weight vectors, 2 broadcasts and the group's s, l0): half the
// instructions per product of the 256-bit code, and the weights unpacked half as often. Zen 4
// runs 512-bit operations as two 256-bit halves; what it saves is instructions, not ALU work.
// `-DPAGEDSERVE_QUADS_512=0` builds the 256-bit code instead (benchmarks/bits_q8_width.py compares).
#ifndef PAGEDSERVE_QUADS_512
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGEDSERVE_QUADS_512 1
#else
#define PAGEDSERVE_QUADS_512 0
#endif
#endif

// MT rows times tile t (all K): tot[i * 16 + j]. `group`: 16 or 32.
#if !PAGEDSERVE_QUADS_512
template <int Bits, int MT, class Params>
PAGEDSERVE_NOINLINE void quad_tile_rows(const uint8_t* qt, const int8_t* xq, const float* dx, const float* xs, int64_t K,
                           int64_t group, const Params& params, int64_t t, float* tot, bool prefetch,
                           const NextTile& next) {
  constexpr int64_t kB = BitQuads<Bits>::kBlockBytes;
  const int64_t nb = K / 32, groups = K / group;
  __m256i acc[MT][2];
  // The row totals stay in registers over all of K (no load and store of them per group).
  __m256 sums[MT][2];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) sums[i][0] = sums[i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = qt + b * kB;
    if (prefetch) prefetch_ahead(blk, kB);
    next.at(b);
    const int8_t* xb = xq + b * 32;
    __m256 s0, s1, l0, l1;
    if (group == 32) {
      quad_group<Bits, MT, 4, 0>(blk, xb, K, acc);
      params(t, b, s0, s1, l0, l1);
      quad_fold<MT>(sums, acc, dx + b, nb, xs + b, groups, s0, s1, l0, l1);
    } else {
      quad_group<Bits, MT, 2, 0>(blk, xb, K, acc);
      params(t, 2 * b, s0, s1, l0, l1);
      quad_fold<MT>(sums, acc, dx + b, nb, xs + 2 * b, groups, s0, s1, l0, l1);
      quad_group<Bits, MT, 2, 2>(blk, xb, K, acc);
      params(t, 2 * b + 1, s0, s1, l0, l1);
      quad_fold<MT>(sums, acc, dx + b, nb, xs + 2 * b + 1, groups, s0, s1, l0, l1);
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    _mm256_storeu_ps(tot + i * kTile, sums[i][0]);
    _mm256_storeu_ps(tot + i * kTile + 8, sums[i][1]);
  }
}
#endif  // !PAGEDSERVE_QUADS_512

#if PAGEDSERVE_QUADS_512
template <int Bits>
struct BitQuads512 {
  template <int S>
  static inline __m512i shift(__m512i v) {
    if constexpr (S > 0) return _mm512_slli_epi16(v, S);
    else if constexpr (S < 0) return _mm512_srli_epi16(v, -S);
    else return v;
  }
  // a | (b & c), one instruction
  static inline __m512i or_and(__m512i a, __m512i b, __m512i c) { return _mm512_ternarylogic_epi32(a, b, c, 0xF8); }
  // Octet O of the block at `blk`, 16 channels: k 8O..8O+3 (lo) and 8O+4..8O+7 (hi); the same
  // bytes BitQuads<Bits>::get reads as two halves.
  template <int O>
  static PAGEDSERVE_FORCE_INLINE void get(const uint8_t* blk, __m512i& lo, __m512i& hi) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i n = _mm512_loadu_si512(blk + O * 64);
    lo = _mm512_and_si512(n, m4);
    hi = _mm512_and_si512(_mm512_srli_epi16(n, 4), m4);
    if constexpr (Bits == 5) {
      const __m512i hb = _mm512_loadu_si512(blk + 256), bit = _mm512_set1_epi8(16);
      lo = or_and(lo, shift<4 - 2 * O>(hb), bit);
      hi = or_and(hi, shift<3 - 2 * O>(hb), bit);
    } else if constexpr (Bits == 6) {
      const __m512i hb = _mm512_loadu_si512(blk + 256 + (O / 2) * 64), two = _mm512_set1_epi8(0x30);
      lo = or_and(lo, shift<4 - 4 * (O % 2)>(hb), two);
      hi = or_and(hi, shift<2 - 4 * (O % 2)>(hb), two);
    }
  }
};

template <int Bits, int MT, int G8, int O0>
PAGEDSERVE_FORCE_INLINE void quad_group512(const uint8_t* blk, const int8_t* xq, int64_t K, __m512i* acc) {
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_si512();
  auto octet = [&](auto oc) PAGEDSERVE_LAMBDA_INLINE {
    constexpr int O = decltype(oc)::value;
    __m512i lo, hi;
    BitQuads512<Bits>::template get<O>(blk, lo, hi);
    PAGEDSERVE_UNROLL
    for (int i = 0; i < MT; ++i) {
      int32_t a, b;
      std::memcpy(&a, xq + i * K + 8 * O, 4);
      std::memcpy(&b, xq + i * K + 8 * O + 4, 4);
      acc[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[i], lo, _mm512_set1_epi32(a)), hi, _mm512_set1_epi32(b));
    }
  };
  octet(std::integral_constant<int, O0>{});
  octet(std::integral_constant<int, O0 + 1>{});
  if constexpr (G8 == 4) {
    octet(std::integral_constant<int, O0 + 2>{});
    octet(std::integral_constant<int, O0 + 3>{});
  }
}

inline __m512 join(__m256 a, __m256 b) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

template <int MT>
PAGEDSERVE_FORCE_INLINE void quad_fold512(__m512* sums, const __m512i* acc, const float* d, int64_t ldd, const float* xs,
                         int64_t ldxs, __m512 s, __m512 l0) {
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) {
    const __m512 dv = _mm512_set1_ps(d[i * ldd]), xv = _mm512_set1_ps(xs[i * ldxs]);
    sums[i] = _mm512_fmadd_ps(l0, xv, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[i]), _mm512_mul_ps(s, dv), sums[i]));
  }
}

// quad_tile_rows in 512-bit vectors: the same sums in the same order per lane.
template <int Bits, int MT, class Params>
PAGEDSERVE_NOINLINE void quad_tile_rows(const uint8_t* qt, const int8_t* xq, const float* dx, const float* xs, int64_t K,
                           int64_t group, const Params& params, int64_t t, float* tot, bool prefetch,
                           const NextTile& next) {
  constexpr int64_t kB = BitQuads<Bits>::kBlockBytes;
  const int64_t nb = K / 32, groups = K / group;
  __m512i acc[MT];
  __m512 sums[MT];
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) sums[i] = _mm512_setzero_ps();
  auto fold = [&](int64_t g, const float* xsg) PAGEDSERVE_LAMBDA_INLINE {
    __m256 s0, s1, l0, l1;
    params(t, g, s0, s1, l0, l1);
    quad_fold512<MT>(sums, acc, dx, nb, xsg, groups, join(s0, s1), join(l0, l1));
  };
  for (int64_t b = 0; b < nb; ++b, ++dx) {
    const uint8_t* blk = qt + b * kB;
    if (prefetch) prefetch_ahead(blk, kB);
    next.at(b);
    const int8_t* xb = xq + b * 32;
    if (group == 32) {
      quad_group512<Bits, MT, 4, 0>(blk, xb, K, acc);
      fold(b, xs + b);
    } else {
      quad_group512<Bits, MT, 2, 0>(blk, xb, K, acc);
      fold(2 * b, xs + 2 * b);
      quad_group512<Bits, MT, 2, 2>(blk, xb, K, acc);
      fold(2 * b + 1, xs + 2 * b + 1);
    }
  }
  PAGEDSERVE_UNROLL
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(tot + i * kTile, sums[i]);
}
#endif  // PAGEDSERVE_QUADS_512

// Rows per register block: with 512-bit quads 12 (above); AVX-512VL's 32 registers hold 6
// rows' 12 integer and 12 float 256-bit accumulators beside the 4 weight vectors and 2
// broadcasts; AVX2's 16 take 2 (4 rows spill).
#ifndef PAGEDSERVE_QUAD_ROWS
#if PAGEDSERVE_QUADS_512
#define PAGEDSERVE_QUAD_ROWS 12
#elif defined(__AVX512VL__)
#define PAGEDSERVE_QUAD_ROWS 6
#else
#define PAGEDSERVE_QUAD_ROWS 2
#endif
#endif
constexpr int kQuadRows = PAGEDSERVE_QUAD_ROWS;

// A thread walks its tiles once per chunk of rows whose int8 activations take at most this many
// bytes, so the rows it re-reads for every tile stay in its core's L2 (1 MiB on Zen 4): a
// prefill step's 2048 rows of the MLP's down projection are 18 MiB of int8 x, and every tile
// read all of them from L3 or DRAM. The tiles are read once per chunk instead (from L3: a
// thread's run of them is a few MiB). `-DPAGEDSERVE_ROW_CHUNK_BYTES=0` walks all rows per tile
// (benchmarks/bits_q8_width.py --variant compares).
#ifndef PAGEDSERVE_ROW_CHUNK_BYTES
#define PAGEDSERVE_ROW_CHUNK_BYTES (512 << 10)
#endif

// x rounded to int8 per row and block of 32 (quantize_rows_q8), shared by every part of a call,
// and d * (a group's sum of xq) per row for groups of 16 and of 32 k: what a group's level 0
// multiplies (exact integer sums; the 32-k sums add two 16-k ones, still exact).
struct Q8Rows {
  int64_t M, K, nb;
  std::vector<int8_t> xq;
  std::vector<float> dx, xs16, xs32;
  const float* xs(int64_t group) const { return group == 16 ? xs16.data() : xs32.data(); }
};

Q8Rows q8_rows(const at::Tensor& xf, bool need16, bool need32) {
  const int64_t M = xf.size(0), K = xf.size(1), nb = K / 32;
  Q8Rows a{M, K, nb, std::vector<int8_t>(M * K), std::vector<float>(M * nb),
           std::vector<float>(need16 ? M * (K / 16) : 0), std::vector<float>(need32 ? M * nb : 0)};
  // Rows split over the threads: a prefill's x on one thread idled the other ~2% of the op.
  const int64_t row_grain = std::max<int64_t>(1, (int64_t{1} << 16) / K);
  at::parallel_for(0, M, row_grain, [&](int64_t m0, int64_t m1) {
    quantize_rows_q8(xf.data_ptr<float>() + m0 * K, m1 - m0, K, a.xq.data() + m0 * K, a.dx.data() + m0 * nb);
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        const int8_t* xb = a.xq.data() + m * K + b * 32;
        int32_t h0 = 0, h1 = 0;
        for (int k = 0; k < 16; ++k) h0 += xb[k], h1 += xb[16 + k];
        const float d = a.dx[m * nb + b];
        if (need16) {
          a.xs16[m * 2 * nb + 2 * b] = static_cast<float>(h0) * d;
          a.xs16[m * 2 * nb + 2 * b + 1] = static_cast<float>(h1) * d;
        }
        if (need32) a.xs32[m * nb + b] = static_cast<float>(h0 + h1) * d;
      }
  });
  return a;
}

// A tile's s and l0 for every group as float32 (s0, s1, l0, l1: 32 floats a group), made once
// per tile where its rows take more than one register block: the blocks load them instead of
// computing them from the parameter form again each (the packed 6-bit form takes ~30
// instructions a group, and re-unpacking it per 12-row block cost a 48-row step 9%).
// `-DPAGEDSERVE_TILE_FLOAT_PARAMS=0`: every block computes them (bits_q8_width.py --variant).
#ifndef PAGEDSERVE_TILE_FLOAT_PARAMS
#define PAGEDSERVE_TILE_FLOAT_PARAMS 1
#endif
struct TileFloatParams {
  const float* p;
  TileFloatParams local() const { return *this; }
  PAGEDSERVE_FORCE_INLINE void operator()(int64_t, int64_t g, __m256& s0, __m256& s1, __m256& l0, __m256& l1) const {
    const float* f = p + g * 32;
    s0 = _mm256_loadu_ps(f), s1 = _mm256_loadu_ps(f + 8), l0 = _mm256_loadu_ps(f + 16), l1 = _mm256_loadu_ps(f + 24);
  }
};

// Rows m_lo .. m_hi - 1 times tile t of one part (its quads at qt, `Bits` wide, `params` its
// parameter form, groups of `group` k): tot[(m - m_lo) * 16 + j]. `next` / `next_bytes`: the
// tile a thread reads after this one, which the row blocks prefetch a share of.
template <int Bits, class Params>
void quad_tile_all_rows(const Q8Rows& a, const uint8_t* qt, int64_t t, const Params& params, int64_t group,
                        int64_t m_lo, int64_t m_hi, float* tot, const uint8_t* next, int64_t next_bytes) {
  const int64_t K = a.K, nb = a.nb, groups = K / group;
  const float* xs = a.xs(group);
  const int64_t blocks = (m_hi - m_lo + kQuadRows - 1) / kQuadRows;
  auto walk = [&](const auto& tile_params) {
    using P = std::decay_t<decltype(tile_params)>;
    for (int64_t m = m_lo, block = 0; m < m_hi; m += kQuadRows, ++block) {
      const NextTile nt = NextTile::share(next, next_bytes, nb, block, blocks);
      const int8_t* xm = a.xq.data() + m * K;
      const float* dm = a.dx.data() + m * nb;
      const float* sm = xs + m * groups;
      float* o = tot + (m - m_lo) * kTile;
      const bool first = block == 0;
      auto run = [&](auto rows) {
        quad_tile_rows<Bits, decltype(rows)::value, P>(qt, xm, dm, sm, K, group, tile_params, t, o, first, nt);
      };
      switch (std::min<int64_t>(kQuadRows, m_hi - m)) {
#if PAGEDSERVE_QUAD_ROWS >= 12
        case 12: run(std::integral_constant<int, 12>{}); break;
        case 11: run(std::integral_constant<int, 11>{}); break;
        case 10: run(std::integral_constant<int, 10>{}); break;
        case 9: run(std::integral_constant<int, 9>{}); break;
#endif
#if PAGEDSERVE_QUAD_ROWS >= 8
        case 8: run(std::integral_constant<int, 8>{}); break;
        case 7: run(std::integral_constant<int, 7>{}); break;
#endif
#if PAGEDSERVE_QUAD_ROWS >= 5
        case 6: run(std::integral_constant<int, 6>{}); break;
        case 5: run(std::integral_constant<int, 5>{}); break;
#endif
#if PAGEDSERVE_QUAD_ROWS >= 3
        case 4: run(std::integral_constant<int, 4>{}); break;
        case 3: run(std::integral_constant<int, 3>{}); break;
#endif
        case 2: run(std::integral_constant<int, 2>{}); break;
        default: run(std::integral_constant<int, 1>{}); break;
      }
    }
  };
  const Params tile_params = params.local();
  if (blocks <= 1 || !PAGEDSERVE_TILE_FLOAT_PARAMS) {
    walk(tile_params);
    return;
  }
  thread_local std::vector<float> floats;
  floats.resize(groups * 32);
  for (int64_t g = 0; g < groups; ++g) {
    __m256 s0, s1, l0, l1;
    tile_params(t, g, s0, s1, l0, l1);
    float* f = floats.data() + g * 32;
    _mm256_storeu_ps(f, s0), _mm256_storeu_ps(f + 8, s1), _mm256_storeu_ps(f + 16, l0), _mm256_storeu_ps(f + 24, l1);
  }
  walk(TileFloatParams{floats.data()});
}

// One part of a layer's output channels (a fused layer's shards of one GGUF type): its quads,
// and its tiles' rows computed by a typed quad_tile_all_rows (bits and parameter form).
struct QuadPart {
  const uint8_t* q;
  int64_t tiles, tile_bytes, group;
  std::function<void(const Q8Rows&, const uint8_t* qt, int64_t t, int64_t m_lo, int64_t m_hi, float* tot,
                     const uint8_t* next, int64_t next_bytes)>
      rows;
};

QuadPart quad_part(const at::Tensor& q, const at::Tensor& sz, int64_t K) {
  const int bits = static_cast<int>(4 + (q.size(2) - 256) / 64);
  QuadPart part{q.data_ptr<uint8_t>(), q.size(0), 0, 0, {}};
  with_bits_params(sz, K, bits, [&](const auto& params, int64_t groups) {
    using P = std::decay_t<decltype(params)>;
    part.group = K / groups;
    auto bind = [&](auto width) {
      constexpr int Bits = decltype(width)::value;
      part.tile_bytes = (K / 32) * BitQuads<Bits>::kBlockBytes;
      part.rows = [params, group = part.group](const Q8Rows& a, const uint8_t* qt, int64_t t, int64_t m_lo,
                                               int64_t m_hi, float* tot, const uint8_t* next, int64_t next_bytes) {
        quad_tile_all_rows<Bits, P>(a, qt, t, params, group, m_lo, m_hi, tot, next, next_bytes);
      };
    };
    if (bits == 4) bind(std::integral_constant<int, 4>{});
    else if (bits == 5) bind(std::integral_constant<int, 5>{});
    else bind(std::integral_constant<int, 6>{});
  });
  return part;
}

// y (M, N) = the parts' channels side by side, each part's tiles after the previous part's.
// Threads take runs of tiles of about equal bytes (a fused qkv's 6-bit v tiles are 1.5x its
// 4-bit q tiles), each walked once per chunk of rows.
void bits_q8_parts_run(const at::Tensor& xf, const std::vector<QuadPart>& parts, const float* bias, at::Tensor& y) {
  bool need16 = false, need32 = false;
  int64_t total_tiles = 0, total_bytes = 0;
  for (const QuadPart& p : parts) {
    need16 |= p.group == 16, need32 |= p.group == 32;
    total_tiles += p.tiles, total_bytes += p.tiles * p.tile_bytes;
  }
  const Q8Rows a = q8_rows(xf, need16, need32);
  const int64_t M = a.M, K = a.K;
  // The first tile (part, tile in it) that starts at or after byte `b` of the parts laid end to
  // end; (parts, 0) past the last. Each tile has one such pair, so threads' ranges compare.
  auto tile_at = [&](int64_t b) {
    size_t i = 0;
    for (int64_t off = 0; i < parts.size(); off += parts[i].tiles * parts[i].tile_bytes, ++i) {
      const int64_t tb = parts[i].tile_bytes;
      if (b <= off + (parts[i].tiles - 1) * tb) return std::pair<size_t, int64_t>{i, (std::max<int64_t>(b - off, 0) + tb - 1) / tb};
    }
    return std::pair<size_t, int64_t>{i, 0};
  };
  const TileOut out(y, bias, total_tiles * kTile);
  const int64_t chunk_rows = PAGEDSERVE_ROW_CHUNK_BYTES <= 0 ? M
      : std::max<int64_t>(kQuadRows, PAGEDSERVE_ROW_CHUNK_BYTES / K / kQuadRows * kQuadRows);
  // At least 32 KiB of weights a thread (the single-part op's old tile grain).
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total_bytes >> 15));
  at::parallel_for(0, threads, 1, [&](int64_t i0, int64_t i1) {
    // This thread's tiles: those starting in its share of the bytes.
    const auto first = tile_at(total_bytes * i0 / threads), end = tile_at(total_bytes * i1 / threads);
    if (first == end) return;
    std::vector<float> tot(std::min(M, chunk_rows) * kTile);
    for (int64_t m_lo = 0; m_lo < M; m_lo += chunk_rows) {
      const int64_t m_hi = std::min(M, m_lo + chunk_rows);
      int64_t t = 0;  // the global tile of (i, local): the parts before i, then local
      for (size_t i = 0; i < first.first; ++i) t += parts[i].tiles;
      t += first.second;
      for (auto [i, local] = first; std::make_pair(i, local) < end; ++t) {
        const QuadPart& p = parts[i];
        const uint8_t* qt = p.q + local * p.tile_bytes;
        // the next tile in this part, or the next part's first (past the end: a harmless prefetch)
        const bool last = local + 1 == p.tiles && i + 1 < parts.size();
        const uint8_t* next = last ? parts[i + 1].q : qt + p.tile_bytes;
        const int64_t next_bytes = last ? parts[i + 1].tile_bytes : p.tile_bytes;
        p.rows(a, qt, local, m_lo, m_hi, tot.data(), next, next_bytes);
        out.store(tot.data(), m_hi - m_lo, t, m_lo);
        if (++local == p.tiles) ++i, local = 0;
      }
    }
  });
}

#else  // no AVX2: the kernels are never reached (run_grouped refuses first); these keep the ops compiling

template <class Param, bool Affine>
void int8_grouped_impl(const at::Tensor&, const at::Tensor&, const at::Tensor&, const float*, at::Tensor&) {}
void int4_grouped_run(const at::Tensor&, const at::Tensor&, const at::Tensor&, int, const float*, at::Tensor&) {}
void int8_q8_impl(const at::Tensor&, const at::Tensor&, const at::Tensor&, const float*, at::Tensor&) {}
struct QuadPart {};
QuadPart quad_part(const at::Tensor&, const at::Tensor&, int64_t) { return {}; }
void bits_q8_parts_run(const at::Tensor&, const std::vector<QuadPart>&, const float*, at::Tensor&) {}

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
#if PAGEDSERVE_DENSE_DPBF16
  if (x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16) {
    dense_dpbf16(x.contiguous(), reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(0), b, y);
    return y;
  }
#endif
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

// ---- a sparse MoE layer's experts in one call ------------------------------------------------
//
// x (T, H), each token's k experts `ids` (T, k) and router weights (T, k) ->
//   out[t] = sum over its pairs, in ascending expert order, of w * down_e(silu(gate_e x) * up_e x)
// with every expert's weights in stacked pair tiles: gu (E, 2I/16, H/2, 16, 2) (rows | gate | up |)
// and down (E, H/16, I/2, 16, 2). The arithmetic of FusedMoE's per-expert path (gemv_dense,
// silu_and_mul, gemv_dense, a weighted index_add_), each result rounded to x's dtype where that
// path's would be; what it saves is that path's ~3 dispatches and 2 parallel regions per expert:
// a batch-16 step of a 64-expert layer runs ~56 experts, ~170 calls a layer.

#if defined(PAGEDSERVE_AVX2)
// The pairs of one expert, rows [first, first + rows) of the expert-sorted order.
struct ExpertRows {
  int64_t expert, first, rows;
};

// y[first..] (rows x N) = xin[first..] (rows x K) times expert e's tiles, for every group: one
// parallel region over every (group, tile), each a stretch of one expert's weight.
template <class Elem>
void experts_gemv(const at::Tensor& xin, const Elem* w, int64_t tiles, const std::vector<ExpertRows>& groups,
                  at::Tensor& y) {
  const int64_t K = xin.size(1), N = tiles * kTile, tile_elems = K * kTile;
  const bool bf16_out = y.scalar_type() == at::kBFloat16;
  auto* yf = bf16_out ? nullptr : y.data_ptr<float>();
  auto* yb = bf16_out ? reinterpret_cast<c10::BFloat16*>(y.data_ptr()) : nullptr;
  const int64_t items = static_cast<int64_t>(groups.size()) * tiles;
  const int64_t grain = std::max<int64_t>(1, (int64_t{32} << 10) / (tile_elems * static_cast<int64_t>(sizeof(Elem))));
#if PAGEDSERVE_DENSE_DPBF16
  const bool dpbf16 = std::is_same_v<Elem, uint16_t> && xin.scalar_type() == at::kBFloat16;
#else
  const bool dpbf16 = false;
#endif
  const at::Tensor xf = dpbf16 ? xin : x_as_float(xin, false).contiguous();
  at::parallel_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    float sums[kMaxRows * kTile];
    for (int64_t i = i0; i < i1; ++i) {
      const ExpertRows& g = groups[i / tiles];
      const int64_t t = i % tiles;
      const Elem* wt = w + (g.expert * tiles + t) * tile_elems;
#if PAGEDSERVE_DENSE_DPBF16
      if constexpr (std::is_same_v<Elem, uint16_t>) {
        if (dpbf16) {
          const auto* xp = reinterpret_cast<const uint32_t*>(xf.data_ptr()) + g.first * (K / 2);
          dpbf16_tile(xp, g.rows, K / 2, wt, sums);
        }
      }
#endif
      if (!dpbf16) {
        const float* xd = xf.data_ptr<float>() + g.first * K;
        if constexpr (std::is_same_v<Elem, float>) tile_all_rows(xd, g.rows, K, LoadF32{wt}, sums);
        else tile_all_rows(xd, g.rows, K, LoadBF16{wt}, sums);
      }
      const TileOut out(yf ? yf + g.first * N : nullptr, yb ? yb + g.first * N : nullptr, N);
      out.store(sums, g.rows, t);
    }
  });
}

template <class T>
void moe_combine(const at::Tensor& ys, const std::vector<int64_t>& order, int64_t k, const at::Tensor& weights,
                 at::Tensor& out) {
  const int64_t H = ys.size(1);
  const T* yd = ys.data_ptr<T>();
  const T* wd = weights.data_ptr<T>();
  T* od = out.data_ptr<T>();
  // Sorted pair i adds to its token's row: pairs of one token come in ascending expert order,
  // as the per-expert path's index_add_ adds them; each product and sum rounded to T as there.
  at::parallel_for(0, H, std::max<int64_t>(16, H / 8), [&](int64_t c0, int64_t c1) {
    for (size_t i = 0; i < order.size(); ++i) {
      const float w = pagedserve::to_f(wd[order[i]]);
      T* o = od + (order[i] / k) * H;
      const T* y = yd + static_cast<int64_t>(i) * H;
      for (int64_t c = c0; c < c1; ++c) {
        const float product = pagedserve::to_f(pagedserve::from_f<T>(pagedserve::to_f(y[c]) * w));
        o[c] = pagedserve::from_f<T>(pagedserve::to_f(o[c]) + product);
      }
    }
  });
}

#endif

at::Tensor gemv_moe(const at::Tensor& x_in, const at::Tensor& gu, const at::Tensor& down, const at::Tensor& ids,
                    const at::Tensor& weights) {
  const at::Tensor x = rows_view(x_in, "gemv_moe").contiguous();
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "gemv_moe: x must be float32 or bfloat16");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(T <= kMaxRows, "gemv_moe: at most ", kMaxRows, " rows");
  TORCH_CHECK(gu.dim() == 5 && gu.is_contiguous() && gu.size(2) * 2 == H && gu.size(3) == kTile && gu.size(4) == 2 &&
                  gu.size(1) % 2 == 0,
              "gemv_moe: gu must be contiguous stacked pair tiles (E, 2I/16, H/2, 16, 2)");
  const int64_t E = gu.size(0), I = gu.size(1) * kTile / 2;
  TORCH_CHECK(down.dim() == 5 && down.is_contiguous() && down.size(0) == E && down.size(1) * kTile == H &&
                  down.size(2) * 2 == I && down.size(3) == kTile && down.size(4) == 2,
              "gemv_moe: down must be contiguous stacked pair tiles (E, H/16, I/2, 16, 2)");
  TORCH_CHECK(gu.scalar_type() == down.scalar_type() &&
                  (gu.scalar_type() == at::kFloat || gu.scalar_type() == at::kBFloat16),
              "gemv_moe: gu and down must be both float32 or both bfloat16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == T && ids.scalar_type() == at::kLong, "gemv_moe: ids must be int64 (T, k)");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == x.scalar_type(),
              "gemv_moe: weights must be (T, k) in x's dtype");
  at::Tensor out = at::zeros({T, H}, x.options());
#if defined(PAGEDSERVE_AVX2)
  const int64_t k = ids.size(1), P = T * k;
  if (P == 0) return out.view(out_shape(x_in, H));
  const at::Tensor id = ids.contiguous(), wt = weights.contiguous();
  const int64_t* idp = id.data_ptr<int64_t>();
  // A counting sort by expert, pairs in token order within one: a stable argsort's order.
  std::vector<int64_t> start(E + 1, 0), order(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "gemv_moe: expert id ", idp[p], " out of range [0, ", E, ")");
    ++start[idp[p] + 1];
  }
  std::vector<ExpertRows> groups;
  for (int64_t e = 0; e < E; ++e) {
    if (start[e + 1]) groups.push_back({e, start[e], start[e + 1]});
    start[e + 1] += start[e];
  }
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) order[next[idp[p]]++] = p;
  at::Tensor xs = at::empty({P, H}, x.options());
  const int64_t row_bytes = H * static_cast<int64_t>(x.element_size());
  for (int64_t i = 0; i < P; ++i)
    std::memcpy(static_cast<char*>(xs.data_ptr()) + i * row_bytes,
                static_cast<const char*>(x.data_ptr()) + (order[i] / k) * row_bytes, row_bytes);
  at::Tensor h = at::empty({P, 2 * I}, x.options()), a = at::empty({P, I}, x.options());
  at::Tensor ys = at::empty({P, H}, x.options());
  const bool bf16_w = gu.scalar_type() == at::kBFloat16;
  auto run = [&](const at::Tensor& xin, const at::Tensor& w, at::Tensor& y) {
    if (bf16_w) experts_gemv(xin, reinterpret_cast<const uint16_t*>(w.data_ptr()), w.size(1), groups, y);
    else experts_gemv(xin, w.data_ptr<float>(), w.size(1), groups, y);
  };
  run(xs, gu, h);
  auto silu_mul = [&](auto tag) {  // h = [gate | up] per row -> a
    using T = decltype(tag);
    const T* hd = reinterpret_cast<const T*>(h.data_ptr());
    T* ad = reinterpret_cast<T*>(a.data_ptr());
    at::parallel_for(0, P, pagedserve::grain_rows(2 * I), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) pagedserve::silu_mul_row(hd + r * 2 * I, hd + r * 2 * I + I, ad + r * I, I);
    });
  };
  if (x.scalar_type() == at::kBFloat16) silu_mul(c10::BFloat16{});
  else silu_mul(float{});
  run(a, down, ys);
  if (x.scalar_type() == at::kBFloat16) moe_combine<c10::BFloat16>(ys, order, k, wt, out);
  else moe_combine<float>(ys, order, k, wt, out);
#else
  TORCH_CHECK(false, "gemv_moe: this build has no AVX2/FMA support");
#endif
  return out.view(out_shape(x_in, H));
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

// Checks shared by the grouped ops, whatever their weight layout: x float32 or bfloat16; `scales`
// (tiles, G, ...) contiguous, with G dividing K into groups that are multiples of `multiple`
// (32 for int8 activations' blocks; 16 for the channel-tile ops: Q6_K's sub-blocks); bias (N,).
void check_x_scales_bias(const at::Tensor& x, int64_t tiles, const at::Tensor& scales,
                         const c10::optional<at::Tensor>& bias, const char* op, int64_t multiple = 32) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16");
  TORCH_CHECK(scales.is_contiguous() && scales.dim() >= 2 && scales.size(0) == tiles && scales.size(1) > 0 &&
                  x.size(1) % scales.size(1) == 0 && (x.size(1) / scales.size(1)) % multiple == 0,
              op, ": scales must be contiguous (N/16, K/group, ...) with group a multiple of ", multiple);
  TORCH_CHECK(!bias.has_value() || bias->numel() == tiles * kTile, op, ": bias must have N elements");
}

// The channel-tile ops (int8 and int4 grouped): q (N/16, K, bytes_per_k).
// Groups: multiples of 32 columns (pagedserve's own methods), or of 16 for the GGUF forms'
// float16 / float32 parameters (`multiple`; Q6_K's sub-blocks).
void check_grouped(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                   int64_t bytes_per_k, const c10::optional<at::Tensor>& bias, const char* op,
                   int64_t multiple = 32) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(1) == x.size(1) && q.size(2) == bytes_per_k, op,
              ": q must be contiguous channel tiles (N/16, K, ", bytes_per_k, ") with K = x.size(-1)");
  check_x_scales_bias(x, q.size(0), scales, bias, op, multiple);
}

// The group-wise ops' common run: y (x's rows, 16 * tiles) in x's dtype; impl(x as contiguous
// float32, the bias as float32 or nullptr, y) fills it.
template <class Impl>
at::Tensor run_grouped(const at::Tensor& x_in, const at::Tensor& x, int64_t tiles,
                       const c10::optional<at::Tensor>& bias, const char* op, Impl impl) {
  at::Tensor y = at::empty(out_shape(x_in, tiles * kTile), x.options());
#if defined(PAGEDSERVE_AVX2)
  if (x.size(0) == 0) return y;
  at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  impl(x_as_float(x, false).contiguous(), bf.defined() ? bf.data_ptr<float>() : nullptr, y);
#else
  TORCH_CHECK(false, op, ": this build has no AVX2/FMA support");
#endif
  return y;
}

// Super-block parameters (KParams, KPackedParams): uint8 (N/16, K/256, B), B = 80 + 32 G
// (affine), 32 + 16 G (centered) or 256 (packed, G = 8), G groups of 256 / G >= 16 k a super-block.
// Returns G.
int64_t check_bits_superblocks(int64_t K, int64_t tiles, const at::Tensor& sz, const char* op) {
  const SuperLayout layout = super_layout(sz.dim() == 3 ? sz.size(2) : 0);
  TORCH_CHECK(sz.is_contiguous() && sz.dim() == 3 && sz.size(0) == tiles && K % 256 == 0 && sz.size(1) == K / 256 &&
                  layout.form != SuperForm::kInvalid,
              op, ": super-block parameters must be contiguous uint8 (N/16, K/256, 80 + 32 G, 32 + 16 G or 256), "
              "G in 1..16 dividing 256");
  return layout.groups;
}

// The int8 layouts' scales: (N/16, K/group, 16) float16.
void check_int8_scales(const at::Tensor& scale, const char* op) {
  TORCH_CHECK(scale.scalar_type() == at::kHalf && scale.dim() == 3 && scale.size(2) == kTile, op,
              ": scale must be (N/16, K/group, 16) float16");
}

at::Tensor gemv_int8_grouped(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                             const c10::optional<at::Tensor>& bias) {
  const char* op = "gemv_int8_grouped";
  const at::Tensor x = rows_view(x_in, op);
  const bool affine = scale.dim() == 4;
  check_grouped(x, q, scale, kTile, bias, op, affine ? 16 : 32);
  TORCH_CHECK(q.scalar_type() == at::kChar, op, ": q must be int8");
  TORCH_CHECK((scale.scalar_type() == at::kHalf && scale.dim() == 3 && scale.size(2) == kTile) ||
                  (scale.scalar_type() == at::kFloat && affine && scale.size(2) == 2 && scale.size(3) == kTile),
              op, ": scale must be (N/16, K/group, 16) float16, or (N/16, K/group, 2, 16) float32 (s, l0)");
  return run_grouped(x_in, x, q.size(0), bias, op, [&](const at::Tensor& xf, const float* bd, at::Tensor& y) {
    if (affine)
      int8_grouped_impl<float, true>(xf, q, scale, bd, y);
    else
      int8_grouped_impl<c10::Half, false>(xf, q, scale, bd, y);
  });
}

at::Tensor gemv_int8_q8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale,
                        const c10::optional<at::Tensor>& bias) {
  const char* op = "gemv_int8_q8";
  const at::Tensor x = rows_view(x_in, op);
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 4 && q.is_contiguous() && q.size(1) * 4 == x.size(1) &&
                  q.size(2) == kTile && q.size(3) == 4,
              op, ": q must be contiguous int8 quad tiles (N/16, K/4, 16, 4) with K = x.size(-1)");
  check_x_scales_bias(x, q.size(0), scale, bias, op);
  check_int8_scales(scale, op);
  return run_grouped(x_in, x, q.size(0), bias, op, [&](const at::Tensor& xf, const float* bd, at::Tensor& y) {
    int8_q8_impl(xf, q, scale, bd, y);
  });
}

at::Tensor gemv_int4_grouped(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scales_zeros,
                             const c10::optional<at::Tensor>& bias) {
  const char* op = "gemv_int4_grouped";
  const at::Tensor x = rows_view(x_in, op);
  // Bytes per k of a tile: 8 (4-bit), 10 (5-bit) or 12 (6-bit: ChanBits).
  const int64_t bytes_per_k = q.dim() == 3 ? q.size(2) : 0;
  TORCH_CHECK(bytes_per_k == 8 || bytes_per_k == 10 || bytes_per_k == 12, op,
              ": q must be channel tiles (N/16, K, 8), or (N/16, K, 10 / 12) for 5 / 6 bits");
  const int bits = static_cast<int>(4 + (bytes_per_k - 8) / 2);
  const auto kind = scales_zeros.scalar_type();
  check_grouped(x, q, scales_zeros, bytes_per_k, bias, op, kind == at::kBFloat16 ? 32 : 16);
  TORCH_CHECK(q.scalar_type() == at::kByte, op, ": q must be uint8");
  const bool centered = scales_zeros.dim() == 3;
  if (kind == at::kByte) {
    check_bits_superblocks(x.size(1), q.size(0), scales_zeros, op);
  } else {
    TORCH_CHECK(centered ? (kind == at::kHalf || kind == at::kFloat) && scales_zeros.size(2) == kTile
                         : (kind == at::kHalf || kind == at::kFloat || (kind == at::kBFloat16 && bits == 4)) &&
                               scales_zeros.dim() == 4 && scales_zeros.size(2) == 2 && scales_zeros.size(3) == kTile,
                op, ": scales_zeros must be (N/16, K/group, 2, 16) bfloat16 (scale, zero; 4 bits), float16 (d, m) "
                "or float32 (s, l0), or (N/16, K/group, 16) float16 / float32 scales of q - 2^(bits-1), or uint8 "
                "super-block parameters (N/16, K/256, 80 + 32 G or 32 + 16 G)");
  }
  return run_grouped(x_in, x, q.size(0), bias, op, [&](const at::Tensor& xf, const float* bd, at::Tensor& y) {
    int4_grouped_run(xf, q, scales_zeros, bits, bd, y);
  });
}

// 4 / 5 / 6-bit bit quads x int8 activations (quad_tile_rows): q (N/16, K/32, 256 / 320 / 384)
// uint8, parameters as gemv_int4_grouped's 5- / 6-bit forms (groups of 16 or 32 k). Any number
// of rows: a prefill's many rows reuse each unpacked weight vector kQuadRows times, so the
// op serves prefill as well as decode steps.
void check_bit_quads(const at::Tensor& x, const at::Tensor& q, const at::Tensor& params, const char* op) {
  const int64_t K = x.size(1), B = q.dim() == 3 ? q.size(2) : 0;
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous() && (B == 256 || B == 320 || B == 384) &&
                  K % 32 == 0 && q.size(1) * 32 == K,
              op, ": q must be contiguous uint8 bit quads (N/16, K/32, 256 / 320 / 384) with K = x.size(-1)");
  const int bits = static_cast<int>(4 + (B - 256) / 64);
  const auto kind = params.scalar_type();
  check_x_scales_bias(x, q.size(0), params, std::nullopt, op, 16);  // the bias: the parts' total (the caller)
  if (kind == at::kByte) {
    const int64_t G = check_bits_superblocks(K, q.size(0), params, op);
    TORCH_CHECK(G == 8 || G == 16, op, ": super-block parameters need groups of 32 or 16 k");
  } else {
    const int64_t group = K / params.size(1);
    TORCH_CHECK(group == 16 || group == 32, op, ": groups of 16 or 32 k, got ", group);
    const bool centered = params.dim() == 3;
    TORCH_CHECK(centered ? (kind == at::kHalf || kind == at::kFloat) && params.size(2) == kTile
                         : (kind == at::kHalf || kind == at::kFloat || (kind == at::kBFloat16 && bits == 4)) &&
                               params.dim() == 4 && params.size(2) == 2 && params.size(3) == kTile,
                op, ": parameters as gemv_int4_grouped's (pairs, centered scales or super-block bytes)");
  }
}

// The parts side by side: y[..., part i's channels] = x W_i^T, x quantized once for all.
at::Tensor bits_q8_parts(const at::Tensor& x_in, at::TensorList qs, at::TensorList params,
                         const c10::optional<at::Tensor>& bias, const char* op) {
  TORCH_CHECK(x_in.dim() >= 1, op, ": x must have a last (K) dimension");
  TORCH_CHECK(!qs.empty() && qs.size() == params.size(), op, ": one parameter tensor per part of q, at least one");
  const at::Tensor x = x_in.reshape({-1, x_in.size(-1)}).contiguous();
  const int64_t K = x.size(1);
  int64_t tiles = 0;
  for (size_t i = 0; i < qs.size(); ++i) {
    check_bit_quads(x, qs[i], params[i], op);
    tiles += qs[i].size(0);
  }
  TORCH_CHECK(!bias.has_value() || bias->numel() == tiles * kTile, op, ": bias must have N elements");
  at::Tensor y = at::empty(out_shape(x_in, tiles * kTile), x.options());
#if defined(PAGEDSERVE_AVX2)
  if (x.size(0) == 0) return y;
  at::Tensor bf = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  std::vector<QuadPart> parts;
  for (size_t i = 0; i < qs.size(); ++i) parts.push_back(quad_part(qs[i], params[i], K));
  bits_q8_parts_run(x_as_float(x, false).contiguous(), parts, bf.defined() ? bf.data_ptr<float>() : nullptr, y);
#else
  TORCH_CHECK(false, op, ": this build has no AVX2/FMA support");
#endif
  return y;
}

at::Tensor gemv_bits_q8(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& params,
                        const c10::optional<at::Tensor>& bias) {
  return bits_q8_parts(x_in, {q}, {params}, bias, "gemv_bits_q8");
}

// A fused layer whose shards have different GGUF types (a Q4_K_M file's qkv: q, k Q4_K and v
// Q6_K), each part in its own bits and parameter form: the file's bytes, where one layout for
// all would store q and k in v's 6 bits.
at::Tensor gemv_bits_q8_parts(const at::Tensor& x_in, at::TensorList qs, at::TensorList params,
                              const c10::optional<at::Tensor>& bias) {
  return bits_q8_parts(x_in, qs, params, bias, "gemv_bits_q8_parts");
}

// W^T (K, N) float32 of the GEMV ops' channel tiles: int8 (N/16, K, 16) with float16 scales or
// float32 (s, l0) pairs; uint8 4 / 5 / 6-bit tiles with (d, m) / (s, l0) pairs or centered scales.
at::Tensor gemv_dequant_tiles(const at::Tensor& q, const at::Tensor& sz) {
  const char* op = "gemv_dequant_tiles";
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && sz.is_contiguous() && sz.dim() >= 3 && sz.size(0) == q.size(0) &&
                  sz.size(1) > 0 && q.size(1) % sz.size(1) == 0 && (q.size(1) / sz.size(1)) % 16 == 0,
              op, ": q (N/16, K, bytes) and parameters (N/16, K/group, ...) contiguous, groups of 16 k or more");
  at::Tensor wt = at::empty({q.size(1), q.size(0) * kTile}, q.options().dtype(at::kFloat));
#if defined(PAGEDSERVE_AVX2)
  const auto kind = sz.scalar_type();
  const bool centered = sz.dim() == 3;
  if (q.scalar_type() == at::kChar) {
    TORCH_CHECK(sz.size(-1) == kTile && (centered || sz.size(2) == 2), op, ": parameters (.., 16) or (.., 2, 16)");
    TORCH_CHECK((centered && kind == at::kHalf) || (!centered && kind == at::kFloat), op,
                ": int8 tiles take float16 scales or float32 (s, l0) pairs");
    const int64_t groups = sz.size(1);
    if (centered)
      dequant_tiles_impl<ChanI8>(q, groups, DenseParams<c10::Half, true>{sz.data_ptr<c10::Half>(), groups, 0.0f}, wt);
    else
      dequant_tiles_impl<ChanI8>(q, groups, DenseParams<float, false>{sz.data_ptr<float>(), groups, 0.0f}, wt);
    return wt;
  }
  const int64_t nbytes = q.size(2);
  TORCH_CHECK(q.scalar_type() == at::kByte && (nbytes == 8 || nbytes == 10 || nbytes == 12), op,
              ": uint8 tiles of 8, 10 or 12 bytes per k");
  const int bits = static_cast<int>(4 + (nbytes - 8) / 2);
  if (kind == at::kByte) {
    check_bits_superblocks(q.size(1), q.size(0), sz, op);
  } else {
    TORCH_CHECK(sz.size(-1) == kTile && (centered || sz.size(2) == 2), op, ": parameters (.., 16) or (.., 2, 16)");
    TORCH_CHECK(kind == at::kHalf || kind == at::kFloat || (kind == at::kBFloat16 && bits == 4 && !centered), op,
                ": parameters float16 / float32 (bfloat16: 4-bit pairs)");
  }
  with_bits_load(bits, [&](auto load) {
    using L = decltype(load);
    with_bits_params(sz, q.size(1), bits, [&](const auto& params, int64_t groups) {
      dequant_tiles_impl<L>(q, groups, params, wt);
    });
  });
#else
  TORCH_CHECK(false, op, ": this build has no AVX2/FMA support");
#endif
  return wt;
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
  m.def("gemv_int8_grouped(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
  m.def("gemv_int4_grouped(Tensor x, Tensor q, Tensor scales_zeros, Tensor? bias) -> Tensor");
  m.def("gemv_int8_q8(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor");
  m.def("gemv_bits_q8(Tensor x, Tensor q, Tensor params, Tensor? bias) -> Tensor");
  m.def("gemv_bits_q8_parts(Tensor x, Tensor[] q, Tensor[] params, Tensor? bias) -> Tensor");
  m.def("gemv_dequant_tiles(Tensor q, Tensor scales) -> Tensor");
  m.def("gemv_moe(Tensor x, Tensor gu, Tensor down, Tensor ids, Tensor weights) -> Tensor");
  m.def("available() -> bool", &available);
  m.def("max_rows() -> int", &max_rows);
  m.impl("gemv_dense", c10::DispatchKey::CPU, &gemv_dense);
  m.impl("gemv_int8", c10::DispatchKey::CPU, &gemv_int8);
  m.impl("gemv_int8_grouped", c10::DispatchKey::CPU, &gemv_int8_grouped);
  m.impl("gemv_int4_grouped", c10::DispatchKey::CPU, &gemv_int4_grouped);
  m.impl("gemv_int8_q8", c10::DispatchKey::CPU, &gemv_int8_q8);
  m.impl("gemv_bits_q8", c10::DispatchKey::CPU, &gemv_bits_q8);
  m.impl("gemv_bits_q8_parts", c10::DispatchKey::CPU, &gemv_bits_q8_parts);
  m.impl("gemv_dequant_tiles", c10::DispatchKey::CPU, &gemv_dequant_tiles);
  m.impl("gemv_moe", c10::DispatchKey::CPU, &gemv_moe);
}
