// Fused paged attention for CPU: reads K/V blocks in place through the block table (no
// gather), online softmax (flash-decoding style) so every K/V row is read once, all query
// heads of a KV head processed together (GQA), decode and causal prefill chunks in one call.
//
// Layouts (row-major, see pagedserve/attention/metadata.py):
//   query      (T, H, D)            tokens may be strided (a view of the fused QKV output);
//                                   heads and head_dim contiguous
//   key, value (T, KVH, D)          the step's new tokens, same rule
//   kv_cache   (2, NB, BS, KVH, D)  flat slot s = block * BS + offset;
//                                   K row of (s, h) at  cache + (s * KVH + h) * D
//                                   V row of (s, h) at  cache + (NB * BS + s) * KVH * D + h * D
//   out        (T, H, D)            contiguous; query head h uses KV head h / G (G = H / KVH)
//   block_tables (S, MB) int32, seq_lens (S) int32, q_start (S + 1) int32
//   items (N, 6) int32, one work item per row (built once per step in cpp_paged.py):
//       seq, q_begin, q_end   query tokens [q_begin, q_end) of request `seq` (request-relative)
//       kv_begin, kv_end      key positions attended (absolute; a decode may be split in parts)
//       part                  -1: write `out`; else index of an unnormalised partial result
//   merges (M, 3) int32: seq, first_part, num_parts — decodes split over several items.
//
// A task is (item, group of KV heads). Items come sorted by cost (longest first) and are
// handed out dynamically, so mixed context lengths balance across threads (LPT order).
//
// Inner loops, per KV head and tile of KT keys, rows in blocks of up to 3 (a GQA group's
// rows share every K / V load; accumulators stay in registers):
//   scores  S[r, j] = q_r . k_j        4 keys x 3 rows at a time, reduced by a transpose-add
//   softmax m_r, l_r updated online; p = exp(S - m_r) (vectorised polynomial exp)
//   values  acc_r = acc_r * alpha_r + sum_j p[r, j] v_j   (4 vectors of the row per pass)
// Rows r are (query token t, head g of the group): r = t * G + g. The next tile's K/V is
// prefetched a few lines at a time through both phases: a burst fills the miss buffers and
// the core stalls on them (decode x256: 19.8 -> 16.2 ms with blocks and spread prefetch).
// head_dim not a multiple of 4 vectors takes the one-row loops (dot_keys / pv_rows).
//
// Sliding window W (paged_attention_windowed): key j is visible to a query at i iff
// i - W < j <= i. Tiles before the window of an item's first query are never read (a windowed
// KV group's table holds the null block there); inside a tile each row masks the keys before
// its own window start. Softcap c: valid scores s -> c * tanh(s / c) before the softmax.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "pagedserve_common.h"

