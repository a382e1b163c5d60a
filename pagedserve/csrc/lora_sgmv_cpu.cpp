// Multi-LoRA "SGMV" for CPU: one call adds every segment's LoRA delta of one (layer, module),
// or of the modules of one fused projection (q/k/v, gate/up), each into its column slice of y:
//
//     y[rows of s, slice m] += scale_sm * (x[rows of s] @ A_sm^T) @ B_sm^T   for each s, m
//
// with the adapters' weights read in place from the paged KV cache (pagedserve/lora/layout.py).
//
// Layouts (offsets count elements of the LoRA dtype W; activations x, y are of dtype T; each
// of T, W is float or bfloat16, in any combination; products accumulate in float32):
//   x          (T_tok, in)   rows may be strided, columns contiguous
//   y          (T_tok, out)  usually a column slice of a wider output (fused qkv / gate_up):
//                            row stride >= out, columns contiguous
//   A_s        (r, in) row-major at storage_a + a_off[s]                 (PEFT's lora_A)
//   B_s        B_s^T in panels of P = 16 output columns at storage_b + b_off[s]:
//
//                panel p = (r, P) row-major = B_s^T[:, p*P : (p+1)*P]   (last panel zero-padded)
//                B_s(o, k) at  (o / P) * P * r  +  k * P  +  o % P      size ceil(out / P) * P * r
//
//   seg_starts (S + 1) int64: segment s = token rows [seg_starts[s], seg_starts[s + 1])
//   a_off, b_off (S) int64, ranks (S) int32 (0 = skip), scales (S) float32; any 1-D stride,
//                or contiguous (..., S) tables; slices = [row, first column, end column] per
//                module: its values are row `row` of the tables, its output y[:, first:end)
//
// Two phases, both in one OpenMP region for all modules (dynamic schedule, a barrier between).
// One call per fused projection rather than per module: on this host even an empty op call
// right after a base GEMM takes 20-35 us (cold dispatch), so 4 calls a layer beat 7.
//   phase 1  tasks (segment, rows, ranks in chunks of 8, several chunks for short segments):
//                                               t[i, k] = scale_s * x_i . A_s[k]   fp32 scratch
//            an "NT" product: RB rows x KB ranks dot products over `in` at once (RB * KB = W
//            FMA chains), reduced to one vector of W sums by a transpose-add tree.
//   phase 2  tasks (segment, rows, columns):   y[i, o:o+W] += sum_k t[i, k] * panel row k
//            broadcast t[i, k], FMA a contiguous panel row: no horizontal sums, one memory
//            stream per panel. (With PEFT's (out, r) row-major B every output needs a dot of
//            length r and a horizontal sum; that measured ~2.5x slower for multi-row segments.)
// Every t and y element is computed by exactly one task, so the SIMD paths give the same bits
// for any thread count (the BLAS paths: as MKL does).
// Segments of >= mm_min_rows tokens and rank >= mm_min_rank compute phase 1 with at::mm (BLAS)
// instead, which packs A (mm_min_rows = 0: never). Float32 segments of >= kMm2MinRows tokens
// (prefill) compute phase 2 with BLAS (phase2_mm), after the region. Ranks are never padded:
// a segment costs what its rank costs.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "pagedserve_common.h"

