"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama layer with fused checkpoint projections and
RoPE on the leading `partial_rotary_factor` of each head.

The checkpoint stores q/k/v and gate/up fused; they are cut at load into the parts the
Llama stacked mapping fills shard by shard (so tensor parallelism and quantization see
the usual shards):

    model.layers.N.self_attn.qkv_proj.weight  rows | q (H*D) | k (KVH*D) | v (KVH*D) |
    model.layers.N.mlp.gate_up_proj.weight    rows | gate (I) | up (I) |

`sliding_window`, when set, windows every layer (transformers' Phi3Model masks them all).
"longrope" scaling (Phi-3-*-128k) switches frequencies with the sequence length, so a
cached key would need re-rotating: it is refused like every position-dependent RoPE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import ClassVar

import torch
from transformers import PretrainedConfig

from pagedserve.models.gguf import GGUFQuantizedTensor
from pagedserve.models.layers.rotary import apply_rotary, rotary_dim_of
from pagedserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    head_dim_of,
    num_kv_heads_of,
)


class Phi3Attention(LlamaAttention):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, qkv_bias: bool, o_bias: bool
    ) -> None:
        super().__init__(config, layer_idx, qkv_bias, o_bias)
        self.rotary_dim = rotary_dim_of(config)

    def sliding_window(self, config: PretrainedConfig, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None) or None

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # qk (T, H + KVH, D): dims [0, rotary_dim) rotated, the rest passed through.
        if self.rotary_dim == self.head_dim:
            return super().rotate(qk, cos, sin)
        rot, rest = qk.split([self.rotary_dim, self.head_dim - self.rotary_dim], dim=-1)
        return torch.cat([apply_rotary(rot, cos, sin), rest], dim=-1)


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention


class Phi3Model(LlamaModel):
    layer_cls = Phi3DecoderLayer


class Phi3ForCausalLM(LlamaForCausalLM):
    model_cls = Phi3Model
    partial_rotary: ClassVar[bool] = True

    def split_checkpoint_tensor(
        self, name: str, tensor: torch.Tensor | GGUFQuantizedTensor
    ) -> Iterator[tuple[str, torch.Tensor | GGUFQuantizedTensor]]:
        """The fused qkv_proj / gate_up_proj weights as q/k/v_proj and gate/up_proj."""
        config = self.config
        if ".qkv_proj." in name:
            q = config.num_attention_heads * head_dim_of(config)
            kv = num_kv_heads_of(config) * head_dim_of(config)
            parts = [("q_proj", q), ("k_proj", kv), ("v_proj", kv)]
            fused = "qkv_proj"
        elif ".gate_up_proj." in name:
            parts = [("gate_proj", config.intermediate_size), ("up_proj", config.intermediate_size)]
            fused = "gate_up_proj"
        else:
            yield name, tensor
            return
        start = 0
        for part, rows in parts:
            yield name.replace(f".{fused}.", f".{part}."), _rows(tensor, start, rows)
            start += rows


def _rows(tensor: torch.Tensor | GGUFQuantizedTensor, start: int, rows: int
          ) -> torch.Tensor | GGUFQuantizedTensor:
    # GGUF blocks run along a row, so a row range of blocks is that range of the weight.
    if isinstance(tensor, GGUFQuantizedTensor):
        return dataclasses.replace(tensor, shape=(rows, tensor.shape[1]),
                                   blocks=tensor.blocks[start:start + rows])
    return tensor[start:start + rows]