namespace {

using pagedserve::bf16;
// Keys per tile: a multiple of every vector width below. 16 and 64 measured the same.
constexpr int KT = 32;
// Prefetch distance in tiles. 1 measured best (2-3: ~25% slower decode, polluting L1/L2).
constexpr int kPrefetchTiles = 1;
// Blocked rows (dot_block / pv_block below); 0 builds the one-row loops everywhere (A/B).
#ifndef PAGEDSERVE_ATTN_ROW_BLOCKS
#define PAGEDSERVE_ATTN_ROW_BLOCKS 1
#endif
constexpr int kTileBufs = kPrefetchTiles + 1;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The SIMD structs (one per ISA, same static interface) are pagedserve_common.h's.
using pagedserve::VecBest;
using pagedserve::VecScalar;
#if defined(PAGEDSERVE_AVX512)
using pagedserve::Vec512;
#endif
#if defined(PAGEDSERVE_AVX2)
using pagedserve::Vec256;
#endif

// ---- per-call constants and per-thread scratch ------------------------------------------

template <class T>
struct Params {
  const T* query;
  int64_t q_stride;  // elements between consecutive query tokens
  const T* k_cache;  // kv_cache[0]
  const T* v_cache;  // kv_cache[1]
  T* out;
  int H, KVH, D, G, BS;
  float scale;
  int window;       // key j visible to a query at i iff i - window < j <= i; 0 = no window
  float softcap;    // scores s -> softcap * tanh(s / softcap); 0 = none
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* q_start;
  float* part_acc;  // (num_parts, H, D) unnormalised partial outputs
  float* part_ml;   // (num_parts, H, 2) running max and sum of each partial
};

struct Item {
  int seq, q_begin, q_end, kv_begin, kv_end, part;
};

// Scratch of one thread; rows = (query tokens of an item) x G, per KV head of the task.
template <class T>
struct Scratch {
  std::vector<float> q, acc, m, l, alpha, s;
  std::vector<T> zero_row;
  const T* tok_k[kTileBufs][KT];  // K row of head 0 of each key, ring of tiles
  const T* tok_v[kTileBufs][KT];
  Scratch(int state_rows, int max_rows, int D)
      : q(size_t(state_rows) * D), acc(size_t(state_rows) * D), m(state_rows), l(state_rows),
        alpha(state_rows), s(size_t(max_rows) * KT), zero_row(D, T(0.f)) {}
};

// ---- the three inner kernels ------------------------------------------------------------

// s[j] = q . k[j] for j < V::W (missing keys point at a zero row).
template <class V, class T>
inline void dot_keys(const float* q, const T* const* k, int D, float* s) {
  typename V::R acc[V::W];
  for (int j = 0; j < V::W; ++j) acc[j] = V::zero();
  for (int c = 0; c < D; c += V::W) {
    typename V::R qv = V::load(q + c);
    for (int j = 0; j < V::W; ++j) acc[j] = V::fma(qv, V::load(k[j] + c), acc[j]);
  }
  V::store(s, V::reduce(acc));
}

// acc[r] = acc[r] * alpha[r] + sum_{j < n} p[r, j] * v[j], for RB rows held in registers.
// U keys per step give RB * U independent FMA chains (one chain per row would wait on the
// FMA latency). p is zero and v a zero row past the valid keys, so n may round up to U.
template <class V, class T, int RB>
inline void pv_rows(float* acc, const float* alpha, const float* p, const T* const* v, int n,
                    int D) {
  using R = typename V::R;
  constexpr int U = V::kUnroll;
  n = std::min(KT, (n + U - 1) / U * U);
  for (int c = 0; c < D; c += V::W) {
    R a[U][RB];
    for (int r = 0; r < RB; ++r) {
      a[0][r] = V::mul(V::load(acc + r * D + c), V::set1(alpha[r]));
      for (int u = 1; u < U; ++u) a[u][r] = V::zero();
    }
    for (int j = 0; j < n; j += U) {
      for (int u = 0; u < U; ++u) {
        const R vv = V::load(v[j + u] + c);
        for (int r = 0; r < RB; ++r) a[u][r] = V::fma(V::set1(p[r * KT + j + u]), vv, a[u][r]);
      }
    }
    for (int r = 0; r < RB; ++r) {
      for (int u = 1; u < U; ++u) a[0][r] = V::add(a[0][r], a[u][r]);
      V::store(acc + r * D + c, a[0][r]);
    }
  }
}

template <class V, class T>
inline void pv_all(float* acc, const float* alpha, const float* p, const T* const* v, int n,
                   int rows, int D) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) pv_rows<V, T, 4>(acc + r * D, alpha + r, p + r * KT, v, n, D);
  switch (rows - r) {
    case 3: pv_rows<V, T, 3>(acc + r * D, alpha + r, p + r * KT, v, n, D); break;
    case 2: pv_rows<V, T, 2>(acc + r * D, alpha + r, p + r * KT, v, n, D); break;
    case 1: pv_rows<V, T, 1>(acc + r * D, alpha + r, p + r * KT, v, n, D); break;
    default: break;
  }
}

// Blocks of RB query rows: each K / V vector loaded once for the block's rows (a GQA group
// shares its KV head), accumulators in registers (RB * KB and RB * CB of them).
// s[r * KT + j] = q_r . k[j] for r < RB, j < KB (missing keys point at a zero row).
template <class V, class T, int RB, int KB>
inline void dot_block(const float* q, const T* const* k, int D, float* s) {
  using R = typename V::R;
  constexpr int F = (RB * KB + V::W - 1) / V::W * V::W;  // reduced in groups of W vectors
  R acc[F];
  for (int i = 0; i < F; ++i) acc[i] = V::zero();
  for (int c = 0; c < D; c += V::W) {
    R qv[RB];
    for (int r = 0; r < RB; ++r) qv[r] = V::load(q + r * D + c);
    for (int j = 0; j < KB; ++j) {
      const R kv = V::load(k[j] + c);
      for (int r = 0; r < RB; ++r) acc[r * KB + j] = V::fma(qv[r], kv, acc[r * KB + j]);
    }
  }
  alignas(64) float out[F];
  for (int i = 0; i < F; i += V::W) V::store(out + i, V::reduce(acc + i));
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < KB; ++j) s[r * KT + j] = out[r * KB + j];
}

