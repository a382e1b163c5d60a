"""Builds the KV cache manager and scheduler that the config names.

The paged manager and continuous batching are the product; the other kinds are the
baselines the benchmark suite compares against on the same runner and memory. Both kinds
of manager implement `core.protocols.KVManager`, the scheduler's only view of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.config import BATCHING_POLICIES, KV_ALLOCATIONS, CacheConfig, SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.protocols import AdapterResidency, KVManager
from pagedserve.core.scheduler import PreemptionPolicy, Scheduler, SchedulerLimits

if TYPE_CHECKING:
    from pagedserve.core.contiguous import ContiguousKVCacheManager



def build_kv_manager(
    cache: CacheConfig, num_blocks: int, max_model_len: int, num_swap_blocks: int = 0
) -> KVCacheManager | ContiguousKVCacheManager:
    """The concrete manager (the engine also reads its pool for stats and LoRA placement)."""
    if cache.kv_allocation == "paged":
        return KVCacheManager(
            num_blocks, cache.block_size, enable_caching=cache.enable_prefix_caching, num_swap_blocks=num_swap_blocks
        )
    if cache.kv_allocation in KV_ALLOCATIONS:
        from pagedserve.core.contiguous import ContiguousKVCacheManager

        return ContiguousKVCacheManager(num_blocks, cache.block_size, cache.kv_allocation, max_model_len)
    raise ValueError(f"kv_allocation must be one of {', '.join(KV_ALLOCATIONS)}; got {cache.kv_allocation!r}")


def build_scheduler(
    config: SchedulerConfig,
    kv: KVManager,
    preemption: PreemptionPolicy | None = None,
    lora: AdapterResidency | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Scheduler:
    """`clock`: what the batching baselines measure their windows on (the engine's clock)."""
    limits = SchedulerLimits(
        config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill, config.scheduling_policy
    )
    if config.batching == "continuous":
        return Scheduler(limits, kv, preemption, lora)
    if config.batching in BATCHING_POLICIES:
        from pagedserve.core.batching import build_batch_scheduler

        return build_batch_scheduler(config.batching, limits, kv, config.batch_window_s, preemption, lora,
                                     clock=clock)
    raise ValueError(f"batching must be one of {', '.join(BATCHING_POLICIES)}; got {config.batching!r}")
