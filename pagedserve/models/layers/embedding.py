"""Token / position embeddings and the LM head (which may share the embedding's weight).

Tensor parallelism splits the vocabulary (vLLM's VocabParallelEmbedding / ParallelLMHead):

    rank r holds rows [r * per_rank, min((r + 1) * per_rank, vocab)) of the (vocab, hidden)
    table, per_rank = ceil(vocab / tp); the last rank's missing rows are zero padding.
    lookup: ids outside the rank's range read zeros, one all-reduce sums the ranks' rows
    LM head: each rank computes its vocabulary slice of the logits, rank 0 gathers them
    (only rank 0 samples); the padding columns are cut off

A tied head shares its rank's shard of the embedding. With one rank these are the plain
embedding and head. Position embeddings (OPT, GPT-2) stay `VocabEmbedding`, replicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import TPGroup, current_tp
from pagedserve.models.layers.linear import default_weight_loader
from pagedserve.quantization.base import LinearMethod


class VocabEmbedding(nn.Module):
    """(vocab_size, hidden) table on every rank; left uninitialised, it always comes from a checkpoint."""

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


class VocabParallelEmbedding(VocabEmbedding):
    """This rank's rows of the vocabulary (`num_embeddings` = rows held, padding included)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.tp: TPGroup = current_tp()
        self.org_vocab_size = vocab_size
        per_rank = -(-vocab_size // self.tp.size)
        self.vocab_start = min(self.tp.rank * per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + per_rank, vocab_size)
        super().__init__(per_rank if self.tp.size > 1 else vocab_size, hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        # Ids of other ranks look up row 0 and are zeroed; the all-reduce adds the owner's row.
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill_(outside, 0)
        out = F.embedding(local, self.weight).masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        if self.tp.size == 1:
            default_weight_loader(param, loaded_weight)
            return
        if loaded_weight.shape[0] != self.org_vocab_size:
            raise ValueError(
                f"shape mismatch: vocabulary of {self.org_vocab_size}, checkpoint {tuple(loaded_weight.shape)}")
        rows = self.vocab_end - self.vocab_start
        with torch.no_grad():
            param[rows:].zero_()  # padding of the last rank: never looked up, logits cut
        default_weight_loader(param[:rows], loaded_weight.narrow(0, self.vocab_start, rows))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> vocab logits, always returned in float32 (sampling precision).

    With tp ranks, rank 0 returns the full (n, vocab) logits and the other ranks None: they
    only contribute their slice to the gather.

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

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if self.quant_method is not None:
            logits = self.quant_method.apply(self, hidden).float()
        else:
            logits = F.linear(hidden, self.weight).float()
        if self.tp.size == 1:
            return logits
        gathered = self.tp.gather_to_first(logits)  # (n, per_rank * tp) on rank 0
        return gathered[:, : self.org_vocab_size] if gathered is not None else None  # type: ignore[return-value]

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        self.weight = embedding.weight

    def set_quant_method(self, method: LinearMethod) -> None:
        """Quantize this head's weight once loaded (only load-time methods are supported)."""
        self.quant_method = method


LMHead = ParallelLMHead  # the name the loader, kernels' tests and benchmarks know
