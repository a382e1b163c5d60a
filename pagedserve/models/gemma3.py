"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type gemma3_text): Gemma 2's layer with

    q_norm / k_norm     an RMSNorm (1 + w) over each head of q and k before RoPE
    RoPE per layer type config.rope_parameters = {"sliding_attention": {... rope_theta
                        10000 (rope_local_base_freq)}, "full_attention": {... 1e6, scaling}}
    layer_types         5 "sliding_attention" : 1 "full_attention" by default

and no softcapping by default (the config's attn / final softcaps are honoured if set).
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2Model,
)
from pagedserve.models.layers.rotary import RotaryEmbedding, rope_parameters
from pagedserve.models.llama import head_dim_of


def rope_config(config: PretrainedConfig, layer_type: str) -> PretrainedConfig:
    """A shallow copy of `config` whose `rope_parameters` are those of `layer_type`, so the
    one-table RoPE code (and transformers' init functions it calls) read them."""
    params = config.rope_parameters
    if isinstance(params, dict) and layer_type in params:
        config = copy.copy(config)
        config.rope_parameters = dict(params[layer_type])
    return config


class Gemma3Attention(Gemma2Attention):
    qk_norm = True


class Gemma3DecoderLayer(Gemma2DecoderLayer):
    attention_cls = Gemma3Attention


class Gemma3TextModel(Gemma2Model):
    layer_cls = Gemma3DecoderLayer

    def rotary_tables(self, config: PretrainedConfig) -> nn.ModuleDict:
        return nn.ModuleDict({
            t: RotaryEmbedding(rope_config(config, t), head_dim_of(config))
            for t in sorted(set(self.layer_types))
        })


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    model_cls = Gemma3TextModel

    @classmethod
    def check_rope(cls, config: PretrainedConfig) -> None:
        for layer_type in set(getattr(config, "layer_types", None) or ["full_attention"]):
            rope_parameters(rope_config(config, layer_type))
