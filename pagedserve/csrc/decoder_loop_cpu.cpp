// A Llama-family decoder stack for one step in ONE call.
//
// Why: at batch 1 a SmolLM2 token runs ~550 small ops (4 linear layers, 2 norms, rotary, cache
// write, attention and SwiGLU per layer, 30 layers). From Python each costs a dispatch and a
// module call (~10-15 us), ~8 ms a token, as much as the weight reads themselves. This loop
// calls the SAME registered ops (pagedserve_gemv, pagedserve_fused, pagedserve_cpu) through the
// dispatcher from C++, in the same order with the same arguments as the Python layers
// (pagedserve/models/llama.py), so its output is the Python path's bit for bit; only the
// per-op Python cost goes. The Python side (pagedserve/models/decoder_loop.py) decides
// when it may run and flattens the weights once.
//
//   decoder_layers(hidden (T, E), cos, sin (T, D/2), weights, layout, kv_caches, <attention
//                  metadata of the step>, ...) -> (hidden, residual) before the final norm
//
// `weights` lists per layer: input_layernorm.weight, post_attention_layernorm.weight, then for
// each of qkv_proj, o_proj, gate_up_proj, down_proj the tensors of its small-step call and of
// its large-step call; `layout` gives per linear (small op, tensor count, large op, tensor
// count, chunk rows): a step of at most `max_small_rows` tokens makes the small call (a GEMV),
// one of at most `chunk rows` the small call on `max_small_rows` rows at a time (gemv.in_chunks),
// a larger one the large call (oneDNN's packed GEMM or aten::linear, possibly on
// float32-widened operands; op -1 = none: the Python side never sends such a step). Each call's
// tensors are the op's arguments after x, bias last when present (op codes: kLinearOps).

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>
#include <vector>

#include "pagedserve_common.h"

namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<Tensor>;

// The default namespaces of pagedserve/cpp_build.py's PAGED_ATTENTION, FUSED_OPS and GEMV
// kernels (the Python side only enables the loop when the layers use those builds).
constexpr const char* kLinearOps[] = {
    "pagedserve_gemv::gemv_dense",         // 0: (x, w, bias?)
    "pagedserve_gemv::gemv_int8_grouped",  // 1: (x, q, scale, bias?)
    "pagedserve_gemv::gemv_int8_q8",       // 2: (x, q, scale, bias?)
    "pagedserve_gemv::gemv_int4_grouped",  // 3: (x, q, scales_zeros, bias?)
    "aten::linear",                        // 4: (x, w, bias?)
    "mkldnn::_linear_pointwise",           // 5: (x, packed w, bias?), attr "none", as packed.py calls it
    "aten::linear",                        // 6: (x, w, bias?) all widened to float32, y back in x's dtype
    "pagedserve_gemv::gemv_bits_q8",       // 7: (x, q, params, bias?)
    "pagedserve_gemv::gemv_bits_q8_parts",  // 8: (x, q_1 .. q_n, params_1 .. params_n, bias?)
};
constexpr int kNumLinearOps = 9;
constexpr int64_t kMaxCallTensors = 9;  // op 8: up to 4 parts and a bias
constexpr int kLinearsPerLayer = 4;  // qkv_proj, o_proj, gate_up_proj, down_proj
constexpr int kLayoutPerLinear = 5;  // small op, count, large op, count, chunk rows

template <class Fn>
c10::TypedOperatorHandle<Fn> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

