"""Token / position embeddings and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.layers.linear import default_weight_loader
from pagedserve.quantization.base import LinearMethod


class VocabEmbedding(nn.Module):
    """(vocab_size, hidden) table; left uninitialised, it always comes from a checkpoint."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.num_embeddings = vocab_size
        self.embedding_dim = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        default_weight_loader(param, loaded_weight)


class LMHead(VocabEmbedding):
    """hidden -> vocab logits, always returned in float32 (sampling precision).

    Full precision unless `set_quant_method` is called before loading (--quantize-lm-head):
    the method then quantizes the loaded (or tied) weight; a tied embedding keeps its own
    full-precision table, so the head becomes a separate quantized copy.
    """

    quant_method: LinearMethod | None = None

    @property
    def input_size(self) -> int:
        return self.embedding_dim

    @property
    def output_size(self) -> int:
        return self.num_embeddings

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, hidden).float()
        return F.linear(hidden, self.weight).float()

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        self.weight = embedding.weight

    def set_quant_method(self, method: LinearMethod) -> None:
        """Quantize this head's weight once loaded (only load-time methods are supported)."""
        self.quant_method = method
