"""Llama (2, 3, 3.1+) and Mistral, mirroring Hugging Face's module names.

Checkpoint names load by name, except the fused projections, mapped by
`stacked_params_mapping` (checkpoint part -> parameter part, shard):

    model.layers.N.self_attn.{q,k,v}_proj  -> model.layers.N.self_attn.qkv_proj  ("q"/"k"/"v")
    model.layers.N.mlp.{gate,up}_proj      -> model.layers.N.mlp.gate_up_proj    (0 / 1)

Forward over the flat batch (no padding; see attention/metadata.py):

    input_ids, positions: (num_tokens,) -> hidden (num_tokens, hidden_size), final norm applied
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.models.layers import fused_ops
from pagedserve.models.layers.activation import SiluAndMul
from pagedserve.models.layers.attention import Attention
from pagedserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.models.layers.layernorm import RMSNorm
from pagedserve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.rotary import (
    RotaryEmbedding,
    apply_rotary,
    partial_rotary_factor,
    rope_parameters,
    rotary_dim_of,
)

# (hidden, cos, sin, meta) -> (hidden, residual): the decoder layers of one step.
LayerStack = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]]


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: PretrainedConfig) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def layer_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Layer `layer_idx`'s sliding window, as transformers reads it: `config.sliding_window`
    on a "sliding_attention" entry of `layer_types` (Qwen2/3 and SmolLM3 also require
    `use_sliding_window`); None = full attention."""
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if getattr(config, "model_type", None) == "mistral" and not layer_types:
        # transformers' Mistral windows every layer; a window as long as the context
        # changes nothing, so such a model keeps full attention (the plain paged path).
        return window if window and window < config.max_position_embeddings else None
    if not layer_types or layer_types[layer_idx] != "sliding_attention" or not window:
        return None
    return window if getattr(config, "use_sliding_window", True) else None


class LlamaAttention(nn.Module):
    """Subclasses change the softmax scale (`softmax_scale`), each layer's window
    (`sliding_window`), the score cap (`softcap`) or what happens to q and k between the
    projection and the cache (`rotate`: Qwen3's and Gemma 3's q/k norms, Phi-3's partial
    rotary, SmolLM3's layers without RoPE)."""

    def __init__(
        self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool, o_bias: bool
    ) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        total_heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, num_kv_heads_of(config), qkv_bias
        )
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, o_bias)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.softmax_scale(config),
            layer_idx, sliding_window=self.sliding_window(config, layer_idx),
            softcap=self.softcap(config),
        )
        self.fused = fused_ops.resolve()  # rotary's C++ op or None, chosen once

    def softmax_scale(self, config: PretrainedConfig) -> float:
        return self.head_dim**-0.5

    def softcap(self, config: PretrainedConfig) -> float | None:
        """Scores capped to c * tanh(s / c) (Gemma 2); None: uncapped."""
        return None

    def sliding_window(self, config: PretrainedConfig, layer_idx: int) -> int | None:
        return layer_window(config, layer_idx)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q and k rotated in one pass over their (T, H + KVH, D) view."""
        return apply_rotary(qk, cos, sin, self.fused)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden)  # (T, (H + 2 KVH) * D), columns | q | k | v |
        num_tokens = qkv.shape[0]
        qk, v = qkv.split([(h + kvh) * d, kvh * d], dim=-1)
        qk = self.rotate(qk.view(num_tokens, h + kvh, d), cos, sin)
        q, k = qk.split([h, kvh], dim=1)
        out = self.attn(q, k, v.view(num_tokens, kvh, d), meta)  # (T, H * D)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        # Output rows | gate | up |, shards 0 and 1.
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls: ClassVar[type[LlamaAttention]] = LlamaAttention
    # Granite scales each sublayer's output before the norm adds it to the skip stream (the
    # MLP's by the next layer's input norm or the final norm); None: unscaled.
    residual_multiplier: float | None = None

    def __init__(
        self, config: PretrainedConfig, layer_idx: int, biases: tuple[bool, bool, bool]
    ) -> None:
        super().__init__()
        qkv_bias, o_bias, mlp_bias = biases
        self.self_attn = self.attention_cls(config, layer_idx, qkv_bias, o_bias)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # `residual` is the skip stream; each norm adds the previous sublayer's output into it.
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.residual_multiplier is not None:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaModel(nn.Module):
    layer_cls: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

    def __init__(self, config: PretrainedConfig, biases: tuple[bool, bool, bool]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i, biases) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, rotary_dim_of(config))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        layer_stack: LayerStack | None = None,
    ) -> torch.Tensor:
        """`layer_stack`: runs every decoder layer instead of `run_layers` (the C++ decoder
        loop, models/decoder_loop.py)."""
        hidden = self.embed(input_ids)
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # once per step, shared by all layers
        hidden, residual = (layer_stack or self.run_layers)(hidden, cos, sin, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def run_layers(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer: (hidden, residual) before the final norm."""
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    # (checkpoint name part, parameter name part, shard id) for the fused projections.
    stacked_params_mapping: ClassVar[list[tuple[str, str, object]]] = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
    ]

    model_cls: ClassVar[type[LlamaModel]] = LlamaModel
    # What check_config lets through: RoPE on part of each head (the attention class must
    # rotate only that part), and "sliding_attention" layers (served by `layer_window`).
    partial_rotary: ClassVar[bool] = False
    sliding_windows: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.model = self.model_cls(config, self.biases(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.tie_to(self.model.embed_tokens)

    @classmethod
    def biases(cls, config: PretrainedConfig) -> tuple[bool, bool, bool]:
        """(qkv_proj bias, o_proj bias, MLP biases)."""
        attention_bias = bool(getattr(config, "attention_bias", False))
        return attention_bias, attention_bias, bool(getattr(config, "mlp_bias", False))

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Raise ValueError naming the first config option this implementation cannot honour."""
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act={act!r} for {cls.__name__} (only 'silu')")
        rope_parameters(config)
        partial = partial_rotary_factor(config)
        if partial != 1.0 and not cls.partial_rotary:
            raise ValueError(
                f"unsupported partial_rotary_factor={partial} for {cls.__name__} "
                "(only full rotary is supported)"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if not cls.sliding_windows and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"unsupported layer_types={sorted(set(layer_types))} (only full attention)"
            )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        layer_stack: LayerStack | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta, layer_stack)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden_size) -> logits (n, vocab_size), float32 (None on ranks > 0)."""
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral = Llama without biases, every layer windowed by `sliding_window` (the paged
    cache gives back the blocks that slide out: core/hybrid_kv_manager.py). The window
    comes from `layer_window`, so the layers stay plain Llama layers (the decoder loop
    takes a Mistral model without a window)."""
