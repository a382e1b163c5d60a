"""Paged attention as one opaque op for torch.compile, and the step context it reads.

A compiled graph must not depend on the step's attention metadata: block tables grow every
`block_size` tokens, decode work items change with context length, and a graph guarded on
them would recompile all the time. So inside a compiled forward an `Attention` layer calls

    torch.ops.pagedserve_compile.attention(q, k, v, layer_idx, scale) -> (T_pad, H, D)

which dynamo sees as one op with a fake (shape-only) implementation, and which at run time
reads the step's metadata and KV caches from the `step_context` the runner sets around the
call (vLLM's forward context, set by a context manager that always resets). The graph sees
only q/k/v, whose shapes are static per compiled size.

Padding rows (T_pad > meta.num_tokens) never reach the backend: they write no KV slot and
come back as zeros.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedserve.attention.backend import AttentionMetadata


class MissedGraph(RuntimeError):
    """An `Attention` layer ran eagerly without metadata: the compiled decode's frame missed
    its graphs' guards and dynamo's run-only mode ran it as plain Python."""


@dataclass(slots=True)
class StepContext:
    meta: AttentionMetadata | None  # None: a warm-up call, no real tokens
    kv_caches: list[torch.Tensor]  # by layer_idx


_CURRENT: StepContext | None = None


@contextlib.contextmanager
def step_context(meta: AttentionMetadata | None, kv_caches: list[torch.Tensor]) -> Iterator[None]:
    """Makes this step's metadata visible to the opaque attention op; always resets."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, StepContext(meta, kv_caches)
    try:
        yield
    finally:
        _CURRENT = previous


@torch.library.custom_op("pagedserve_compile::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    """q (T_pad, H, D), k / v (T_pad, KVH, D) -> (T_pad, H, D); writes the step's K/V into the
    layer's cache (hidden from the graph: the cache is not an input of it)."""
    ctx = _CURRENT
    if ctx is None:
        raise RuntimeError("pagedserve_compile::attention called outside a step_context")
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    meta = ctx.meta
    n = 0 if meta is None else meta.num_tokens
    if n:
        assert meta is not None
        kv_cache = ctx.kv_caches[layer_idx]
        out[:n] = meta.backend.forward(q[:n], k[:n], v[:n], kv_cache, meta, scale)
    return out


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