// acc[r] = acc[r] * alpha[r] + sum_{j < n} p[r, j] * v[j] for RB rows, CB vectors of D at a time.
template <class V, class T, int RB, int CB, class Step>
inline void pv_block(float* acc, const float* alpha, const float* p, const T* const* v, int n,
                     int D, Step&& step) {
  using R = typename V::R;
  for (int c0 = 0; c0 < D; c0 += CB * V::W) {
    R a[RB][CB];
    for (int r = 0; r < RB; ++r) {
      const R al = V::set1(alpha[r]);
      for (int b = 0; b < CB; ++b) a[r][b] = V::mul(V::load(acc + r * D + c0 + b * V::W), al);
    }
    for (int j = 0; j < n; ++j) {
      step();
      R pr[RB];
      for (int r = 0; r < RB; ++r) pr[r] = V::set1(p[r * KT + j]);
      for (int b = 0; b < CB; ++b) {
        const R vv = V::load(v[j] + c0 + b * V::W);
        for (int r = 0; r < RB; ++r) a[r][b] = V::fma(pr[r], vv, a[r][b]);
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int b = 0; b < CB; ++b) V::store(acc + r * D + c0 + b * V::W, a[r][b]);
  }
}

// Online-softmax step of row r over its valid scores [lo, nv) (lo < nv): turns s into p,
// rescales l, returns alpha (the factor by which the old accumulator shrinks). A softcap
// caps the valid scores first (the scale is already in the query, as torch's scores*scale).
template <class V>
inline float softmax_row(float* s, int lo, int nv, float& m, float& l, float softcap) {
  using R = typename V::R;
  if (softcap > 0.f) {
    const float inv = 1.f / softcap;
    for (int j = lo; j < nv; ++j) s[j] = softcap * std::tanh(s[j] * inv);
  }
  for (int j = 0; j < lo; ++j) s[j] = kNegInf;  // before the row's window
  for (int j = nv; j < KT; ++j) s[j] = kNegInf;  // masked keys (causal / past the tile end)
  R mx = V::load(s);
  for (int j = V::W; j < KT; j += V::W) mx = V::max_(mx, V::load(s + j));
  const float m_new = std::max(m, V::hmax(mx));
  const float alpha = std::exp(m - m_new);  // m = -inf on the first tile: alpha = 0
  const R mv = V::set1(m_new);
  R sum = V::zero();
  for (int j = 0; j < KT; j += V::W) {
    const R e = V::exp(V::sub(V::load(s + j), mv));  // masked: ~1e-38, zeroed below
    sum = V::add(sum, e);
    V::store(s + j, e);
  }
  for (int j = 0; j < lo; ++j) s[j] = 0.f;
  for (int j = nv; j < KT; ++j) s[j] = 0.f;
  m = m_new;
  l = l * alpha + V::hsum(sum);
  return alpha;
}

// Software prefetch of the next tile, spread over the current tile's dot products so the
// loads of this tile keep issuing (a burst of prefetches fills the miss buffers and stalls
// the core). Block ids are shuffled, so hardware prefetchers cannot run ahead across blocks.
// Rows are prefetched in address order (token-major over the task's heads), which keeps the
// L2 stream prefetcher engaged inside each 4 KiB page.
template <class T>
struct PrefetchQueue {
  const T* const* k = nullptr;  // head-0 K/V rows of the next tile's keys
  const T* const* v = nullptr;
  int64_t head_off = 0;         // element offset of the first head to fetch in a row
  int first = 0, last = 0;      // keys [first, last) of the next tile
  int bytes = 0;                // bytes per key row (heads x head_dim)
  int off = 0;

  int lines() const { return (last - first) * ((bytes + 63) / 64); }
  template <class V>
  void step(int n) {
    for (; n > 0 && first < last; --n) {
      V::prefetch(reinterpret_cast<const char*>(k[first] + head_off) + off);
      V::prefetch(reinterpret_cast<const char*>(v[first] + head_off) + off);
      if ((off += 64) >= bytes) off = 0, ++first;
    }
  }
};

// First key of the tile (index from j0) inside the window of the query at position pos.
template <class T>
inline int window_lo(const Params<T>& P, int pos, int j0) {
  return P.window > 0 ? std::max(0, pos - P.window + 1 - j0) : 0;
}

// Rows [r0, r0 + RB) of one tile: scores, online softmax, then (by the caller) values.
template <class V, class T, int RB, int KB>
inline void score_block(const Params<T>& P, Scratch<T>& S, const T* const* kp, int n, int j0,
                        int pos0, int r0, const float* q, float* m, float* l, int quota,
                        PrefetchQueue<T>& pf, int& max_nv) {
  int nv[RB], bmax = 0;
  for (int r = 0; r < RB; ++r) bmax = std::max(bmax, nv[r] = std::min(n, pos0 + (r0 + r) / P.G - j0 + 1));
  float* s = S.s.data() + size_t(r0) * KT;
  if (bmax > 0) {
    const int nk = std::min(KT, (bmax + KB - 1) / KB * KB);
    for (int jb = 0; jb < nk; jb += KB) {
      pf.template step<V>(quota);
      dot_block<V, T, RB, KB>(q + size_t(r0) * P.D, kp + jb, P.D, s + jb);
    }
  }
  for (int r = 0; r < RB; ++r) {
    const int lo = window_lo(P, pos0 + (r0 + r) / P.G, j0);
    if (nv[r] <= lo) {  // whole tile in this row's future or before its window: no change
      S.alpha[r0 + r] = 1.f;
      std::fill(s + r * KT, s + (r + 1) * KT, 0.f);
      continue;
    }
    S.alpha[r0 + r] = softmax_row<V>(s + r * KT, lo, nv[r], m[r0 + r], l[r0 + r], P.softcap);
  }
  max_nv = std::max(max_nv, bmax);
}

// One tile of n keys starting at absolute position j0, one KV head.
// Rows r = t * G + g; token t sits at absolute position pos0 + t and sees keys <= it.
template <class V, class T>
void attend_tile(const Params<T>& P, Scratch<T>& S, const T* const* kp, const T* const* vp,
                 int n, int j0, int pos0, int rows, float* q, float* acc, float* m, float* l,
                 PrefetchQueue<T>& pf) {
  const int D = P.D;
  int max_nv = 0;
#if PAGEDSERVE_ATTN_ROW_BLOCKS
  if (D % (4 * V::W) == 0) {
    // Next-tile prefetches spread over both phases (a burst fills the miss buffers and stalls).
    const int dot_calls = (rows / 3) * (KT / 4) + (rows % 3 == 2) * (KT / 4) + (rows % 3 == 1) * (KT / 8);
    const int quota = (pf.lines() / 2 + dot_calls - 1) / dot_calls;
    int r = 0;
    for (; r + 3 <= rows; r += 3) score_block<V, T, 3, 4>(P, S, kp, n, j0, pos0, r, q, m, l, quota, pf, max_nv);
    if (rows - r == 2) score_block<V, T, 2, 4>(P, S, kp, n, j0, pos0, r, q, m, l, quota, pf, max_nv);
    if (rows - r == 1) score_block<V, T, 1, 8>(P, S, kp, n, j0, pos0, r, q, m, l, quota, pf, max_nv);
    if (max_nv == 0) {
      pf.template step<V>(1 << 30);
      return;
    }
    const int passes = ((rows + 2) / 3) * (D / (4 * V::W));
    const int pv_quota = (pf.lines() + passes * max_nv - 1) / (passes * max_nv);
    auto step = [&] { pf.template step<V>(pv_quota); };
    const float* p = S.s.data();
    const float* alpha = S.alpha.data();
    for (r = 0; r + 3 <= rows; r += 3)
      pv_block<V, T, 3, 4>(acc + size_t(r) * D, alpha + r, p + r * KT, vp, max_nv, D, step);
    if (rows - r == 2) pv_block<V, T, 2, 4>(acc + size_t(r) * D, alpha + r, p + r * KT, vp, max_nv, D, step);
    if (rows - r == 1) pv_block<V, T, 1, 4>(acc + size_t(r) * D, alpha + r, p + r * KT, vp, max_nv, D, step);
    pf.template step<V>(1 << 30);
    return;
  }
#endif
  const int calls = rows * ((n + V::W - 1) / V::W);
  const int quota = (pf.lines() + calls - 1) / calls;
  for (int r = 0; r < rows; ++r) {
    float* s = S.s.data() + size_t(r) * KT;
    const int nv = std::min(n, pos0 + r / P.G - j0 + 1);
    const int lo = window_lo(P, pos0 + r / P.G, j0);
    if (nv <= lo) {  // whole tile in this row's future or before its window: no change
      S.alpha[r] = 1.f;
      std::fill(s, s + KT, 0.f);
      continue;
    }
    for (int jb = 0; jb < nv; jb += V::W) {
      pf.template step<V>(quota);
      dot_keys<V, T>(q + size_t(r) * D, kp + jb, D, s + jb);
    }
    S.alpha[r] = softmax_row<V>(s, lo, nv, m[r], l[r], P.softcap);
    max_nv = std::max(max_nv, nv);
  }
  pf.template step<V>(1 << 30);
  if (max_nv > 0) pv_all<V, T>(acc, S.alpha.data(), S.s.data(), vp, max_nv, rows, D);
}

// ---- one task: an item and a range of KV heads ------------------------------------------

// Head-0 K/V row pointers of keys [j0, j0 + n) of request `seq` (block-table walk: one
// division per tile, not per key).
template <class T>
inline void tile_rows(const Params<T>& P, Scratch<T>& S, int buf, int seq, int j0, int n) {
  const int32_t* bt = P.block_tables + int64_t(seq) * P.bt_stride;
  const int64_t row = int64_t(P.KVH) * P.D;
  int b = j0 / P.BS, off = j0 % P.BS;
  for (int j = 0; j < n; ++j) {
    const int64_t s = int64_t(bt[b]) * P.BS + off;
    S.tok_k[buf][j] = P.k_cache + s * row;
    S.tok_v[buf][j] = P.v_cache + s * row;
    if (++off == P.BS) off = 0, ++b;
  }
}

// Scaled fp32 copy of the item's query rows of KV head h: row t * G + g <- query head h*G+g.
template <class T>
inline void load_queries(const Params<T>& P, const Item& it, int h, float* q) {
  const int q0 = P.q_start[it.seq] + it.q_begin;
  for (int t = 0; t < it.q_end - it.q_begin; ++t) {
    const T* src = P.query + int64_t(q0 + t) * P.q_stride + int64_t(h) * P.G * P.D;
    float* dst = q + int64_t(t) * P.G * P.D;
    for (int i = 0; i < P.G * P.D; ++i) dst[i] = static_cast<float>(src[i]) * P.scale;
  }
}

// Final rows of head h: normalised into `out`, or raw (acc, m, l) into partial slot `part`.
template <class T>
inline void store_rows(const Params<T>& P, const Item& it, int h, const float* acc,
                       const float* m, const float* l) {
  const int G = P.G, D = P.D;
  if (it.part >= 0) {
    float* pa = P.part_acc + (int64_t(it.part) * P.H + int64_t(h) * G) * D;
    float* pm = P.part_ml + (int64_t(it.part) * P.H + int64_t(h) * G) * 2;
    std::memcpy(pa, acc, sizeof(float) * G * D);
    for (int g = 0; g < G; ++g) pm[2 * g] = m[g], pm[2 * g + 1] = l[g];
    return;
  }
  const int q0 = P.q_start[it.seq] + it.q_begin;
  for (int r = 0; r < (it.q_end - it.q_begin) * G; ++r) {
    const float inv = 1.f / l[r];
    T* dst = P.out + (int64_t(q0 + r / G) * P.H + int64_t(h) * G + r % G) * D;
    for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(acc[int64_t(r) * D + i] * inv);
  }
}

template <class V, class T>
void run_task(const Params<T>& P, Scratch<T>& S, const Item& it, int h0, int h1) {
  const int G = P.G, D = P.D;
  const int nq = it.q_end - it.q_begin, rows = nq * G;
  const int seq_len = P.seq_lens[it.seq];
  const int q_len = P.q_start[it.seq + 1] - P.q_start[it.seq];
  const int pos0 = seq_len - q_len + it.q_begin;  // absolute position of the first query
  const int kv_end = std::min(it.kv_end, pos0 + nq);
  // Whole tiles before the window of the item's first query are skipped: keys there may sit
  // in the null block (given back), and must never be read, not even multiplied by p = 0.
  const int kv_begin = P.window > 0 ? std::max(it.kv_begin, pos0 - P.window + 1) : it.kv_begin;
  // Decode: all heads of the task advance together tile by tile, so a token's K/V rows of
  // those heads are read together. Prefill (many rows): one head at a time.
  const int hstep = nq == 1 ? h1 - h0 : 1;
  for (int hb = h0; hb < h1; hb += hstep) {
    const int nh = std::min(hstep, h1 - hb);
    for (int i = 0; i < nh; ++i) {
      load_queries(P, it, hb + i, S.q.data() + size_t(i) * rows * D);
      std::fill_n(S.acc.data() + size_t(i) * rows * D, size_t(rows) * D, 0.f);
      std::fill_n(S.m.data() + i * rows, rows, kNegInf);
      std::fill_n(S.l.data() + i * rows, rows, 0.f);
    }
    auto tile_len = [&](int t) { return std::max(0, std::min(KT, kv_end - kv_begin - t * KT)); };
    for (int t = 0; t < kPrefetchTiles; ++t)
      if (tile_len(t) > 0) tile_rows(P, S, t % kTileBufs, it.seq, kv_begin + t * KT, tile_len(t));
    for (int t = 0, j0 = kv_begin; j0 < kv_end; ++t, j0 += KT) {
      const int buf = t % kTileBufs, n = tile_len(t);
      const int tp = t + kPrefetchTiles, np = tile_len(tp), pbuf = tp % kTileBufs;
      if (np > 0) tile_rows(P, S, pbuf, it.seq, kv_begin + tp * KT, np);
      const T* kp[KT];
      const T* vp[KT];
      for (int i = 0; i < nh; ++i) {
        const int64_t off = int64_t(hb + i) * D;
        for (int j = 0; j < KT; ++j) {
          kp[j] = j < n ? S.tok_k[buf][j] + off : S.zero_row.data();
          vp[j] = j < n ? S.tok_v[buf][j] + off : S.zero_row.data();
        }
        // While head i runs, prefetch its share (1/nh) of a later tile's keys, every head.
        PrefetchQueue<T> pf{S.tok_k[pbuf], S.tok_v[pbuf], int64_t(hb) * D,
                            i * np / nh, (i + 1) * np / nh, nh * D * int(sizeof(T))};
        const size_t o = size_t(i) * rows;
        attend_tile<V, T>(P, S, kp, vp, n, j0, pos0, rows, S.q.data() + o * D,
                          S.acc.data() + o * D, S.m.data() + o, S.l.data() + o, pf);
      }
    }
    for (int i = 0; i < nh; ++i) {
      const size_t o = size_t(i) * rows;
      store_rows(P, it, hb + i, S.acc.data() + o * D, S.m.data() + o, S.l.data() + o);
    }
  }
}

// Combine the partial results of decodes split over several items (log-sum-exp merge).
template <class T>
void merge_parts(const Params<T>& P, const int32_t* merges, int64_t num_merges) {
  const int H = P.H, D = P.D;
  at::parallel_for(0, num_merges * H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t w = begin; w < end; ++w) {
      const int32_t* mg = merges + (w / H) * 3;
      const int h = int(w % H), first = mg[1], count = mg[2];
      float m = kNegInf, l = 0.f;
      for (int p = first; p < first + count; ++p) m = std::max(m, P.part_ml[(int64_t(p) * H + h) * 2]);
      std::fill(o.begin(), o.end(), 0.f);
      for (int p = first; p < first + count; ++p) {
        const float* ml = P.part_ml + (int64_t(p) * H + h) * 2;
        const float wgt = std::exp(ml[0] - m);
        l += wgt * ml[1];
        const float* a = P.part_acc + (int64_t(p) * H + h) * D;
        for (int i = 0; i < D; ++i) o[i] += wgt * a[i];
      }
      T* dst = P.out + (int64_t(P.q_start[mg[0]]) * H + h) * D;
      for (int i = 0; i < D; ++i) dst[i] = static_cast<T>(o[i] / l);
    }
  });
}

