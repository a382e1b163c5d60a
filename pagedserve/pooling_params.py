"""Embeddings from a causal LM: what `LLM.embed` and `/v1/embeddings` ask of a request.

A pooling request runs its prompt through the model like any other (paged KV cache, chunked
prefill, prefix cache, LoRA) and ends at the last prompt token: its embedding is the final
hidden state there (after the model's last norm), as vLLM's pooling runner does for a
decoder-only model ("LAST" pooling), L2-normalized unless asked otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PoolingParams:
    """vLLM's names. `dimensions`: only the model's hidden size (no Matryoshka truncation here)."""

    normalize: bool = True
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def validate(self, hidden_size: int) -> None:
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")
        if self.dimensions is not None and self.dimensions != hidden_size:
            raise ValueError(
                f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot be "
                f"shortened (not a Matryoshka model), got {self.dimensions}")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or self.truncate_prompt_tokens < 1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, got {self.truncate_prompt_tokens!r}")