// Handles looked up once per process (the op libraries are loaded before the first call).
struct Ops {
  using Dense = Tensor(const Tensor&, const Tensor&, const OptTensor&);
  using Scaled = Tensor(const Tensor&, const Tensor&, const Tensor&, const OptTensor&);
  c10::TypedOperatorHandle<Dense> dense = find_op<Dense>(kLinearOps[0]);
  c10::TypedOperatorHandle<Dense> linear = find_op<Dense>(kLinearOps[4]);
  // Called boxed: its C++ signature (string views, a list of optional scalars) is torch's own.
  c10::OperatorHandle onednn = c10::Dispatcher::singleton().findSchemaOrThrow(kLinearOps[5], "");
  std::array<c10::TypedOperatorHandle<Scaled>, 3> scaled = {
      find_op<Scaled>(kLinearOps[1]), find_op<Scaled>(kLinearOps[2]), find_op<Scaled>(kLinearOps[3])};
  c10::TypedOperatorHandle<Scaled> bits_q8 = find_op<Scaled>(kLinearOps[7]);
  using Parts = Tensor(const Tensor&, at::TensorList, at::TensorList, const OptTensor&);
  c10::TypedOperatorHandle<Parts> bits_q8_parts = find_op<Parts>(kLinearOps[8]);
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, double)> rms_norm =
      find_op<Tensor(const Tensor&, const Tensor&, double)>("pagedserve_fused::rms_norm");
  c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>
      add_rms_norm = find_op<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, double)>(
          "pagedserve_fused::add_rms_norm");
  c10::TypedOperatorHandle<Tensor(const Tensor&)> silu_and_mul =
      find_op<Tensor(const Tensor&)>("pagedserve_fused::silu_and_mul");
  c10::TypedOperatorHandle<Tensor(const Tensor&, const Tensor&, const Tensor&)> rotary =
      find_op<Tensor(const Tensor&, const Tensor&, const Tensor&)>("pagedserve_fused::rotary");
  c10::TypedOperatorHandle<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, const Tensor&, double, int64_t, int64_t, int64_t)>
      paged_attention = find_op<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&, double, int64_t, int64_t,
                                     int64_t)>("pagedserve_cpu::paged_attention");
  c10::TypedOperatorHandle<void(const Tensor&, const Tensor&, Tensor, const Tensor&)> reshape_and_cache =
      find_op<void(const Tensor&, const Tensor&, Tensor, const Tensor&)>("pagedserve_cpu::reshape_and_cache");
};

const Ops& ops() {
  static const Ops instance;
  return instance;
}

// One linear layer's call: the op code and its tensors after x (bias last when present).
struct Linear {
  int64_t op;
  const Tensor* args;
  int64_t count;
  int64_t chunk = 0;  // > 0: x in pieces of this many rows, the results concatenated
};

Tensor run_linear(const Ops& o, const Linear& l, const Tensor& x);

Tensor run_chunked(const Ops& o, const Linear& l, const Tensor& x) {
  Linear one = l;
  one.chunk = 0;
  std::vector<Tensor> parts;
  for (const Tensor& piece : x.split(l.chunk)) parts.push_back(run_linear(o, one, piece));
  return at::cat(parts);
}

Tensor run_linear(const Ops& o, const Linear& l, const Tensor& x) {
  if (l.chunk > 0 && x.size(0) > l.chunk) return run_chunked(o, l, x);
  if (l.op == 8) {  // parts: an even count of q's and params, then the bias if any
    const int64_t n = l.count / 2;
    const OptTensor bias = l.count % 2 ? OptTensor(l.args[l.count - 1]) : std::nullopt;
    return o.bits_q8_parts.call(x, at::TensorList(l.args, n), at::TensorList(l.args + n, n), bias);
  }
  const bool two_operands = l.op == 0 || (l.op >= 4 && l.op <= 6);  // (x, w) vs (x, q, scale)
  const bool has_bias = l.count == (two_operands ? 2 : 3);
  const OptTensor bias = has_bias ? OptTensor(l.args[l.count - 1]) : std::nullopt;
  switch (l.op) {
    case 0: return o.dense.call(x, l.args[0], bias);
    case 4: return o.linear.call(x, l.args[0], bias);
    case 6: {  // packed.py's bf16 GEMM without bf16 instructions: the same ops, in order
      const OptTensor b = bias.has_value() ? OptTensor(bias->to(at::kFloat)) : std::nullopt;
      return o.linear.call(x.to(at::kFloat), l.args[0].to(at::kFloat), b).to(x.scalar_type());
    }
    case 5: {
      torch::jit::Stack stack{x, l.args[0], bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                              c10::IValue("none"), c10::IValue(c10::List<std::optional<c10::Scalar>>()),
                              c10::IValue("")};
      o.onednn.callBoxed(stack);
      return stack[0].toTensor();
    }
    case 7: return o.bits_q8.call(x, l.args[0], l.args[1], bias);
    default: return o.scaled[l.op - 1].call(x, l.args[0], l.args[1], bias);
  }
}

