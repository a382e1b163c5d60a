"""Paged-attention backend interface, and the choice of a backend for a device.

A backend turns the step's `CommonAttentionMetadata` into its own metadata (index tensors,
masks, work partitions) ONCE per step in `build_metadata`; every layer then calls `forward`
with that object. Per-layer work must never rebuild indices or loop over requests in Python.

    runner:  meta = backend.build_metadata(common)         # once per step
    layer:   out  = meta.backend.forward(q, k, v, kv_cache, meta, scale)   # once per layer

A CUDA kernel backend (FlashAttention / paged kernels) slots in by subclassing
`AttentionBackend` and `AttentionMetadata` and returning it from `get_attention_backend`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

import torch

from pagedserve.attention.metadata import CommonAttentionMetadata

logger = logging.getLogger(__name__)


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


def get_attention_backend(device: torch.device) -> AttentionBackend:
    """The attention backend for `device`.

    `PAGEDSERVE_ATTENTION_BACKEND` (read in `pagedserve.envs`) forces `torch` or `cpp`;
    unset, CPU gets the fused C++ kernel and everything else the pure-torch backend. On CPU
    the kernel measured 3.3-3.8x faster than gather + SDPA on decode and 1.1-1.5x on prefill
    chunks (benchmarks/attention_micro.py, fp32, 1 and 2 threads). When the C++ kernel
    cannot be built (no compiler, no ninja), the torch backend is used and a warning logged;
    a forced `cpp` then fails (KernelUnavailable), as every forced kernel does.
    """
    from pagedserve import envs
    from pagedserve.attention.torch_paged import TorchPagedAttentionBackend

    device = torch.device(device)
    choice = envs.attention_backend()
    if choice == "cpp" or (choice is None and device.type == "cpu"):
        from pagedserve.attention.cpp_paged import CppPagedAttentionBackend
        from pagedserve.cpp_build import KernelUnavailable

        # Not cpp_build.resolve: the backend loads its kernel itself (`cpp_paged.load_extension`,
        # which a test replaces to stand for a machine without a compiler).
        try:
            return CppPagedAttentionBackend(device=device)
        except KernelUnavailable as exc:
            if choice == "cpp":
                raise
            logger.warning("C++ paged attention unavailable, using the torch backend: %s", exc)
    return TorchPagedAttentionBackend(device=device)
