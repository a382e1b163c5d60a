"""IBM Granite (3.x dense): Llama with four scalar multipliers from the config.

    embeddings          embed_tokens(ids) * embedding_multiplier
    attention scores    q.k * attention_multiplier            (instead of head_dim ** -0.5)
    each residual add   residual + sublayer(x) * residual_multiplier
    logits              lm_head(h) / logits_scaling
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from pagedserve.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)


class GraniteAttention(LlamaAttention):
    def softmax_scale(self, config: PretrainedConfig) -> float:
        return float(config.attention_multiplier)


class GraniteDecoderLayer(LlamaDecoderLayer):
    attention_cls = GraniteAttention

    def __init__(
        self, config: PretrainedConfig, layer_idx: int, biases: tuple[bool, bool, bool]
    ) -> None:
        super().__init__(config, layer_idx, biases)
        self.residual_multiplier = float(config.residual_multiplier)


class GraniteModel(LlamaModel):
    layer_cls = GraniteDecoderLayer

    def __init__(self, config: PretrainedConfig, biases: tuple[bool, bool, bool]) -> None:
        super().__init__(config, biases)
        self.embedding_multiplier = float(config.embedding_multiplier)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier


class GraniteForCausalLM(LlamaForCausalLM):
    model_cls = GraniteModel

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.logits_scaling = float(config.logits_scaling)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if logits is None or self.logits_scaling == 1.0:  # None: ranks > 0 of a TP group
            return logits
        return logits / self.logits_scaling
