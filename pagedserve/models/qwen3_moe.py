"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with sparse MoE MLPs.

Layer N's MLP is sparse unless N is in `mlp_only_layers` or (N + 1) is not a multiple of
`decoder_sparse_step` (transformers' rule); dense layers keep Llama's `mlp.gate_up_proj`.

    model.layers.N.mlp.gate.weight                  router (num_experts, hidden)
    model.layers.N.mlp.experts.E.{gate,up,down}_proj  expert E (layers/moe.py)

A GGUF file stores each layer's experts stacked, (E, I, hidden) / (E, hidden, I); models/gguf.py
names them `mlp.experts.{gate,up,down}_proj.weight` and `split_checkpoint_tensor` cuts them
into the per-expert tensors a Hugging Face checkpoint has.

LoRA: the wrappers (lora/layers.py) know one dense MLP per layer; adapters on experts are
not supported, and a sparse layer refuses to be wrapped (`gate_up_proj` below).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.layers.moe import FusedMoE, TopKRouter
from pagedserve.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM, Qwen3Model

# A GGUF layer's stacked experts, (E, out, in): cut into E checkpoint tensors.
_STACKED_EXPERTS = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate|up|down)_proj\.weight")


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule for which layers get the MoE block."""
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate = TopKRouter(
            config.hidden_size, config.num_experts, config.num_experts_per_tok,
            bool(config.norm_topk_prob),
        )
        self.experts = FusedMoE(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size)."""
        weights, ids = self.gate(hidden)
        return self.experts(hidden, weights, ids)

    @property
    def gate_up_proj(self) -> nn.Module:
        # wrap_model_for_lora reaches for every layer's `mlp.gate_up_proj`; a sparse layer has
        # one per expert, which no adapter layout covers. A ValueError (not AttributeError,
        # which nn.Module and hasattr would swallow) names the reason at engine start.
        raise ValueError(
            "enable_lora: LoRA is not supported on Qwen3MoeForCausalLM (its sparse layers' "
            "experts take no adapters); serve it without enable_lora"
        )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(
        self, config: PretrainedConfig, layer_idx: int, biases: tuple[bool, bool, bool]
    ) -> None:
        super().__init__(config, layer_idx, biases)
        if is_sparse_layer(config, layer_idx):
            # Replaces the dense MLP the parent built (never loaded: its pages stay untouched).
            self.mlp = Qwen3MoeSparseMoeBlock(config)  # type: ignore[assignment]


class Qwen3MoeModel(Qwen3Model):
    layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    model_cls = Qwen3MoeModel

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        super().check_config(config)
        if config.num_experts > 0 and config.decoder_sparse_step < 1:
            raise ValueError(f"unsupported decoder_sparse_step={config.decoder_sparse_step} (must be >= 1)")

    def split_checkpoint_tensor(
        self, name: str, tensor: torch.Tensor
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A stacked (E, out, in) expert tensor (GGUF) -> E per-expert tensors (views);
        every other tensor as it is."""
        match = _STACKED_EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            return
        for expert in range(tensor.shape[0]):
            yield f"{match['prefix']}.{expert}.{match['proj']}_proj.weight", tensor[expert]