namespace {

using pagedserve::bf16;

constexpr int kPanel = 16;              // output columns per B panel (a multiple of every W)
constexpr int kRankChunk = 8;           // ranks per phase-1 task
constexpr int kChunk = 512;             // elements of `in` per phase-1 pass (L1 blocking)
constexpr int64_t kTaskMacs = 32768;    // target multiply-adds per task (~1-2 us)
constexpr int64_t kThreadMacs = 65536;  // fewer threads below this much work each (fork ~2 us)
// Phase 2 by BLAS from this many rows, where MKL's addmm_ measured faster than the panel
// kernel (K = rank is small, and y's read-modify-write weighs most). LoRA ms per layer, 7
// projections, 2 threads, SIMD vs BLAS: rank 16 at 128 / 256 / 512 / 2048 rows 0.47 / 1.01 /
// 2.30 / 11.3 vs 0.56 / 0.96 / 1.79 / 6.7; at 384 rows (another run) ranks 8 / 16 / 32 / 64
// gain 6% / 17% / 13% / 6%.
constexpr int kMm2MinRows = 384;

// The SIMD structs (one per ISA, same static interface) are pagedserve_common.h's.
using pagedserve::VecBest;
using pagedserve::VecScalar;
#if defined(PAGEDSERVE_AVX512)
using pagedserve::Vec512;
#endif
#if defined(PAGEDSERVE_AVX2)
using pagedserve::Vec256;
#endif

// ---- phase-1 micro-kernel: RB x KB dot products -----------------------------------------

// out[rb * KB + kb] = u[rb] . w_kb over L elements, w_kb = w0 + min(kb, nk - 1) * ws (rows past
// nk repeat the last one; the caller ignores them). out has V::W floats.
template <class V, int RB, int KB, class T, class W>
inline void dots(const T* const* u, const W* w0, int64_t ws, int nk, int L, float* out) {
  static_assert(RB * KB <= V::W, "RB x KB accumulators must fit one reduce");
  using R = typename V::R;
  const W* w[KB];
  for (int kb = 0; kb < KB; ++kb) w[kb] = w0 + int64_t(std::min(kb, nk - 1)) * ws;
  R acc[V::W];
  for (int i = 0; i < V::W; ++i) acc[i] = V::zero();
  int l = 0;
  for (; l + V::W <= L; l += V::W) {
    R uv[RB];
    for (int rb = 0; rb < RB; ++rb) uv[rb] = V::load(u[rb] + l);
    for (int kb = 0; kb < KB; ++kb) {
      const R wv = V::load(w[kb] + l);
      for (int rb = 0; rb < RB; ++rb) acc[rb * KB + kb] = V::fma(uv[rb], wv, acc[rb * KB + kb]);
    }
  }
  if (l < L) {  // tail: masked loads, zeros past L
    R uv[RB];
    for (int rb = 0; rb < RB; ++rb) uv[rb] = V::load_n(u[rb] + l, L - l);
    for (int kb = 0; kb < KB; ++kb) {
      const R wv = V::load_n(w[kb] + l, L - l);
      for (int rb = 0; rb < RB; ++rb) acc[rb * KB + kb] = V::fma(uv[rb], wv, acc[rb * KB + kb]);
    }
  }
  V::store(out, V::reduce(acc));
}

// `dots` with the smallest power-of-two KB <= W / RB covering nk rows; returns that KB (the
// row stride of `out`). min(nk, KB) rows are done.
template <class V, int RB, int KB, class T, class W>
inline int dots_fit(const T* const* u, const W* w0, int64_t ws, int nk, int L, float* out) {
  if constexpr (KB > 1) {
    if (nk <= KB / 2) return dots_fit<V, RB, KB / 2>(u, w0, ws, nk, L, out);
  }
  dots<V, RB, KB>(u, w0, ws, nk, L, out);
  return KB;
}

// ---- phase-2 micro-kernel: RB rows x U vectors of output columns ------------------------

inline void add_into(float* y, const float* v, int n) {
  for (int i = 0; i < n; ++i) y[i] += v[i];
}
inline void add_into(bf16* y, const float* v, int n) {
  for (int i = 0; i < n; ++i) y[i] = static_cast<bf16>(static_cast<float>(y[i]) + v[i]);
}

// y[rb][c .. c + W) += sum_k t[rb][k] * B(c.., k) for the U vectors c = o + u * W (< out).
// B(c, k) sits at panel(c) + k * kPanel; RB * U independent FMA chains over k.
template <class V, int RB, int U, class W, class T>
inline void panel_block(const float* const* t, int r, const W* b, int o, int out, T* const* y) {
  using R = typename V::R;
  const W* col[U];
  for (int u = 0; u < U; ++u) {
    const int c = o + u * V::W;
    col[u] = b + int64_t(c / kPanel) * kPanel * r + c % kPanel;
  }
  R acc[RB][U];
  for (int rb = 0; rb < RB; ++rb)
    for (int u = 0; u < U; ++u) acc[rb][u] = V::zero();
  for (int k = 0; k < r; ++k) {
    R tv[RB];
    for (int rb = 0; rb < RB; ++rb) tv[rb] = V::set1(t[rb][k]);
    for (int u = 0; u < U; ++u) {
      // The same line of the next group of U panels (a 1-token segment reads each panel once:
      // streams of r lines are too short for the hardware prefetcher; +5-13% GB/s measured.
      // The same prefetch in phase 1 measured nothing: its rows are long).
      __builtin_prefetch(col[u] + int64_t(k) * kPanel + int64_t(U) * V::W * r);
      const R bv = V::load(col[u] + int64_t(k) * kPanel);
      for (int rb = 0; rb < RB; ++rb) acc[rb][u] = V::fma(tv[rb], bv, acc[rb][u]);
    }
  }
  for (int rb = 0; rb < RB; ++rb) {
    for (int u = 0; u < U; ++u) {
      const int c = o + u * V::W;
      if (c + V::W <= out) {
        V::store(y[rb] + c, V::add(V::load(y[rb] + c), acc[rb][u]));
      } else if (c < out) {  // last, partial vector of the row
        alignas(64) float tmp[V::W];
        V::store(tmp, acc[rb][u]);
        add_into(y[rb] + c, tmp, out - c);
      }
    }
  }
}

// ---- tasks ------------------------------------------------------------------------------

// T: activations (x, y); W: the adapters' weights in the pool (the LoRA dtype).
template <class T, class W>
struct Call {
  const T* x;
  int64_t ldx;
  T* y;
  int64_t ldy;
  const W* sa;
  const W* sb;
  int in;
};

struct Seg {
  int64_t row0;    // first token row
  int n, r;        // rows, rank
  int64_t a, b;    // element offsets of A_s, B_s
  float scale;
  int64_t t_off;   // offset of the segment's (n, r) block in the fp32 scratch
  bool mm;         // phase 1 by at::mm
  bool transposed; // phase 1 by phase1_at (AVX-512, float32; see takes_transposed)
  int64_t at_off;  // transposed: offset of the segment's At chunks in the At scratch
  int64_t col;     // first y column of the segment's slice (module)
  int out;         // columns of that slice
  bool mm2 = false;  // phase 2 by BLAS (phase2_mm)
};

struct Task {
  int seg, row0, row1;  // rows of the segment
  int begin, end;       // phase 1: ranks; phase 2: output columns
};

// Rows [i0, i1) in blocks of 4, then 2, then 1 (never more than W per block).
template <class V, class F>
inline void by_rows(int i0, int i1, F f) {
  int i = i0;
  if constexpr (V::W >= 4) {
    for (; i + 4 <= i1; i += 4) f(std::integral_constant<int, 4>{}, i);
  }
  if constexpr (V::W >= 2) {
    for (; i + 2 <= i1; i += 2) f(std::integral_constant<int, 2>{}, i);
  }
  for (; i < i1; ++i) f(std::integral_constant<int, 1>{}, i);
}

// t[i, k] = scale * x_i . A[k] for the task's rows and ranks (kRankChunk at most). `in` is
// cut into chunks of kChunk, outermost, so that the task's A chunk (<= 8 rows x 2 KB) stays
// in L1 while row blocks pass over it. (Unchunked, or 16 ranks per task, in = 2048 measured
// 2-2.5x slower: the A rows, 8 KB apart, all map to the same L1 sets.)
template <class V, class T, class W>
void phase1(const Call<T, W>& C, const Seg& s, const Task& k, float* t) {
  float* ts = t + s.t_off;
  for (int i = k.row0; i < k.row1; ++i) std::fill_n(ts + int64_t(i) * s.r + k.begin, k.end - k.begin, 0.f);
  for (int l0 = 0; l0 < C.in; l0 += kChunk) {
    const int L = std::min(kChunk, C.in - l0);
    by_rows<V>(k.row0, k.row1, [&](auto rb_c, int i) {
      constexpr int RB = decltype(rb_c)::value;
      constexpr int KB = V::W / RB;
      alignas(64) float out[V::W];
      const T* u[RB];
      for (int rb = 0; rb < RB; ++rb) u[rb] = C.x + (s.row0 + i + rb) * C.ldx + l0;
      for (int j = k.begin; j < k.end;) {
        const W* a = C.sa + s.a + int64_t(j) * C.in + l0;
        const int kb_used = dots_fit<V, RB, KB>(u, a, C.in, k.end - j, L, out);
        const int done = std::min(kb_used, k.end - j);
        for (int rb = 0; rb < RB; ++rb)
          for (int kb = 0; kb < done; ++kb) ts[int64_t(i + rb) * s.r + j + kb] += s.scale * out[rb * kb_used + kb];
        j += done;
      }
    });
  }
}

// Columns [o, end) in groups of U vectors, the remainder in halving groups.
template <class V, int RB, int U, class W, class T>
inline void panel_blocks(const float* const* t, int r, const W* b, int o, int end, int out,
                         T* const* y) {
  for (; o + U * V::W <= end; o += U * V::W) panel_block<V, RB, U>(t, r, b, o, out, y);
  if constexpr (U > 1) {
    panel_blocks<V, RB, U / 2>(t, r, b, o, end, out, y);
  } else {
    for (; o < end; o += V::W) panel_block<V, RB, 1>(t, r, b, o, out, y);
  }
}

// y[i, cols] += t_i . B for the task's rows and columns, RB rows x U vectors at a time.
template <class V, class T, class W>
void phase2(const Call<T, W>& C, const Seg& s, const Task& k, const float* t) {
  const float* ts = t + s.t_off;
  const W* b = C.sb + s.b;
  by_rows<V>(k.row0, k.row1, [&](auto rb_c, int i) {
    constexpr int RB = decltype(rb_c)::value;
    // 16 accumulators with 32 vector registers (+5-15% over 8, measured), 8 with 16.
    constexpr int U = (V::W >= 16 ? 16 : 8) / RB;
    const float* tr[RB];
    T* yr[RB];
    for (int rb = 0; rb < RB; ++rb) {
      tr[rb] = ts + int64_t(i + rb) * s.r;
      yr[rb] = C.y + (s.row0 + i + rb) * C.ldy + s.col;
    }
    panel_blocks<V, RB, U>(tr, s.r, b, k.begin, k.end, s.out, yr);
  });
}

// Most rows per task of the transposed path; outside the #if because make_tasks names it on
// every CPU (the path itself is AVX-512 only: without it the build failed on AVX2 machines).
constexpr int kAtRows = 64;
#if defined(PAGEDSERVE_AVX512)
// Phase 1 of a long float32 segment, 16 ranks at a time, without horizontal sums: 16 rows of
// A are transposed into At (in, 16), then each step broadcasts x[i, l] and FMAs one vector
// of 16 ranks, MT rows in flight (the dot-product kernel reduces W sums per 16 dots). The
// transpose is done once per call and segment (phase 0), shared by every task of the segment.
// Shorter segments keep the dot-product kernel, which measured faster there at rank 16; from
// rank 32 the transposed path wins from 32 rows (at 64 rows, rank 64: 0.81 vs 1.07 ms/layer).
constexpr int kAtMinRows = 96;
constexpr int kAtMinRowsHighRank = 32;

template <int MT>
inline void at_rows(const float* const* x, const float* at, int in, float scale, float* const* t) {
  __m512 acc[MT];
  for (int i = 0; i < MT; ++i) acc[i] = _mm512_setzero_ps();
  for (int l = 0; l < in; ++l) {
    const __m512 a = _mm512_loadu_ps(at + int64_t(l) * 16);
    for (int i = 0; i < MT; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(x[i][l]), a, acc[i]);
  }
  const __m512 sv = _mm512_set1_ps(scale);
  for (int i = 0; i < MT; ++i) _mm512_storeu_ps(t[i], _mm512_mul_ps(acc[i], sv));
}

// 16 x 16 float transpose in registers: out[c][i] = r[i][c] (4 shuffle stages, 64 ops for
// 256 elements instead of 256 scalar moves).
inline void transpose16(__m512 (&r)[16]) {
  __m512 a[16], b[16];
  for (int k = 0; k < 8; ++k) {
    a[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    a[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  // b[4m + q], 128-bit lane L: column 4L + q of rows 4m .. 4m + 3.
  for (int m = 0; m < 4; ++m) {
    const __m512d a0 = _mm512_castps_pd(a[4 * m]), a1 = _mm512_castps_pd(a[4 * m + 1]);
    const __m512d a2 = _mm512_castps_pd(a[4 * m + 2]), a3 = _mm512_castps_pd(a[4 * m + 3]);
    b[4 * m + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a0, a2));
    b[4 * m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a0, a2));
    b[4 * m + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(a1, a3));
    b[4 * m + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(a1, a3));
  }
  for (int q = 0; q < 4; ++q) {
    const __m512 c0 = _mm512_shuffle_f32x4(b[q], b[4 + q], 0x88), c1 = _mm512_shuffle_f32x4(b[q], b[4 + q], 0xDD);
    const __m512 d0 = _mm512_shuffle_f32x4(b[8 + q], b[12 + q], 0x88), d1 = _mm512_shuffle_f32x4(b[8 + q], b[12 + q], 0xDD);
    r[q] = _mm512_shuffle_f32x4(c0, d0, 0x88);
    r[8 + q] = _mm512_shuffle_f32x4(c0, d0, 0xDD);
    r[4 + q] = _mm512_shuffle_f32x4(c1, d1, 0x88);
    r[12 + q] = _mm512_shuffle_f32x4(c1, d1, 0xDD);
  }
}

// At (in, 16) of ranks [k.begin, k.begin + 16) of the segment's A, written once per call
// (phase 0) into `at`, which every phase-1 task of those ranks then reads.
template <class W>
void transpose_a(const Call<float, W>& C, const Seg& s, const Task& k, float* at) {
  const W* a = C.sa + s.a + int64_t(k.begin) * C.in;
  for (int l0 = 0; l0 < C.in; l0 += 16) {
    const int n = std::min(16, C.in - l0);
    __m512 r[16];
    for (int j = 0; j < 16; ++j) r[j] = Vec512::load_n(a + int64_t(j) * C.in + l0, n);
    transpose16(r);
    for (int c = 0; c < n; ++c) _mm512_storeu_ps(at + int64_t(l0 + c) * 16, r[c]);
  }
}

template <class W>
void phase1_at(const Call<float, W>& C, const Seg& s, const Task& k, const float* at, float* t) {
  float* ts = t + s.t_off;
  int i = k.row0;
  auto block = [&](auto mt_c) {
    constexpr int MT = decltype(mt_c)::value;
    const float* xr[MT];
    float* tr[MT];
    for (int m = 0; m < MT; ++m) {
      xr[m] = C.x + (s.row0 + i + m) * C.ldx;
      tr[m] = ts + int64_t(i + m) * s.r + k.begin;
    }
    at_rows<MT>(xr, at, C.in, s.scale, tr);
    i += MT;
  };
  while (i + 8 <= k.row1) block(std::integral_constant<int, 8>{});
  if (i + 4 <= k.row1) block(std::integral_constant<int, 4>{});
  if (i + 2 <= k.row1) block(std::integral_constant<int, 2>{});
  if (i < k.row1) block(std::integral_constant<int, 1>{});
}
#endif

// Whether a segment's phase 1 takes phase1_at: AVX-512, float32, ranks in multiples of 16,
// long enough segments (at ranks 32 / 64 and 128-2048 tokens it also took 10-16% less LoRA
// time than BLAS, benchmarks/lora_micro.py shapes).
template <class T>
inline bool takes_transposed(const Seg& g) {
#if defined(PAGEDSERVE_AVX512)
  return std::is_same_v<T, float> && g.r % 16 == 0 &&
         (g.n >= kAtMinRows || (g.r >= 32 && g.n >= kAtMinRowsHighRank));
#else
  return false;
#endif
}

// Rows per task: about kTaskMacs multiply-adds, a multiple of 4 rows (the row block).
inline int rows_per_task(int64_t macs_per_row, int n) {
  const int64_t rows = kTaskMacs / std::max<int64_t>(1, macs_per_row);
  return int(std::min<int64_t>(n, std::max<int64_t>(4, rows / 4 * 4)));
}

// How many ranks (phase 1, unit kRankChunk) or columns (phase 2, unit a multiple of kPanel)
// one task takes: want rounded down to a multiple of unit, clamped to [unit, total].
inline int task_span(int64_t want, int unit, int total) {
  return int(std::clamp<int64_t>(want / unit * unit, std::min(unit, total), total));
}

// Phase-0 tasks (t0: transposes) write a transposed segment's At chunks at its at_off +
// begin * in floats; at_size = the floats all of them need.
void make_tasks(std::vector<Seg>& segs, int in, std::vector<Task>& t0, std::vector<Task>& t1,
                std::vector<Task>& t2, int64_t& at_size) {
  at_size = 0;
  for (int s = 0; s < int(segs.size()); ++s) {
    Seg& g = segs[s];
    const int out = g.out, cols = std::min(out, 256);  // a multiple of kPanel unless it is all of `out`
    if (g.transposed) {
      // About two tasks per thread, 8-64 rows each.
      const int want = (g.n + 2 * at::get_num_threads() - 1) / (2 * at::get_num_threads());
      const int rows = std::clamp((want + 7) / 8 * 8, 8, kAtRows);
      g.at_off = at_size;
      at_size += int64_t(g.r) * in;
      for (int j = 0; j < g.r; j += 16) t0.push_back({s, 0, 0, j, j + 16});
      for (int i = 0; i < g.n; i += rows)
        for (int j = 0; j < g.r; j += 16) t1.push_back({s, i, std::min(g.n, i + rows), j, j + 16});
    } else if (!g.mm) {
      // Short segments (decode: one row per adapter) get several rank chunks per task: with
      // no rows to reuse A over, a task of 8 ranks x 1 row is mostly scheduling overhead.
      const int rp = rows_per_task(int64_t(in) * std::min(g.r, kRankChunk), g.n);
      const int ranks = task_span(kTaskMacs / (int64_t(rp) * in), kRankChunk, g.r);
      for (int i = 0; i < g.n; i += rp)
        for (int j = 0; j < g.r; j += ranks)
          t1.push_back({s, i, std::min(g.n, i + rp), j, std::min(g.r, j + ranks)});
    }
    if (g.mm2) continue;  // phase2_mm, after the region
    // Likewise phase 2: more than `cols` columns per task when the segment is short.
    const int rp = rows_per_task(int64_t(g.r) * cols, g.n);
    const int cols_task = task_span(kTaskMacs / (int64_t(rp) * g.r), cols, out);
    for (int i = 0; i < g.n; i += rp)
      for (int o = 0; o < out; o += cols_task)
        t2.push_back({s, i, std::min(g.n, i + rp), o, std::min(out, o + cols_task)});
  }
}

// Phase 0: the transposes of the task's segment (only float32 segments are transposed).
template <class T, class W>
inline void phase0(const Call<T, W>& C, const Seg& s, const Task& k, float* at) {
#if defined(PAGEDSERVE_AVX512)
  if constexpr (std::is_same_v<T, float>) transpose_a(C, s, k, at + s.at_off + int64_t(k.begin) * C.in);
#endif
}

template <class V, class T, class W>
inline void phase1_any(const Call<T, W>& C, const Seg& s, const Task& k, const float* at, float* t) {
#if defined(PAGEDSERVE_AVX512)
  if constexpr (std::is_same_v<T, float>) {
    if (s.transposed) return phase1_at(C, s, k, at + s.at_off + int64_t(k.begin) * C.in, t);
  }
#endif
  phase1<V>(C, s, k, t);
}

template <class V, class T, class W>
void run(const Call<T, W>& C, std::vector<Seg>& segs, float* t, int64_t macs) {
  std::vector<Task> t0, t1, t2;
  int64_t at_size = 0;
  make_tasks(segs, C.in, t0, t1, t2, at_size);
  static thread_local std::vector<float> at_scratch;  // the transposed segments' At chunks
  if (int64_t(at_scratch.size()) < at_size) at_scratch.resize(at_size);
  float* at = at_scratch.data();
  const int64_t n0 = int64_t(t0.size()), n1 = int64_t(t1.size()), n2 = int64_t(t2.size());
  const int threads = pagedserve::region_threads(std::max(n1, n2), macs, kThreadMacs);
  if (threads <= 1) {
    for (const Task& k : t0) phase0(C, segs[k.seg], k, at);
    for (const Task& k : t1) phase1_any<V>(C, segs[k.seg], k, at, t);
    for (const Task& k : t2) phase2<V>(C, segs[k.seg], k, t);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    if (n0 > 0) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t j = 0; j < n0; ++j) phase0(C, segs[t0[j].seg], t0[j], at);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < n1; ++j) phase1_any<V>(C, segs[t1[j].seg], t1[j], at, t);
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < n2; ++j) phase2<V>(C, segs[t2[j].seg], t2[j], t);
  }
}

