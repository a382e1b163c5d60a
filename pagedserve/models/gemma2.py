"""Gemma 2, mirroring Hugging Face's module names (Gemma 3's text model builds on it).

What differs from Llama, per decoder layer:

    x = x + post_attention_layernorm(attn(input_layernorm(x)))         norms before AND after
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    norm(x) = x / rms(x) * (1 + weight)                                 weights stored around 0
    mlp(x)  = down(gelu_tanh(gate(x)) * up(x))                          GeGLU
    attention scale query_pre_attn_scalar ** -0.5; scores capped to
        attn_logit_softcapping * tanh(scores / attn_logit_softcapping)  (torch attention path)
    "sliding_attention" layers of `layer_types` attend within `sliding_window`

and around the stack: embeddings * sqrt(hidden_size) (rounded to the model dtype, as
transformers does), logits capped by final_logit_softcapping the same way.

The fused projections load as in Llama (`stacked_params_mapping`):

    model.layers.N.self_attn.{q,k,v}_proj -> qkv_proj,  model.layers.N.mlp.{gate,up}_proj -> gate_up_proj
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.models.layers.activation import get_activation
from pagedserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.models.layers.linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of


def layer_type_of(config: PretrainedConfig, layer_idx: int) -> str:
    """"sliding_attention" or "full_attention": which window and RoPE table the layer uses."""
    layer_types = getattr(config, "layer_types", None)
    return str(layer_types[layer_idx]) if layer_types else "full_attention"


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, cast back at the end (Gemma's order; Llama
    casts before multiplying by the weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Gemma2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        size = config.intermediate_size
        # Output rows | gate | up |, shards 0 and 1.
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size] * 2, False)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False)
        self.act = get_activation(config.hidden_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class Gemma2Attention(LlamaAttention):
    """Llama's attention with Gemma's bias flag, scale (query_pre_attn_scalar) and score cap;
    Gemma 3 (`qk_norm`) normalises each head of q and k before RoPE."""

    qk_norm: ClassVar[bool] = False

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, layer_idx, bias, bias)
        if self.qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def softmax_scale(self, config: PretrainedConfig) -> float:
        return float(config.query_pre_attn_scalar) ** -0.5

    def softcap(self, config: PretrainedConfig) -> float | None:
        return getattr(config, "attn_logit_softcapping", None)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.qk_norm:  # qk (T, H + KVH, D): each head's row normalised over D, then rotated
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        return super().rotate(qk, cos, sin)


class Gemma2DecoderLayer(nn.Module):
    attention_cls: ClassVar[type[Gemma2Attention]] = Gemma2Attention

    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        # Which RoPE table this layer reads (Gemma 3 has one per layer type).
        self.self_attn = self.attention_cls(config, layer_idx)
        self.mlp = Gemma2MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma2Model(nn.Module):
    layer_cls: ClassVar[type[Gemma2DecoderLayer]] = Gemma2DecoderLayer

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_cls(config, i) for i in range(config.num_hidden_layers)
        )
        self.layer_types = [layer_type_of(config, i) for i in range(config.num_hidden_layers)]
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = self.rotary_tables(config)
        self.embed_scale = config.hidden_size**0.5

    def rotary_tables(self, config: PretrainedConfig) -> nn.ModuleDict:
        """Layer type -> its RoPE (Gemma 2: one table, whatever the layer type)."""
        rope = RotaryEmbedding(config, head_dim_of(config))
        return nn.ModuleDict({t: rope for t in set(self.layer_types)})

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # sqrt(hidden_size) rounded to the model dtype first, as transformers multiplies.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
        # (cos, sin) once per step per layer type, shared by that type's layers.
        tables = {t: rope(positions, hidden.dtype) for t, rope in self.rotary_emb.items()}
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            hidden = layer(hidden, *tables[layer_type], meta)
        return self.norm(hidden)


class Gemma2ForCausalLM(nn.Module):
    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping
    model_cls: ClassVar[type[Gemma2Model]] = Gemma2Model

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.model = self.model_cls(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie_to(self.model.embed_tokens)
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Raise ValueError naming the first config option this implementation cannot honour."""
        get_activation(config.hidden_activation)
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError(
                f"unsupported use_bidirectional_attention=True for {cls.__name__} (causal only)"
            )
        cls.check_rope(config)

    @classmethod
    def check_rope(cls, config: PretrainedConfig) -> None:
        rope_parameters(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, hidden_size) -> logits (n, vocab_size), float32 (None on ranks > 0),
        capped to final_logit_softcapping * tanh(logits / final_logit_softcapping)."""
        logits = self.lm_head(hidden)
        if logits is None or self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap
