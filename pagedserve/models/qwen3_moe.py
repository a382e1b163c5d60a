"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm) with sparse MoE MLPs.

Layer N's MLP is sparse unless N is in `mlp_only_layers` or (N + 1) is not a multiple of
`decoder_sparse_step` (transformers' rule); dense layers keep Llama's `mlp.gate_up_proj`.

    model.layers.N.mlp.gate.weight                  router (num_experts, hidden)
    model.layers.N.mlp.experts.E.{gate,up,down}_proj  expert E (layers/moe.py)

A GGUF file stores each layer's experts stacked, (E, I, hidden) / (E, hidden, I); models/gguf.py
names them `mlp.experts.{gate,up,down}_proj.weight` and `split_checkpoint_tensor` cuts them
into the per-expert tensors a Hugging Face checkpoint has.

LoRA: on the attention projections only (`lora_targets`). The wrappers (lora/layers.py) and
the adapter layout know one dense MLP per layer, not experts; an adapter on experts, the
router or an MLP (the dense layers' too, for one rule per model) is refused at load naming
the module (lora/peft_loader.py).
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
    # The projections LoRA adapters may target (lora/layers.py `lora_targets`).
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")

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
