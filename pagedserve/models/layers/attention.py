"""The paged `Attention` layer: owns one layer's KV cache handle, delegates to the backend.

The model runner finds every `Attention` module, sorts them by `layer_idx`, reads
`num_kv_heads` / `head_dim` to size the cache and assigns `attn.kv_cache`:

    kv_cache: (2, num_blocks, block_size, num_kv_heads, head_dim), K at [0], V at [1]
              int8 cache: last dim head_dim + 4 (values + a float32 scale per row; see
              pagedserve/quantization/kv_int8.py)

It is a plain attribute, not a buffer: it is not part of the state dict, and `model.to()`
never copies it.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.backend import AttentionMetadata

# Importing attention_op also registers the opaque op a compiled graph calls.
from pagedserve.compilation.attention_op import MissedGraph


class Attention(nn.Module):
    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int,
        sliding_window: int | None = None, softcap: float | None = None,
    ) -> None:
        """`sliding_window`: this layer attends to the last `sliding_window` positions only;
        `softcap`: attention scores capped to softcap * tanh(scores / softcap) (Gemma 2)."""
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_attention_heads={num_heads} not divisible by num_key_value_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.kv_cache: torch.Tensor | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata | None
    ) -> torch.Tensor:
        """q (T, H, D), k/v (T, KVH, D), RoPE applied -> (T, H * D).

        `meta` is None inside a compiled decode graph (pagedserve/compilation/decode.py): the
        step's metadata then reaches the backend through the opaque op's step context, so the
        graph never depends on it."""
        if torch.compiler.is_compiling():
            if self.sliding_window is not None or self.softcap is not None:
                # The opaque op carries no window / softcap: the compile fails and the
                # runner keeps the eager decode (build_compiled_decode).
                raise NotImplementedError(
                    f"layer {self.layer_idx}: compiled decode has no sliding window / softcap")
            out = torch.ops.pagedserve_compile.attention(q, k, v, self.layer_idx, self.scale)
            return out.reshape(out.shape[0], self.num_heads * self.head_dim)
        if meta is None:
            raise MissedGraph(f"layer {self.layer_idx}: no attention metadata outside a compiled graph")
        if self.kv_cache is None:
            raise RuntimeError(
                f"layer {self.layer_idx}: kv_cache was never assigned by the model runner"
            )
        out = meta.backend.forward(
            q, k, v, self.kv_cache, meta, self.scale, self.sliding_window, self.softcap)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        window = f", sliding_window={self.sliding_window}" if self.sliding_window else ""
        cap = f", softcap={self.softcap}" if self.softcap else ""
        return (f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}{window}{cap}")
