"""Per-step sampling inputs, built by the model runner from the scheduled requests."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PenaltyInputs:
    """Penalty parameters for the rows that use any; other rows are untouched."""

    rows: torch.Tensor  # (P,) int64 row indices into the logits
    presence: torch.Tensor  # (P,)
    frequency: torch.Tensor  # (P,)
    repetition: torch.Tensor  # (P,)
    output_token_ids: torch.Tensor  # (P, max_out) int64, padded with `vocab_size`
    prompt_token_ids: torch.Tensor  # (P, max_prompt) int64, padded with `vocab_size`


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    # (N,) float; greedy rows hold 1.0 so the division is harmless. None when all greedy.
    temperature: torch.Tensor | None
    greedy_mask: torch.Tensor | None  # (N,) bool; None when all greedy or none greedy
    top_p: torch.Tensor | None  # (N,) or None when no row uses it
    top_k: torch.Tensor | None  # (N,) int64, vocab size where disabled
    min_p: torch.Tensor | None  # (N,)
    # Row index -> its own generator, for requests with a seed.
    generators: dict[int, torch.Generator]
    penalties: PenaltyInputs | None
    # (rows, token_ids, values) additive biases; also carries min_tokens' -inf on stop tokens.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # Largest `logprobs` any row asked for; None if no row wants logprobs.
    max_num_logprobs: int | None
    # Structured outputs: (rows (R,) int64, bitmask (R, ceil(V/32)) int32) of the tokens
    # each constrained row may take; None when no row is constrained.
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
