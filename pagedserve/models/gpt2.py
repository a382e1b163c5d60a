"""GPT-2, mirroring Hugging Face's module names.

    transformer.wte (vocab, n_embd), transformer.wpe (n_positions, n_embd)
    transformer.h.N.ln_1 / ln_2          LayerNorm with bias (pre-LN blocks)
    transformer.h.N.attn.c_attn          fused q|k|v projection, (n_embd -> 3 n_embd)
    transformer.h.N.attn.c_proj
    transformer.h.N.mlp.c_fc / c_proj    GELU (tanh approximation, "gelu_new") MLP
    transformer.ln_f, lm_head            tied to wte

GPT-2's projections are `Conv1D` modules whose checkpoint weight is stored transposed,
(in, out); the `Conv1D*` layers transpose it on load into the usual (out, in) layout, so
quantization and the kernels see an ordinary linear layer. Tensor parallelism: c_attn is a
QKV-parallel layer loaded from one fused tensor (cut into q, k, v, each narrowed to the
rank's heads), c_fc column-parallel, both c_proj row-parallel, wte vocabulary-parallel. Original OpenAI checkpoints
name tensors without `transformer.` and carry causal-mask buffers (`attn.bias`,
`attn.masked_bias`); they are renamed / skipped.
"""

from __future__ import annotations

from collections.abc import Hashable

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
    RowParallelLinear,
)

_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


def _conv1d_to_linear(loaded: torch.Tensor, shard_id: Hashable | None, layer: nn.Module) -> torch.Tensor:
    if shard_id is not None:
        raise ValueError(f"{type(layer).__name__} takes no shard, got {shard_id!r}")
    return loaded.t() if loaded.dim() == 2 else loaded  # (in, out) -> (out, in); a bias as is


class Conv1DColumnParallelLinear(ColumnParallelLinear):
    """c_fc: a column-parallel layer loaded from a `Conv1D` weight."""

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        super().weight_loader(param, _conv1d_to_linear(loaded_weight, shard_id, self))


class Conv1DRowParallelLinear(RowParallelLinear):
    """attn.c_proj, mlp.c_proj: row-parallel layers loaded from a `Conv1D` weight."""

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        super().weight_loader(param, _conv1d_to_linear(loaded_weight, shard_id, self))


class Conv1DQKVParallelLinear(QKVParallelLinear):
    """c_attn: q|k|v fused in one checkpoint tensor (n_embd, 3 n_embd), loaded whole.

    The checkpoint has no separate q/k/v names, so the parameters carry no shard tags; the
    loader cuts the tensor into its three projections and loads each as its shard.
    """

    def _tag_shards(self) -> None:
        return

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        fused = _conv1d_to_linear(loaded_weight, shard_id, self)
        for part_id, part in zip(("q", "k", "v"), fused.chunk(3, dim=0), strict=True):
            super().weight_loader(param, part, part_id)


class GPT2Attention(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, total_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // total_heads
        # Output | q | k | v | (this rank's heads of each).
        self.c_attn = Conv1DQKVParallelLinear(hidden, self.head_dim, total_heads, total_heads, bias=True)
        self.num_heads = self.c_attn.num_heads
        self.c_proj = Conv1DRowParallelLinear(hidden, hidden, bias=True)
        scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_idx + 1)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, scale, layer_idx)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, h, d = hidden.shape[0], self.num_heads, self.head_dim
        q, k, v = self.c_attn(hidden).split(h * d, dim=-1)
        return self.c_proj(self.attn(q.view(t, h, d), k.view(t, h, d), v.view(t, h, d), meta))


class GPT2MLP(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        inner = config.n_inner if config.n_inner is not None else 4 * config.hidden_size
        self.c_fc = Conv1DColumnParallelLinear(config.hidden_size, inner, bias=True)
        self.c_proj = Conv1DRowParallelLinear(inner, config.hidden_size, bias=True)
        self.act = get_activation(config.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_epsilon
        self.ln_1 = LayerNorm(hidden, eps)
        self.attn = GPT2Attention(config, layer_idx)
        self.ln_2 = LayerNorm(hidden, eps)
        self.mlp = GPT2MLP(config)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_1(hidden), meta)
        return hidden + self.mlp(self.ln_2(hidden))


class GPT2Model(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.wpe = VocabEmbedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.wte(input_ids) + self.wpe(positions)
        for block in self.h:
            hidden = block(hidden, meta)
        return self.ln_f(hidden)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", True):
            self.lm_head.tie_to(self.transformer.wte)

    @classmethod
    def check_config(cls, config: PretrainedConfig) -> None:
        """Raise ValueError naming the first config option this implementation cannot honour."""
        get_activation(config.activation_function)
        if getattr(config, "add_cross_attention", False):
            raise ValueError("unsupported add_cross_attention=True (decoder-only GPT-2 only)")
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"n_embd={config.hidden_size} not divisible by n_head={config.num_attention_heads}"
            )

    def map_checkpoint_name(self, name: str) -> str | None:
        """OpenAI-era names (`h.0...`, `wte.weight`) gain `transformer.`; mask buffers are skipped."""
        if name.endswith(_MASK_BUFFERS):
            return None
        if not name.startswith(("transformer.", "lm_head.")):
            return f"transformer.{name}"
        return name

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> hidden (T, n_embd), ln_f applied."""
        return self.transformer(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (n, n_embd) -> logits (n, vocab_size), float32."""
        return self.lm_head(hidden)