// Phase 1 of a long segment by BLAS: t_s = scale * x_s @ A_s^T into the fp32 scratch.
void phase1_mm(const at::Tensor& x, const at::Tensor& sa, const Seg& s, float* t) {
  const int64_t in = x.size(1);
  const at::Tensor a = sa.narrow(0, s.a, int64_t(s.r) * in).view({s.r, in}).to(x.scalar_type());
  at::Tensor ts = at::from_blob(t + s.t_off, {s.n, s.r}, x.options().dtype(at::kFloat));
  ts.copy_(at::mm(x.narrow(0, s.row0, s.n), a.t()));
  ts.mul_(s.scale);
}

// ---- op ---------------------------------------------------------------------------------

inline int64_t padded_out(int64_t out) { return (out + kPanel - 1) / kPanel * kPanel; }

// Phase 2 of a long float32 segment by BLAS: y_s[:, slice] += t_s @ B_s^T, with B_s^T copied
// out of its panels into a dense (r, out) float32 matrix first (r * out elements, small next
// to the n * out of y).
void phase2_mm(at::Tensor& y, const at::Tensor& sb, const Seg& s, const float* t) {
  const int64_t panels = padded_out(s.out) / kPanel;
  at::Tensor bt = sb.narrow(0, s.b, panels * kPanel * s.r)
                      .view({panels, s.r, kPanel})
                      .permute({1, 0, 2})
                      .reshape({s.r, panels * kPanel})
                      .narrow(1, 0, s.out)
                      .to(at::kFloat);
  const at::Tensor ts = at::from_blob(const_cast<float*>(t + s.t_off), {s.n, s.r}, y.options());
  y.narrow(0, s.row0, s.n).narrow(1, s.col, s.out).addmm_(ts, bt);
}