std::tuple<Tensor, Tensor> decoder_layers(
    const Tensor& hidden_in, const Tensor& cos, const Tensor& sin, at::TensorList weights,
    at::IntArrayRef layout, at::TensorList kv_caches, const Tensor& slot_mapping,
    const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc, const Tensor& items,
    const Tensor& merges, int64_t num_parts, int64_t max_q, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t heads_per_task, double scale, double eps, int64_t max_small_rows) {
  const Ops& o = ops();
  const int64_t layers = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(static_cast<int64_t>(layout.size()) == layers * kLinearsPerLayer * kLayoutPerLinear,
              "decoder_layers: layout must hold 2 x (op, tensor count) + chunk rows for 4 linears per layer");
  TORCH_CHECK(hidden_in.dim() == 2, "decoder_layers: hidden must be (tokens, hidden_size)");
  TORCH_CHECK(max_small_rows >= 1, "decoder_layers: max_small_rows must be positive");
  const int64_t tokens = hidden_in.size(0);
  const int64_t h = num_heads, kvh = num_kv_heads, d = head_dim;
  Tensor hidden = hidden_in, residual;
  size_t w = 0;
  for (int64_t layer = 0; layer < layers; ++layer) {
    std::array<Linear, kLinearsPerLayer> linear{};
    TORCH_CHECK(w + 2 <= weights.size(), "decoder_layers: weights end before layer ", layer);
    const Tensor& input_norm = weights[w];
    const Tensor& post_norm = weights[w + 1];
    w += 2;
    for (int i = 0; i < kLinearsPerLayer; ++i) {
      const int64_t* entry = layout.data() + (layer * kLinearsPerLayer + i) * kLayoutPerLinear;
      // The small call, in chunks up to entry[4] rows; the large call beyond.
      const bool chunked = tokens > max_small_rows && tokens <= entry[4];
      const int64_t pick = tokens <= max_small_rows || chunked ? 0 : 2;
      for (int call = 0; call < 4; call += 2) {
        const int64_t op = entry[call], count = entry[call + 1];
        TORCH_CHECK(op < kNumLinearOps && count >= 0 && count <= (op == 8 ? kMaxCallTensors : 3) &&
                        w + count <= weights.size() && (op == 8 ? count >= 2 : op >= 0 ? count >= 1 : count == 0),
                    "decoder_layers: bad layout entry for layer ", layer, " linear ", i);
        if (call == pick) {
          TORCH_CHECK(op >= 0, "decoder_layers: layer ", layer, " linear ", i, " has no call for ", tokens, " rows");
          linear[i] = Linear{op, weights.data() + w, count, chunked ? max_small_rows : 0};
        }
        w += static_cast<size_t>(count);
      }
    }
    // input_layernorm (the first layer starts the residual stream)
    if (layer == 0) {
      residual = hidden;
      hidden = o.rms_norm.call(hidden, input_norm, eps);
    } else {
      std::tie(hidden, residual) = o.add_rms_norm.call(hidden, residual, input_norm, eps);
    }
    // self_attn: qkv -> rotary over q and k together -> cache write -> paged attention -> o_proj
    const Tensor qkv = run_linear(o, linear[0], hidden);  // (T, (H + 2 KVH) D), | q | k | v |
    const Tensor qk = o.rotary.call(qkv.narrow(1, 0, (h + kvh) * d).view({tokens, h + kvh, d}), cos, sin);
    const Tensor q = qk.narrow(1, 0, h);
    const Tensor k = qk.narrow(1, h, kvh);
    const Tensor v = qkv.narrow(1, (h + kvh) * d, kvh * d).view({tokens, kvh, d});
    o.reshape_and_cache.call(k, v, kv_caches[layer], slot_mapping);
    Tensor attn = at::empty({tokens, h, d}, q.options());
    o.paged_attention.call(attn, q, kv_caches[layer], block_tables, seq_lens, query_start_loc, items, merges,
                           scale, heads_per_task, num_parts, max_q);
    hidden = run_linear(o, linear[1], attn.view({tokens, h * d}));
    // post_attention_layernorm, then the SwiGLU MLP
    std::tie(hidden, residual) = o.add_rms_norm.call(hidden, residual, post_norm, eps);
    hidden = run_linear(o, linear[3], o.silu_and_mul.call(run_linear(o, linear[2], hidden)));
  }
  TORCH_CHECK(w == weights.size(), "decoder_layers: ", weights.size() - w, " weights left over");
  return {hidden, residual};
}

}  // namespace

TORCH_LIBRARY(PAGEDSERVE_OPS_NAMESPACE, m) {
  m.def(
      "decoder_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor[] weights, int[] layout, "
      "Tensor(a!)[] kv_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, Tensor items, Tensor merges, int num_parts, int max_q, int num_heads, "
      "int num_kv_heads, int head_dim, int heads_per_task, float scale, float eps, int max_small_rows) "
      "-> (Tensor, Tensor)");
  m.impl("decoder_layers", c10::DispatchKey::CPU, &decoder_layers);
  // oneDNN's prepacked weights (opaque MkldnnCPU tensors) are among the arguments.
  m.impl("decoder_layers", c10::DispatchKey::MkldnnCPU, &decoder_layers);
}
