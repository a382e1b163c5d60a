"""Sizing and allocating the paged KV cache.

One tensor per layer, K at [0] and V at [1]; flat slot = block_id * block_size + offset:

    float cache (dtype of the model):  (2, num_blocks, block_size, num_kv_heads, head_dim)
    int8 cache  (kv_cache_dtype int8): (2, num_blocks, block_size, num_kv_heads, head_dim + 4)
        each (token, head) row = head_dim int8 values + their float32 scale (4 bytes), see
        pagedserve/quantization/kv_int8.py; the scale bytes are counted in bytes_per_token.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from pagedserve.config import KV_CACHE_DTYPES
from pagedserve.quantization.kv_int8 import row_bytes
from pagedserve.worker import huge_pages

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
    # torch.int8 for the int8 cache (values + per-row float32 scales), else the model dtype.
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.int8

    @property
    def last_dim(self) -> int:
        """Elements per (token, head) row: head_dim, plus the scale's 4 bytes when int8."""
        return row_bytes(self.head_dim) if self.quantized else self.head_dim

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.last_dim * elem

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def kv_cache_bytes_for_utilization(device: torch.device, utilization: float, weight_bytes: int) -> int:
    """vLLM's gpu_memory_utilization: the KV cache gets `utilization` of the memory there was
    before the weights were loaded (what is available now plus the weights), less the weights.

    On CPU "memory" is the host's available memory, as vLLM's CPU backend sizes its KV space
    from host memory (VLLM_CPU_KVCACHE_SPACE).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = psutil.virtual_memory().available
    budget = int(utilization * (free + weight_bytes)) - weight_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves no memory for the KV cache: "
            f"{utilization} x {(free + weight_bytes) / 2**30:.1f} GiB is less than the weights "
            f"({weight_bytes / 2**30:.2f} GiB)"
        )
    return budget


def default_kv_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return int(min(psutil.virtual_memory().available * _DEFAULT_SHARE, _DEFAULT_CAP_BYTES))


def num_blocks_for(spec: KVCacheSpec, memory_bytes: int) -> int:
    return memory_bytes // spec.bytes_per_block


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor dtype for CacheConfig.kv_cache_dtype ("auto": the model's dtype)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    """One (2, num_blocks, block_size, num_kv_heads, last_dim) tensor per layer: [0] = K, [1] = V.

    Zeroed, not just allocated: attention reads padding slots of unfilled blocks (and masks
    them), and a NaN left in uninitialised memory would survive a zero attention weight.
    """
    shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.last_dim)
    return [huge_pages.zeros(shape, spec.dtype, device) for _ in range(spec.num_layers)]