template <class V, class T>
void run_all(const Params<T>& P, const Item* items, int64_t num_items, int hpt, int max_q) {
  const int groups = (P.KVH + hpt - 1) / hpt;
  const int64_t tasks = num_items * groups;
  const int state_rows = std::max(max_q, hpt) * P.G, max_rows = max_q * P.G;
  if (tasks == 0) return;
  const int threads = pagedserve::region_threads(tasks);
#pragma omp parallel num_threads(threads)
  {
    Scratch<T> S(state_rows, max_rows, P.D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const Item& it = items[t / groups];
      const int h0 = int(t % groups) * hpt;
      run_task<V, T>(P, S, it, h0, std::min(P.KVH, h0 + hpt));
    }
  }
}

// ---- ops --------------------------------------------------------------------------------

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              name, " must be (tokens, heads, head_dim) with contiguous heads");
}

template <class T>
void dispatch(const Params<T>& P, const at::Tensor& items, int hpt, int max_q) {
  const Item* it = reinterpret_cast<const Item*>(items.data_ptr<int32_t>());
  const int64_t n = items.size(0);
#if !defined(PAGEDSERVE_AVX512) && !defined(PAGEDSERVE_AVX2)
  run_all<VecScalar, T>(P, it, n, hpt, max_q);
#else
  if (P.D % VecBest::W == 0) {
    run_all<VecBest, T>(P, it, n, hpt, max_q);
  } else {
    run_all<VecScalar, T>(P, it, n, hpt, max_q);
  }
#endif
}

