// Fused elementwise ops of the decoder layer, one pass over memory each, for CPU.
//
// Unfused, each is 5-9 torch ops, every one a full read and write of the activations plus a
// dispatch (~10 us): together ~7% of an offline run of the 125M model. Each op below computes
// the same formula as the torch code it replaces (pagedserve/models/layers/), in the same
// dtype steps, so only float rounding of sums and of exp differs:
//
//   rms_norm(x, w, eps)                   out = w * T(x / sqrt(mean(x^2) + eps))   (float32 math)
//   add_rms_norm(x, residual, w, eps)     s = T(x + residual); returns (rms_norm(s), s)
//   silu_and_mul(x)                       x = [gate | up] -> T(T(silu(gate)) * up)
//   rotary(x, cos, sin)                   x (T, H, D) [x1 | x2] -> [x1 c - x2 s | x2 c + x1 s]
//
// T = float or bfloat16 (the model dtype); rows are split over threads (at::parallel_for).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "pagedserve_common.h"

namespace {

using pagedserve::bf16;
using pagedserve::from_f;
using pagedserve::grain_rows;
using pagedserve::to_f;
#if defined(PAGEDSERVE_AVX2)
using pagedserve::load8;
using pagedserve::round_to;
using pagedserve::store8;
#endif

// Calls f(T{}) with T = float or bfloat16 (the checks already refused other dtypes).
template <class F>
inline void dispatch(at::ScalarType dtype, F f) {
  if (dtype == at::kFloat) f(float{});
  else f(bf16{});
}

// float32 sum of squares over 16 independent lanes (vectorizes without -ffast-math).
template <class T>
inline float sum_squares(const T* x, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = to_f(x[i + j]);
      lanes[j] += v * v;
    }
  for (; i < n; ++i) lanes[i % 16] += to_f(x[i]) * to_f(x[i]);
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += lanes[j];
  return s;
}

template <class T>
inline void norm_row(const T* s, const T* w, float eps, int64_t n, T* out) {
  const float inv = 1.f / std::sqrt(sum_squares(s, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * to_f(from_f<T>(to_f(s[i]) * inv)));
}

void check_dtype(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, what,
              ": float32 or bfloat16 only");
}

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": expected a (rows, cols) tensor with contiguous rows");
  check_dtype(x, what);
}

// out = rms_norm(x + residual) and sum = x + residual, or out = rms_norm(x) when `residual`
// is undefined (then `sum` stays undefined).
std::tuple<at::Tensor, at::Tensor> norm_impl(const at::Tensor& x, const at::Tensor& residual,
                                             const at::Tensor& weight, double eps, const char* what) {
  check_rows(x, what);
  if (residual.defined()) {
    check_rows(residual, what);
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), what,
                ": residual must match x");
  }
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              what, ": weight must be (cols,) in x's dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, n}, x.options());
  at::Tensor sum = residual.defined() ? at::empty({rows, n}, x.options()) : at::Tensor();
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* rd = residual.defined() ? residual.data_ptr<scalar_t>() : nullptr;
    const scalar_t* wd = weight.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    scalar_t* sd = sum.defined() ? sum.data_ptr<scalar_t>() : nullptr;
    const int64_t ldx = x.stride(0), ldr = rd ? residual.stride(0) : 0;
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* src = xd + r * ldx;
        if (rd) {
          scalar_t* s = sd + r * n;
          for (int64_t i = 0; i < n; ++i) s[i] = from_f<scalar_t>(to_f(src[i]) + to_f(rd[r * ldr + i]));
          src = s;
        }
        norm_row(src, wd, static_cast<float>(eps), n, od + r * n);
      }
    });
  });
  return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return std::get<0>(norm_impl(x, at::Tensor(), weight, eps, "rms_norm"));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  return norm_impl(x, residual, weight, eps, "add_rms_norm");
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: the last dim must be even");
  const int64_t rows = x.size(0), n = x.size(1) / 2, ld = x.stride(0);
  at::Tensor out = at::empty({rows, n}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xd = x.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_rows(2 * n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const scalar_t* gate = xd + r * ld;
        pagedserve::silu_mul_row(gate, gate + n, od + r * n, n);
      }
    });
  });
  return out;
}

// x (T, H, D) with any token / head strides and contiguous D; cos, sin (T, D/2) contiguous.
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary: x must be (tokens, heads, head_dim), head_dim contiguous");
  check_dtype(x, "rotary");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T &&
                  cos.size(1) == half && sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin must be contiguous (tokens, head_dim / 2) in x's dtype");
  at::Tensor out = at::empty({T, H, D}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xd = x.data_ptr<scalar_t>();
    const scalar_t* cd = cos.data_ptr<scalar_t>();
    const scalar_t* sd = sin.data_ptr<scalar_t>();
    scalar_t* od = out.data_ptr<scalar_t>();
    const int64_t st = x.stride(0), sh = x.stride(1);
    at::parallel_for(0, T, grain_rows(H * D), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* c = cd + t * half;
        const scalar_t* s = sd + t * half;
        for (int64_t h = 0; h < H; ++h) {
          const scalar_t* x1 = xd + t * st + h * sh;
          const scalar_t* x2 = x1 + half;
          scalar_t* o = od + (t * H + h) * D;
          // Each product rounded to T before the sum, as torch's separate ops do.
          int64_t i = 0;
#if defined(PAGEDSERVE_AVX2)
          for (; i + 8 <= half; i += 8) {
            const __m256 a = load8(x1 + i), b = load8(x2 + i), ci = load8(c + i), si = load8(s + i);
            const scalar_t tag{};
            store8(o + i, _mm256_sub_ps(round_to(tag, _mm256_mul_ps(a, ci)), round_to(tag, _mm256_mul_ps(b, si))));
            store8(o + half + i, _mm256_add_ps(round_to(tag, _mm256_mul_ps(b, ci)), round_to(tag, _mm256_mul_ps(a, si))));
          }
#endif
          for (; i < half; ++i) {
            const float a = to_f(x1[i]), b = to_f(x2[i]), ci = to_f(c[i]), si = to_f(s[i]);
            o[i] = from_f<scalar_t>(to_f(from_f<scalar_t>(a * ci)) - to_f(from_f<scalar_t>(b * si)));
            o[half + i] = from_f<scalar_t>(to_f(from_f<scalar_t>(b * ci)) + to_f(from_f<scalar_t>(a * si)));
          }
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, &rms_norm);
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("silu_and_mul", c10::DispatchKey::CPU, &silu_and_mul);
  m.impl("rotary", c10::DispatchKey::CPU, &rotary);
}
