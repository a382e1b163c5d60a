"""N-gram prompt lookup: guess that the text continues as it did after the last time its
final n tokens appeared (in the prompt or the output so far).

Pure host code on token-id lists: no model, no tensors. Copy-heavy requests (summarize,
rewrite, extract from a given passage, edit code) repeat long runs of their prompt, so a
match often predicts several tokens exactly; open-ended chat rarely matches.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to `max_tokens` (default k) tokens that followed the latest earlier occurrence
        of the longest suffix n-gram (n from prompt_lookup_max down to prompt_lookup_min);
        [] when no suffix n-gram occurred before."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        num = len(token_ids)
        if k <= 0 or num <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            suffix = tokens[num - n :]
            # Windows starting at 0 .. num-n-1: every earlier occurrence, not the suffix itself.
            windows = sliding_window_view(tokens[: num - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence is the likeliest to recur
                return token_ids[start : start + k]
        return []
