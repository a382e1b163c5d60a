"""OPT (facebook/opt-*), mirroring Hugging Face's module names.

    model.decoder.embed_tokens          (vocab, word_embed_proj_dim)
    model.decoder.embed_positions       (max_position_embeddings + 2, hidden): OPT looks up
                                        position p at row p + 2 (a historical offset)
    model.decoder.project_in / _out     word_embed_proj_dim <-> hidden, only when they differ
    model.decoder.layers.N.self_attn.{q,k,v}_proj -> ...self_attn.qkv_proj ("q"/"k"/"v")
    model.decoder.layers.N.self_attn.out_proj, fc1, fc2 (ReLU MLP), biases (enable_bias)
    model.decoder.final_layer_norm      only with do_layer_norm_before (pre-LN)
    lm_head                             tied to embed_tokens by default

`do_layer_norm_before` (all sizes but 350m): pre-LN, x + f(LN(x)); otherwise post-LN,
LN(x + f(x)). Older checkpoints name tensors `decoder.*` (no `model.`); they are renamed.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.attention.backend import AttentionMetadata
from pagedserve.models.layers.activation import get_activation
from pagedserve.models.layers.attention import Attention
from pagedserve.models.layers.embedding import (
    ParallelLMHead,
    VocabEmbedding,
    VocabParallelEmbedding,
)
from pagedserve.models.layers.layernorm import LayerNorm
from pagedserve.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

POSITION_OFFSET = 2  # OPT's learned positions are looked up at position + 2


class OPTAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // total_heads
        bias = config.enable_bias
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.out_proj = RowParallelLinear(hidden, hidden, bias)
        # Like Hugging Face, q is scaled before the product (same rounding) and SDPA uses 1.
        self.scaling = self.head_dim**-0.5
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, 1.0, layer_idx)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, h, d = hidden.shape[0], self.num_heads, self.head_dim
        q, k, v = self.qkv_proj(hidden).split(h * d, dim=-1)  # columns | q | k | v |
        q = q * self.scaling
        out = self.attn(q.view(t, h, d), k.view(t, h, d), v.view(t, h, d), meta)
        return self.out_proj(out)


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, affine = config.hidden_size, config.layer_norm_elementwise_affine
        self.pre_norm = bool(config.do_layer_norm_before)
        self.self_attn = OPTAttention(config, layer_idx)
        self.self_attn_layer_norm = LayerNorm(hidden, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(hidden, config.ffn_dim, config.enable_bias)
        self.fc2 = RowParallelLinear(config.ffn_dim, hidden, config.enable_bias)
        self.activation_fn = get_activation(config.activation_function)
        self.final_layer_norm = LayerNorm(hidden, elementwise_affine=affine)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # (T, hidden) -> (T, hidden); pre-LN: x + f(LN(x)), post-LN: LN(x + f(x)).
        attn_in = self.self_attn_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.self_attn(attn_in, meta)
        if not self.pre_norm:
            hidden = self.self_attn_layer_norm(hidden)
        mlp_in = self.final_layer_norm(hidden) if self.pre_norm else hidden
        hidden = hidden + self.fc2(self.activation_fn(self.fc1(mlp_in)))
        if not self.pre_norm:
            hidden = self.final_layer_norm(hidden)
        return hidden


class OPTDecoder(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        hidden, proj = config.hidden_size, config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, proj)
        self.embed_positions = VocabEmbedding(
            config.max_position_embeddings + POSITION_OFFSET, hidden
        )
        self.project_in = ReplicatedLinear(proj, hidden) if proj != hidden else None
        self.project_out = ReplicatedLinear(hidden, proj) if proj != hidden else None
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        has_final_norm = config.do_layer_norm_before and not config._remove_final_layer_norm
        self.final_layer_norm = (
            LayerNorm(hidden, elementwise_affine=config.layer_norm_elementwise_affine)
            if has_final_norm
            else None
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        embeds = self.embed_tokens(input_ids)
        if self.project_in is not None:
            embeds = self.project_in(embeds)
        hidden = embeds + self.embed_positions(positions + POSITION_OFFSET)
        for layer in self.layers:
            hidden = layer(hidden, meta)
        if self.final_layer_norm is not None:
            hidden = self.final_layer_norm(hidden)
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        return hidden


class OPTModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config)


class OPTForCausalLM(nn.Module):
    stacked_params_mapping: ClassVar[list[tuple[str, str, object]]] = [
        (".q_proj.", ".qkv_proj.", "q"),
        (".k_proj.", ".qkv_proj.", "k"),
        (".v_proj.", ".qkv_proj.", "v"),
    ]

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.model = OPTModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie_to(self.model.decoder.embed_tokens)

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Raise ValueError naming the first config option this implementation cannot honour."""
        get_activation(config.activation_function)
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"hidden_size={config.hidden_size} not divisible by "
                f"num_attention_heads={config.num_attention_heads}"
            )

    def map_checkpoint_name(self, name: str) -> str:
        """Older OPT checkpoints (facebook/opt-*) name tensors `decoder.*`, not `model.decoder.*`."""
        return f"model.{name}" if name.startswith("decoder.") else name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions (T,) absolute positions -> hidden (T, word_embed_proj_dim)."""
        return self.model.decoder(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, word_embed_proj_dim) -> logits (n, vocab_size), float32."""
        return self.lm_head(hidden)
