"""Attention for models whose layers are in several KV groups (core/kv_groups.py): each
group has its own block tables, so its own slot mapping and backend metadata per step.

    runner:  meta = GroupedAttentionBackend(inner, groups).build_grouped(commons)  # a common per group
    layer:   out  = meta.backend.forward(q, k, v, kv_cache, meta, ...)              # unchanged call

A layer names its group by the cache tensor it holds: the runner gives every layer its own
view of the shared cache tensor (worker/model_runner.py), and the view's identity maps to
the layer's group. So the `Attention` layer and every model stay as they are, and the
inner backend runs each layer exactly as it would with one group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.metadata import CommonAttentionMetadata


@dataclass(slots=True)
class GroupedAttentionMetadata(AttentionMetadata):
    backend: GroupedAttentionBackend
    num_tokens: int
    # One per KV group, in group order: what the inner backend built from that group's tables.
    groups: list[AttentionMetadata]


class GroupedAttentionBackend(AttentionBackend):
    """Args:
        inner: the device's backend, run once per layer with its group's metadata.
        cache_groups: id() of each layer's cache view -> the layer's KV group.
    """

    name = "grouped"

    def __init__(self, inner: AttentionBackend, cache_groups: dict[int, int]) -> None:
        self.inner = inner
        self.cache_groups = cache_groups
        self.supports_kv_int8 = inner.supports_kv_int8

    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        raise TypeError("grouped attention needs one CommonAttentionMetadata per KV group (build_grouped)")

    def build_grouped(self, commons: list[CommonAttentionMetadata]) -> GroupedAttentionMetadata:
        return GroupedAttentionMetadata(
            backend=self, num_tokens=commons[0].num_tokens,
            groups=[self.inner.build_metadata(common) for common in commons],
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        assert isinstance(meta, GroupedAttentionMetadata)
        inner = meta.groups[self.cache_groups[id(kv_cache)]]
        return self.inner.forward(query, key, value, kv_cache, inner, scale, sliding_window, softcap)
