"""Applying a step's grammar bitmask to the logits, vectorized over rows and vocabulary."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Sets disallowed tokens' logits to -inf, in place.

    logits: (N, V) float; rows: (R,) int64 indices of the constrained rows;
    bitmask: (R, ceil(V / 32)) int32, bit j of word i allows token 32 * i + j.
    """
    vocab = logits.shape[1]
    bits = _BITS.to(bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :vocab].bool()  # (R, V)
    if rows.numel() == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))  # every row constrained, rows == arange(N)
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
