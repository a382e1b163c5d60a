"""Paged-attention backend interface (the choice of a backend for a device: selector.py).

A backend turns the step's `CommonAttentionMetadata` into its own metadata (index tensors,
masks, work partitions) ONCE per step in `build_metadata`; every layer then calls `forward`
with that object. Per-layer work must never rebuild indices or loop over requests in Python.

    runner:  meta = backend.build_metadata(common)         # once per step
    layer:   out  = meta.backend.forward(q, k, v, kv_cache, meta, scale)   # once per layer

A CUDA kernel backend (FlashAttention / paged kernels) slots in by subclassing
`AttentionBackend` and `AttentionMetadata` and returning it from `selector.get_attention_backend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedserve.attention.metadata import CommonAttentionMetadata


class AttentionMetadata:
    """Backend-specific per-step metadata. Subclasses are dataclasses owning index tensors.

    `backend` points back at the backend that built it, so an `Attention` layer needs only
    the metadata object to run (no module-level global carrying attention state).
    """

    __slots__ = ()
    backend: AttentionBackend
    num_tokens: int


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends over each request's full context."""

    name: str = "abstract"
    supports_kv_int8: bool = False

    @abstractmethod
    def build_metadata(self, common: CommonAttentionMetadata) -> AttentionMetadata:
        """Derive every index tensor / mask the layers need; called once per step."""

    @abstractmethod
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
        """Run one layer's paged attention.

        Args:
            query: (num_tokens, num_heads, head_dim), RoPE applied.
            key, value: (num_tokens, num_kv_heads, head_dim) for the step's new tokens.
            kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim); K at 0, V at 1.
                The new K/V are written at `slot_mapping` before attending.
            meta: what `build_metadata` returned for this step.
            scale: softmax scale (usually head_dim ** -0.5).
            sliding_window: a windowed layer's window W: the query at position p attends to
                keys p - W + 1 .. p only (Hugging Face's `kv_idx > q_idx - W`); None = all.
            softcap: scores become softcap * tanh(scores / softcap) before the softmax
                (Gemma 2); None = no capping.

        Returns:
            (num_tokens, num_heads, head_dim) attention output in the flat batch order.
        """