template <class T>
void paged_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& q_start, const at::Tensor& items,
                          const at::Tensor& merges, double scale, int64_t heads_per_task,
                          int64_t num_parts, int64_t max_q, int64_t window, double softcap) {
  const int H = int(query.size(1)), D = int(query.size(2));
  const int KVH = int(kv_cache.size(3)), BS = int(kv_cache.size(2));
  const int64_t half = kv_cache.size(1) * BS * KVH * D;
  at::Tensor part_acc, part_ml;
  if (num_parts > 0) {
    part_acc = at::empty({num_parts, H, D}, query.options().dtype(at::kFloat));
    part_ml = at::empty({num_parts, H, 2}, query.options().dtype(at::kFloat));
  }
  Params<T> P{query.data_ptr<T>(), query.stride(0), kv_cache.data_ptr<T>(),
              kv_cache.data_ptr<T>() + half, out.data_ptr<T>(), H, KVH, D, H / KVH, BS,
              float(scale), int(window), float(softcap), block_tables.data_ptr<int32_t>(), block_tables.stride(0),
              seq_lens.data_ptr<int32_t>(), q_start.data_ptr<int32_t>(),
              num_parts > 0 ? part_acc.data_ptr<float>() : nullptr,
              num_parts > 0 ? part_ml.data_ptr<float>() : nullptr};
  const int hpt = int(std::clamp<int64_t>(heads_per_task, 1, KVH));
  dispatch<T>(P, items, hpt, int(std::max<int64_t>(max_q, 1)));
  if (merges.size(0) > 0) merge_parts<T>(P, merges.data_ptr<int32_t>(), merges.size(0));
}