void check_inputs(const at::Tensor& y, const at::Tensor& x, const at::Tensor& sa,
                  const at::Tensor& sb, const at::Tensor& seg_starts) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "y (T, out) and x (T, in) rows differ");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "x and y need contiguous columns");
  TORCH_CHECK(y.stride(0) >= y.size(1) && x.stride(0) >= x.size(1), "x / y rows overlap");
  TORCH_CHECK(sa.dim() == 1 && sb.dim() == 1 && sa.is_contiguous() && sb.is_contiguous(),
              "storage_a / storage_b must be flat contiguous");
  const auto dt = x.scalar_type(), wt = sa.scalar_type();
  TORCH_CHECK(y.scalar_type() == dt && sb.scalar_type() == wt,
              "x and y must share a dtype, and so must storage_a and storage_b");
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && (wt == at::kFloat || wt == at::kBFloat16),
              "lora_sgmv: float32 or bfloat16 activations and weights only");
  TORCH_CHECK(x.device().is_cpu() && y.device().is_cpu(), "lora_sgmv: CPU tensors only");
  TORCH_CHECK(seg_starts.dim() == 1 && seg_starts.numel() >= 1 && seg_starts.scalar_type() == at::kLong,
              "seg_starts must be (S + 1,) int64");
}

// Per-segment values: an (S,) tensor of any stride (row 0), or row `row` of a contiguous
// (..., S) table (the per-step (layers, modules, S) tables, read without Python views).
template <class V>
struct PerSeg {
  const V* p;
  int64_t stride;
  V operator[](int64_t s) const { return p[s * stride]; }
};

