"""SmolLM3: Llama whose every `no_rope_layer_interval`-th layer has no RoPE (NoPE).

`config.no_rope_layers[i]` is 1 where layer i rotates q and k, 0 where it does not
(transformers derives it from the interval when the config leaves it out). Layers marked
"sliding_attention" (use_sliding_window) attend within `sliding_window`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import PretrainedConfig

from pagedserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class SmolLM3Attention(LlamaAttention):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool, o_bias: bool
    ) -> None:
        super().__init__(config, layer_idx, qkv_bias, o_bias)
        self.use_rope = bool(config.no_rope_layers[layer_idx])

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return super().rotate(qk, cos, sin) if self.use_rope else qk


class SmolLM3DecoderLayer(LlamaDecoderLayer):
    attention_cls = SmolLM3Attention


class SmolLM3Model(LlamaModel):
    layer_cls = SmolLM3DecoderLayer


class SmolLM3ForCausalLM(LlamaForCausalLM):
    model_cls = SmolLM3Model
    sliding_windows: ClassVar[bool] = True
