"""Qwen3 (dense): Llama with an RMSNorm over each head of q and k before RoPE, no QKV bias.

    model.layers.N.self_attn.q_norm.weight, k_norm.weight   (head_dim,), shared by all heads

Layers marked "sliding_attention" in `layer_types` (use_sliding_window) attend within
`sliding_window` (llama.layer_window).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from pagedserve.models.layers.layernorm import RMSNorm
from pagedserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class Qwen3Attention(LlamaAttention):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool, o_bias: bool
    ) -> None:
        super().__init__(config, layer_idx, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # qk (T, H + KVH, D): each head's row normalised over D, then rotated.
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        return super().rotate(qk, cos, sin)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
    sliding_windows: ClassVar[bool] = True