template <class V>
PerSeg<V> per_seg(const at::Tensor& t, int64_t S, int64_t row, at::ScalarType type, const char* name) {
  TORCH_CHECK(t.scalar_type() == type, name, " has the wrong dtype (int64 offsets, int32 ranks, float32 scales)");
  if (t.dim() == 1) {
    TORCH_CHECK(t.numel() == S && row == 0, name, " must be (S,) with S = len(seg_starts) - 1");
    return {t.data_ptr<V>(), t.stride(0)};
  }
  TORCH_CHECK(t.is_contiguous() && t.size(-1) == S && row >= 0 && row < t.numel() / std::max<int64_t>(S, 1),
              name, ": a table must be contiguous (..., S) and row in range");
  return {t.data_ptr<V>() + row * S, 1};
}

// Per-(slice, segment) records from the index tensors, bounds-checked (they address raw
// memory). `slices` = [row, first column, end column] per module, columns increasing and
// disjoint (every y element then has one writer).
std::vector<Seg> read_segments(const at::Tensor& x, const at::Tensor& y, const at::Tensor& sa,
                               const at::Tensor& sb, const at::Tensor& seg_starts,
                               const at::Tensor& a_off, const at::Tensor& b_off,
                               const at::Tensor& ranks, const at::Tensor& scales,
                               at::IntArrayRef slices) {
  const int64_t S = seg_starts.numel() - 1, T = x.size(0), in = x.size(1);
  TORCH_CHECK(slices.size() % 3 == 0, "slices must be [row, first column, end column] triples");
  const auto st = seg_starts.accessor<int64_t, 1>();
  for (int64_t s = 0; s < S; ++s)
    TORCH_CHECK(0 <= st[s] && st[s] <= st[s + 1] && st[s + 1] <= T, "segment ", s, ": bad seg_starts");
  std::vector<Seg> segs;
  int64_t prev_end = 0;
  for (size_t j = 0; j < slices.size(); j += 3) {
    const int64_t row = slices[j], col0 = slices[j + 1], col1 = slices[j + 2];
    TORCH_CHECK(prev_end <= col0 && col0 < col1 && col1 <= y.size(1), "slice ", j / 3,
                ": columns [", col0, ", ", col1, ") must lie in y, increasing and disjoint");
    prev_end = col1;
    const int64_t out_p = padded_out(col1 - col0);
    const auto ao = per_seg<int64_t>(a_off, S, row, at::kLong, "a_offsets");
    const auto bo = per_seg<int64_t>(b_off, S, row, at::kLong, "b_offsets");
    const auto rk = per_seg<int32_t>(ranks, S, row, at::kInt, "ranks");
    const auto sc = per_seg<float>(scales, S, row, at::kFloat, "scales");
    for (int64_t s = 0; s < S; ++s) {
      const int64_t r = rk[s], n = st[s + 1] - st[s];
      TORCH_CHECK(r >= 0, "segment ", s, ": negative rank");
      if (r == 0 || n == 0) continue;
      TORCH_CHECK(ao[s] >= 0 && ao[s] + r * in <= sa.numel(), "segment ", s, ": A out of storage_a");
      TORCH_CHECK(bo[s] >= 0 && bo[s] + r * out_p <= sb.numel(), "segment ", s, ": B out of storage_b");
      segs.push_back({st[s], int(n), int(r), ao[s], bo[s], sc[s], 0, false, false, 0, col0, int(col1 - col0)});
    }
  }
  return segs;
}

