"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

# Default share of the host's available memory given to the KV cache on CPU, and its cap:
# the weights, activations and the Python process need the rest.
_DEFAULT_SHARE = 0.25
_DEFAULT_CAP_BYTES = 4 << 30


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def default_kv_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return int(min(psutil.virtual_memory().available * _DEFAULT_SHARE, _DEFAULT_CAP_BYTES))


def num_blocks_for(spec: KVCacheSpec, memory_bytes: int) -> int:
    return memory_bytes // spec.bytes_per_block


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One (2, num_blocks, block_size, num_kv_heads, head_dim) tensor per layer: [0] = K, [1] = V.

    Zeroed, not just allocated: attention reads padding slots of unfilled blocks (and masks
    them), and a NaN left in uninitialised memory would survive a zero attention weight.
    """
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