// Work items index raw memory, so check them against the step (O(items + table), cheap).
void check_items(const at::Tensor& items, const at::Tensor& merges, const at::Tensor& seq_lens,
                 const at::Tensor& q_start, const at::Tensor& block_tables, int64_t num_blocks,
                 int64_t block_size, int64_t num_parts, int64_t max_q, int64_t num_tokens) {
  const int64_t S = seq_lens.size(0), MB = block_tables.size(1);
  TORCH_CHECK(q_start.size(0) == S + 1 && block_tables.size(0) == S, "metadata sizes disagree");
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qs = q_start.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] >= 0 && qs[S] <= num_tokens, "query_start_loc beyond the query rows");
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < S; ++i) {
    const int64_t q_len = qs[i + 1] - qs[i], used = (sl[i] + block_size - 1) / block_size;
    TORCH_CHECK(q_len >= 0 && sl[i] >= q_len && used <= MB, "bad seq_lens / query_start_loc");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t blk = bt[i * block_tables.stride(0) + b];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id out of range");
    }
  }
  const Item* it = reinterpret_cast<const Item*>(items.data_ptr<int32_t>());
  for (int64_t i = 0; i < items.size(0); ++i) {
    const Item& w = it[i];
    TORCH_CHECK(w.seq >= 0 && w.seq < S, "item: bad seq");
    TORCH_CHECK(0 <= w.q_begin && w.q_begin < w.q_end && w.q_end <= qs[w.seq + 1] - qs[w.seq] &&
                    w.q_end - w.q_begin <= max_q, "item: bad query range");
    TORCH_CHECK(0 <= w.kv_begin && w.kv_begin < w.kv_end && w.kv_end <= sl[w.seq], "item: bad keys");
    TORCH_CHECK(w.part < num_parts && (w.part < 0 || w.q_end - w.q_begin == 1), "item: bad part");
  }
  const int32_t* mg = merges.data_ptr<int32_t>();
  for (int64_t i = 0; i < merges.size(0); ++i)
    TORCH_CHECK(mg[3 * i] >= 0 && mg[3 * i] < S && mg[3 * i + 1] >= 0 && mg[3 * i + 2] > 0 &&
                    mg[3 * i + 1] + mg[3 * i + 2] <= num_parts, "bad merge row");
}