template <class T, class W>
void sgmv_impl(at::Tensor& y, const at::Tensor& x, const at::Tensor& sa, const at::Tensor& sb,
               std::vector<Seg>& segs, int64_t mm_min_rows, int64_t mm_min_rank) {
  const Call<T, W> C{x.data_ptr<T>(), x.stride(0), y.data_ptr<T>(), y.stride(0),
                     sa.data_ptr<W>(), sb.data_ptr<W>(), int(x.size(1))};
  int64_t t_size = 0, macs = 0;
  for (Seg& s : segs) {
    s.t_off = t_size;
    s.transposed = takes_transposed<T>(s);  // it also beats BLAS where it applies
    s.mm = !s.transposed && mm_min_rows > 0 && s.n >= mm_min_rows && s.r >= mm_min_rank;
    s.mm2 = std::is_same_v<T, float> && s.n >= kMm2MinRows;
    t_size += int64_t(s.n) * s.r;
    macs += int64_t(s.n) * s.r * ((s.mm ? 0 : C.in) + (s.mm2 ? 0 : s.out));
  }
  static thread_local std::vector<float> scratch;  // (rows, rank) blocks of every segment
  if (int64_t(scratch.size()) < t_size) scratch.resize(t_size);
  float* t = scratch.data();
  for (const Seg& s : segs)
    if (s.mm) phase1_mm(x, sa, s, t);
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)
  run<VecBest>(C, segs, t, macs);
