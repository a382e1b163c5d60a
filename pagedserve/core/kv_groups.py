"""Which layers share a block table: the KV layer groups of a model with windowed layers
(vLLM's hybrid KV-cache manager, its `KVCacheGroupSpec`s).

A windowed layer reads only the last W positions, so once the context has slid past a
block, every layer with that window can give the block back; full-attention layers keep
theirs. Layers with the same window (None = full attention) form a kind; each kind is cut
into groups of `page_layers` layers, the same number for every kind (the gcd of the kinds'
sizes), and every group has its own block table per sequence, all drawing on one pool:

    Gemma 3, 6 layers (5 windowed : 1 full):  page_layers 1, groups [0] [1] [2] [3] [4] | [5]
    Gemma 2, 4 layers (alternating):          page_layers 2, groups [0 2] | [1 3]
    no windowed layer:                        one group of every layer (today's single table)

A block id is one page: `page_layers` layers' worth of K/V, in `page_layers` cache tensors
that every group shares. Slot j of whichever group holds a block lives in tensor j, so a
block costs the same whichever group takes it, and copies (copy-on-write) move the same
bytes in every tensor. Windowed blocks given back are reusable by any group at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroupPlan:
    # Per group: its layers' window (None = full attention) and its layers (indices into
    # the model's attention layers, in order; `page_layers` of them).
    windows: tuple[int | None, ...]
    layers: tuple[tuple[int, ...], ...]
    page_layers: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        """Whether any layer is windowed (else: one group, the plain paged manager)."""
        return any(w is not None for w in self.windows)

    def blocks_per_sequence(self, num_tokens: int, block_size: int, max_step_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` can hold at once, every group together, when a
        step computes at most `max_step_tokens` of its tokens; plus the hybrid manager's null
        block. A windowed group holds the blocks from its first query's window to its last
        query: at most (W - 1 + C - 1) // block_size + 2 for a step of C tokens."""
        whole = -(-num_tokens // block_size)
        if not self.hybrid:
            return whole
        step = min(max_step_tokens, num_tokens)
        return 1 + sum(whole if w is None else min(whole, (w + step - 2) // block_size + 2) for w in self.windows)

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, cache tensor) of attention layer `layer`."""
        for group, members in enumerate(self.layers):
            if layer in members:
                return group, members.index(layer)
        raise KeyError(f"layer {layer} is in no KV group")


def plan_kv_groups(layer_windows: Sequence[int | None]) -> KVGroupPlan:
    """Groups for layers with these windows (one entry per attention layer, in order)."""
    if not layer_windows:
        raise ValueError("a model needs at least one attention layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        if window is not None and window <= 0:
            raise ValueError(f"layer {layer}: sliding window must be > 0, got {window}")
        kinds.setdefault(window, []).append(layer)
    page = math.gcd(*(len(members) for members in kinds.values()))
    windows: list[int | None] = []
    layers: list[tuple[int, ...]] = []
    for window, members in kinds.items():
        for start in range(0, len(members), page):
            windows.append(window)
            layers.append(tuple(members[start : start + page]))
    return KVGroupPlan(tuple(windows), tuple(layers), page)