// Sliding-window and softcapped layers; `window` 0 / `softcap` 0 = none.
void paged_attention_windowed(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens,
                              const at::Tensor& q_start, const at::Tensor& items,
                              const at::Tensor& merges, double scale, int64_t heads_per_task,
                              int64_t num_parts, int64_t max_q, int64_t window, double softcap) {
  check_rows(query, "query");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0 = none)");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == query.sizes(), "out must be contiguous like query");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous (2, num_blocks, block_size, kv_heads, head_dim)");
  TORCH_CHECK(kv_cache.size(4) == query.size(2) && query.size(1) % kv_cache.size(3) == 0,
              "head_dim / GQA mismatch between query and kv_cache");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and kv_cache must share a dtype");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &q_start, &items, &merges})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1, "index tensors must be int32");
  TORCH_CHECK(items.dim() == 2 && items.size(1) == 6 && items.is_contiguous(), "items must be (N, 6)");
  TORCH_CHECK(merges.dim() == 2 && merges.size(1) == 3 && merges.is_contiguous(), "merges must be (M, 3)");
  check_items(items, merges, seq_lens, q_start, block_tables, kv_cache.size(1), kv_cache.size(2),
              num_parts, max_q, query.size(0));
  if (query.scalar_type() == at::kFloat) {
    paged_attention_impl<float>(out, query, kv_cache, block_tables, seq_lens, q_start, items,
                                merges, scale, heads_per_task, num_parts, max_q, window, softcap);
  } else if (query.scalar_type() == at::kBFloat16) {
    paged_attention_impl<bf16>(out, query, kv_cache, block_tables, seq_lens, q_start, items,
                               merges, scale, heads_per_task, num_parts, max_q, window, softcap);
  } else {
    TORCH_CHECK(false, "paged_attention: only float32 and bfloat16 are supported");
  }
}