#else
  run<VecScalar>(C, segs, t, macs);
#endif
  for (const Seg& s : segs)
    if (s.mm2) phase2_mm(y, sb, s, t);
}

void lora_sgmv(at::Tensor y, const at::Tensor& x, const at::Tensor& storage_a,
               const at::Tensor& storage_b, const at::Tensor& seg_starts, const at::Tensor& a_offsets,
               const at::Tensor& b_offsets, const at::Tensor& ranks, const at::Tensor& scales,
               at::IntArrayRef slices, int64_t mm_min_rows, int64_t mm_min_rank) {
  check_inputs(y, x, storage_a, storage_b, seg_starts);
  std::vector<Seg> segs = read_segments(x, y, storage_a, storage_b, seg_starts, a_offsets, b_offsets,
                                        ranks, scales, slices);
  if (segs.empty()) return;
  const bool x_f32 = x.scalar_type() == at::kFloat, w_f32 = storage_a.scalar_type() == at::kFloat;
  if (x_f32 && w_f32) {
    sgmv_impl<float, float>(y, x, storage_a, storage_b, segs, mm_min_rows, mm_min_rank);
  } else if (x_f32) {
    sgmv_impl<float, bf16>(y, x, storage_a, storage_b, segs, mm_min_rows, mm_min_rank);
  } else if (w_f32) {
    sgmv_impl<bf16, float>(y, x, storage_a, storage_b, segs, mm_min_rows, mm_min_rank);
  } else {
    sgmv_impl<bf16, bf16>(y, x, storage_a, storage_b, segs, mm_min_rows, mm_min_rank);
  }
}

