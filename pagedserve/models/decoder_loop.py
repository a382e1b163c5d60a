"""A Llama-family model's decoder layers in one C++ call a step (issue 18).

A batch-1 decode token of SmolLM2 dispatches ~550 ops from Python (norms, four GEMVs, rotary,
cache write and attention per layer, 30 layers); at ~10-15 us of Python each, that is about as
long as reading the weights. `DecoderLoop` hands the whole layer stack to
pagedserve/csrc/decoder_loop_cpu.cpp, which calls the same registered C++ ops in the same
order with the same arguments, so the hidden states are the Python layers' bit for bit:

    embed_tokens, rotary_emb (cos, sin)                 Python, once a step (LlamaModel.forward)
    every layer                                          one C++ call (its `layer_stack`)
        each linear layer: T <= gemv.MAX_ROWS tokens     its method's GEMV (`decode_op`)
                           T <= its decode_max_rows      the GEMV, gemv.MAX_ROWS rows a call
                           more                          its method's GEMM (`gemm_op`)
    final norm                                           Python (LlamaModel.forward)

A model whose methods have no single-op GEMM call (group-wise int8 / int4 dequantize above
gemv.CHUNKED_MAX_ROWS rows) runs its larger steps through its own forward.

It is built once, after the weights are processed (`build`), and only where every piece has
its C++ path: a Llama / Mistral / Qwen2 model on CPU, one rank, the C++ attention
backend with a float32 / bfloat16 KV cache in the model's dtype, the fused norm / rotary /
SiLU ops, and every linear layer a method whose decode-sized call is one GEMV op
(`LinearMethod.decode_op`; `gemm_op` for larger steps). Otherwise `build` says why and the runner keeps the Python path.
With LoRA enabled it runs the steps that carry no adapter token (a LoRA wrapper then computes
its base layer alone, which the loop calls); steps with adapter tokens keep the Python layers.
`PAGEDSERVE_DECODER_LOOP=off` turns it off, `=cpp` makes a model that cannot use it an error.
The weights are captured at build: layers whose weights change later (merging an adapter)
need a new loop.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedserve import cpp_build, envs
from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.quantization import gemv

logger = logging.getLogger(__name__)

# The C++ loop's op codes (kLinearOps in decoder_loop_cpu.cpp).
DECODE_OPS = {"gemv_dense": 0, "gemv_int8_grouped": 1, "gemv_int8_q8": 2, "gemv_int4_grouped": 3, "gemv_bits_q8": 7,
              "gemv_bits_q8_parts": 8}
# gemv_bits_q8 (_parts) is both: the int8-activation K-quant kernel takes any row count in one call.
GEMM_OPS = {"linear": 4, "mkldnn_linear": 5, "linear_widened": 6, "gemv_bits_q8": 7, "gemv_bits_q8_parts": 8}
NO_CALL = -1
_DTYPES = (torch.float32, torch.bfloat16)


class DecoderLoop:
    """Runs `model.model.layers` for a step in one C++ call (steps of at most `max_tokens`):
    the `layer_stack` of LlamaModel.forward. Use `build`, which checks that every piece of
    the model has its C++ path, then `bind` the KV caches."""

    def __init__(self, model: nn.Module, backend: Any, ops: Any, weights: list[torch.Tensor],
                 layout: list[int], max_tokens: int | None) -> None:
        attn = model.model.layers[0].self_attn
        self.backend = backend
        self.ops = ops
        self.weights = weights
        self.layout = layout
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.heads_per_task = backend.heads_per_task or attn.num_kv_heads  # as the backend's forward
        self.scale = float(attn.attn.scale)
        self.eps = float(model.model.layers[0].input_layernorm.eps)
        # None: any step (every linear has a GEMM call); else the fewest rows a linear's GEMV takes.
        self.max_tokens = max_tokens
        self.kv_caches: list[torch.Tensor] = []
        # Steps this loop ran (read by tests and benchmarks).
        self.calls = 0

    def bind(self, kv_caches: list[torch.Tensor]) -> None:
        """The runner's per-layer KV caches (layer order), once they are allocated."""
        self.kv_caches = kv_caches

    @classmethod
    def build(cls, model: nn.Module, backend: AttentionBackend, kv_dtype: torch.dtype,
              dtype: torch.dtype, device: torch.device, tp_size: int) -> DecoderLoop | None:
        """The loop for this loaded model, or None (the reason logged) when it cannot run it.

        Raises:
            ValueError: PAGEDSERVE_DECODER_LOOP=cpp and the model cannot use the loop.
            KernelUnavailable: PAGEDSERVE_DECODER_LOOP=cpp and the kernel cannot be built.
        """
        choice = envs.decoder_loop()
        if choice == "off":
            return None
        reason = _why_not(model, backend, kv_dtype, dtype, device, tp_size)
        ops = None if reason is not None else cpp_build.resolve(cpp_build.DECODER_LOOP, choice)
        if reason is None and ops is None:
            reason = "the kernel is unavailable"
        if reason is not None:
            if choice == "cpp":
                raise ValueError(f"PAGEDSERVE_DECODER_LOOP=cpp, but {reason}")
            logger.info("decoder loop off: %s", reason)
            return None
        weights, layout, max_tokens = _flatten(model)
        return cls(model, backend, ops, weights, layout, max_tokens)

    def takes(self, num_tokens: int, meta: AttentionMetadata, adapter_tokens: bool = False) -> bool:
        """Whether this step can run here: a size every linear has a call for, no token of a
        LoRA adapter (the loop runs the base layers only), and the backend's own metadata (its
        torch fallback is for dtypes the loop never sees)."""
        if num_tokens <= 0 or adapter_tokens or (self.max_tokens is not None and num_tokens > self.max_tokens):
            return False
        return getattr(meta, "backend", None) is self.backend

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer of a step `takes` accepted: (hidden, residual) before the final
        norm, as LlamaModel.run_layers gives them."""
        self.calls += 1
        return self.ops.decoder_layers(
            hidden, cos.contiguous(), sin.contiguous(), self.weights, self.layout, self.kv_caches,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.items,
            meta.merges, meta.num_parts, meta.max_q, self.num_heads, self.num_kv_heads, self.head_dim,
            self.heads_per_task, self.scale, self.eps, gemv.MAX_ROWS)


def _why_not(model: nn.Module, backend: AttentionBackend, kv_dtype: torch.dtype, dtype: torch.dtype,
             device: torch.device, tp_size: int) -> str | None:
    """Why the loop cannot run this model, or None when it can."""
    from pagedserve.attention.cpp_paged import CppPagedAttentionBackend
    from pagedserve.models.layers.linear import LinearBase
    from pagedserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaModel

    inner = getattr(model, "model", None)
    # Exact types: a subclass (Qwen3's q/k norms, Granite's multipliers, a windowed or
    # partial-rotary layer, ...) computes something the C++ loop does not.
    if type(inner) is not LlamaModel or any(
        type(layer) is not LlamaDecoderLayer or type(layer.self_attn) is not LlamaAttention
        or layer.self_attn.attn.sliding_window is not None for layer in inner.layers
    ):
        return f"{type(model).__name__} is not a Llama-family model as the loop computes it"
    if device.type != "cpu" or dtype not in _DTYPES:
        return f"it runs float32 / bfloat16 models on CPU, not {dtype} on {device.type}"
    if tp_size != 1:
        return "tensor parallelism keeps the Python layers"
    if not isinstance(backend, CppPagedAttentionBackend) or not backend.fused_cache_write:
        return f"the attention backend is {backend.name}, not the C++ one"
    if backend.ops is not cpp_build.load(cpp_build.PAGED_ATTENTION).ops:
        return "the attention backend uses a variant build of its kernel"
    if kv_dtype != dtype:
        return f"the KV cache is {kv_dtype}, the model {dtype}"
    eps = {layer.input_layernorm.eps for layer in inner.layers} | {
        layer.post_attention_layernorm.eps for layer in inner.layers}
    if len(eps) != 1:
        return "the layers' norms use different eps"
    for layer in inner.layers:
        fused = (layer.input_layernorm.fused, layer.post_attention_layernorm.fused,
                 layer.self_attn.fused, layer.mlp.act_fn.fused)
        if any(ops is None for ops in fused):
            return "the fused norm / rotary / SiLU ops are off"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if norm.weight.dtype != dtype:
                return f"a norm weight is {norm.weight.dtype}, the model {dtype}"
        for linear in _linears(layer):
            if not isinstance(linear, LinearBase):
                return f"{type(linear).__name__} is not a plain linear layer"
            call = linear.quant_method.decode_op(linear)
            if call is None or call[0] not in DECODE_OPS:
                return f"the {linear.quant_method.name} method has no one-op decode call"
            gemm = linear.quant_method.gemm_op(linear)
            if gemm is not None and gemm[0] not in GEMM_OPS:
                return f"the {linear.quant_method.name} method's GEMM call {gemm[0]} is not one the loop knows"
    return None


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    """qkv_proj, o_proj, gate_up_proj, down_proj: the C++ loop's order; a LoRA wrapper's base
    layer (what the wrapper runs alone in a step without adapter tokens)."""
    from pagedserve.lora.layers import LoRALinear

    modules = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    return tuple(m.base if isinstance(m, LoRALinear) else m for m in modules)


def _flatten(model: nn.Module) -> tuple[list[torch.Tensor], list[int], int | None]:
    """The C++ loop's `weights` and `layout` (decoder_loop_cpu.cpp's header): per linear its
    decode call, its GEMM call or none, and the rows up to which the decode call runs in
    chunks; and the most tokens a step may have (None: any, every linear has a GEMM call)."""
    weights: list[torch.Tensor] = []
    layout: list[int] = []
    # The most rows of the layers with no GEMM call (past those, a step has no call to make).
    limits: list[int] = []
    for layer in model.model.layers:
        weights += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
        for linear in _linears(layer):
            op, args = linear.quant_method.decode_op(linear)
            layout += [DECODE_OPS[op], len(args)]
            weights += [t.detach() for t in args]
            gemm = linear.quant_method.gemm_op(linear)
            chunk_rows = linear.quant_method.decode_max_rows(linear)
            if gemm is None:
                layout += [NO_CALL, 0]
                limits.append(chunk_rows)
            else:
                layout += [GEMM_OPS[gemm[0]], len(gemm[1])]
                weights += [t.detach() if t.layout == torch.strided else t for t in gemm[1]]
            layout.append(chunk_rows)
    return weights, layout, min(limits) if limits else None