// Plain causal attention. Its own op, signature unchanged: the C++ decoder loop
// (decoder_loop_cpu.cpp) calls it through the dispatcher with exactly these arguments.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& q_start, const at::Tensor& items, const at::Tensor& merges,
                     double scale, int64_t heads_per_task, int64_t num_parts, int64_t max_q) {
  paged_attention_windowed(out, query, kv_cache, block_tables, seq_lens, q_start, items, merges,
                           scale, heads_per_task, num_parts, max_q, 0, 0.0);
}

// kv_cache[0/1] at flat slot slot_mapping[i] <- key/value[i] (rows may be strided views).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                       const at::Tensor& slot_mapping) {
  check_rows(key, "key");
  check_rows(value, "value");
  TORCH_CHECK(kv_cache.is_contiguous() && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "bad kv_cache");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "key/value and kv_cache must share a dtype");
  TORCH_CHECK(key.size(1) * key.size(2) == kv_cache.size(3) * kv_cache.size(4), "row size mismatch");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t tokens = key.size(0), esz = key.element_size();
  const int64_t row = key.size(1) * key.size(2), half = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  char* kc = static_cast<char*>(kv_cache.data_ptr());
  char* vc = kc + half * row * esz;
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * esz, vs = value.stride(0) * esz;
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = slots[i];
      TORCH_CHECK(s >= 0 && s < half, "slot out of range");
      std::memcpy(kc + s * row * esz, k + i * ks, row * esz);
      std::memcpy(vc + s * row * esz, v + i * vs, row * esz);
    }
  });
}

// Which SIMD path this build uses (reported by the Python side).
std::string isa() { return pagedserve::isa_name(); }

}  // namespace

TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor q_start, Tensor items, Tensor merges, float scale, "
      "int heads_per_task, int num_parts, int max_q) -> ()");
  m.def(
      "paged_attention_windowed(Tensor(a!) out, Tensor query, Tensor kv_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor q_start, Tensor items, Tensor merges, "
      "float scale, int heads_per_task, int num_parts, int max_q, int window, float softcap) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("isa() -> str", &isa);
  m.impl("paged_attention", c10::DispatchKey::CPU, &paged_attention);
  m.impl("paged_attention_windowed", c10::DispatchKey::CPU, &paged_attention_windowed);
  m.impl("reshape_and_cache", c10::DispatchKey::CPU, &reshape_and_cache);
}