// The base projection by oneDNN with a prepacked weight (pagedserve/quantization/packed.py:
// mkldnn::_linear_pointwise), then every module's LoRA delta added into its output, in one op.
// The separate LoRA call it replaces comes right after the GEMM, when this host makes any op
// call slow: in one op the engine's LoRA cost measured 6.6% against 7.4% (lora.py --parts steps,
// medians of six and five runs).
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& packed_weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& storage_a, const at::Tensor& storage_b, const at::Tensor& seg_starts,
                       const at::Tensor& a_offsets, const at::Tensor& b_offsets, const at::Tensor& ranks,
                       const at::Tensor& scales, at::IntArrayRef slices, int64_t mm_min_rows,
                       int64_t mm_min_rank) {
  static const c10::OperatorHandle linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(packed_weight);
  stack.emplace_back(bias.has_value() ? c10::IValue(*bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  linear.callBoxed(&stack);
  at::Tensor y = stack[0].toTensor();
  lora_sgmv(y, x, storage_a, storage_b, seg_starts, a_offsets, b_offsets, ranks, scales, slices, mm_min_rows,
            mm_min_rank);
  return y;
}

std::string isa() { return pagedserve::isa_name(); }

}  // namespace

TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m) {
  m.def(
      "lora_sgmv(Tensor(a!) y, Tensor x, Tensor storage_a, Tensor storage_b, Tensor seg_starts, "
      "Tensor a_offsets, Tensor b_offsets, Tensor ranks, Tensor scales, int[] slices, "
      "int mm_min_rows, int mm_min_rank) -> ()");
  m.def("isa() -> str", &isa);
  // Any backend: the packed weight is an MkldnnCPU tensor.
  m.def(
      "lora_linear(Tensor x, Tensor packed_weight, Tensor? bias, Tensor storage_a, Tensor storage_b, "
      "Tensor seg_starts, Tensor a_offsets, Tensor b_offsets, Tensor ranks, Tensor scales, int[] slices, "
      "int mm_min_rows, int mm_min_rank) -> Tensor",
      &lora_linear);
  m.impl("lora_sgmv", c10::DispatchKey::CPU, &lora_sgmv);
}
