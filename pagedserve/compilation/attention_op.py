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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    """q (T_pad, H, D), k / v (T_pad, KVH, D) -> (T_pad, H, D); writes the step's K/V into the
    layer's cache (hidden from the graph: the cache is not an input of it)."""
    ctx = _CURRENT
    if ctx is None:
        raise RuntimeError("pagedserve_compile::attention called outside a step_context")
    meta = ctx.meta
    n = 0 if meta is None else meta.num_tokens
    if n == q.shape[0]:  # no padding: the common case, no copy
        assert meta is not None
        return meta.backend.forward(q, k, v, ctx.kv_caches[layer_idx], meta, scale).contiguous()
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if n:
        assert meta is not None
        out[:n] = meta.backend.forward(q[:n], k[:n], v[:n], ctx.kv_caches[layer_idx], meta, scale)
    return out


def _fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


# A plain op library rather than torch.library.custom_op: it dispatches in ~8 us instead of
# ~16 (custom_op adds autograd wrappers and an aliasing check per call), paid 30 times a step.
_LIB = torch.library.Library("pagedserve_compile", "DEF")
_LIB.define("attention(Tensor q, Tensor k, Tensor v, int layer_idx, float scale) -> Tensor")
_LIB.impl("attention", attention, "CompositeExplicitAutograd")
torch.library.register_fake("pagedserve_compile::attention", _fake, lib=_LIB)
