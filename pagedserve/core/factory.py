"""Builds the KV cache manager and scheduler that the config names.

The paged manager and continuous batching are the product; the other kinds are the
baselines the benchmark suite compares against on the same runner and memory. Both kinds
of manager implement `core.protocols.KVManager`, the scheduler's only view of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.config import BATCHING_POLICIES, KV_ALLOCATIONS, CacheConfig, SchedulerConfig
from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_groups import KVGroupPlan
from pagedserve.core.protocols import AdapterResidency, KVManager
from pagedserve.core.scheduler import PreemptionPolicy, Scheduler, SchedulerLimits

if TYPE_CHECKING:
    from pagedserve.core.contiguous import ContiguousKVCacheManager

logger = logging.getLogger(__name__)


def build_kv_manager(
    cache: CacheConfig, num_blocks: int, max_model_len: int, num_swap_blocks: int = 0,
    groups: KVGroupPlan | None = None,
) -> KVCacheManager | HybridKVCacheManager | ContiguousKVCacheManager:
    """The concrete manager (the engine also reads its pool for stats and LoRA placement).

    `groups`: the model's KV layer groups (core/kv_groups.py); with windowed layers the
    paged manager keeps one table per group and gives back what slid out of the window."""
    if groups is not None and groups.hybrid:
        if cache.kv_allocation != "paged":
            raise ValueError(f"kv_allocation={cache.kv_allocation!r} is not supported for models with "
                             "sliding-window layers; use 'paged'")
        if num_swap_blocks:
            logger.info("swap space unused: models with sliding-window layers preempt by recompute")
        return HybridKVCacheManager(num_blocks, cache.block_size, groups.windows, cache.enable_prefix_caching)
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
