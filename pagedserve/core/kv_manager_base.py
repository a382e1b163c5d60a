"""What every KV manager shares: a pool of `num_blocks` blocks of `block_size` slots, the
pool's counters the scheduler and the stats read, and `allocate_slots`' contract.

    KVManagerBase                 pool counters, block_size, the abstract allocate_slots
      core/kv_cache_manager.py    KVCacheManager            (paged: block tables on a BlockPool)
      core/hybrid_kv_manager.py   HybridKVCacheManager      (paged, one table per layer group)
      core/contiguous.py          ContiguousKVCacheManager  (one region per sequence, ExtentPool)

The scheduler still sees only `core.protocols.KVManager`; this base only keeps the
implementations from repeating the same properties.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from pagedserve.request import Request


class PoolCounters(Protocol):
    """The counters both kinds of pool (core/block_pool.py, core/contiguous.py) keep."""

    num_blocks: int

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def usage(self) -> float: ...


class KVManagerBase(ABC):
    """A KV manager over one pool; subclasses set `block_size` and `pool` in __init__."""

    block_size: int
    pool: PoolCounters

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @abstractmethod
    def get_block_table(self, seq_id: str) -> list[int]: ...

    @abstractmethod
    def allocate_slots(
        self,
        seq_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        request: Request | None = None,
    ) -> bool:
        """Makes room for `num_new_tokens` K/V entries after `num_computed_tokens`.

        Args:
            cached_blocks: prefix-cache hits (from `find_cached_prefix`) for a sequence with
                no blocks yet; they hold its first `num_computed_tokens` tokens.
            request: the request itself; paging needs only the counts, but the contiguous
                baselines size their reservation from its prompt and output budget.
        Returns:
            False, changing nothing, if the pool has too little free memory; True otherwise.
        """


class RecomputeOnly:
    """Swap, not offered: a manager whose preemption always recomputes (the contiguous
    baselines, models with windowed layers). `no_swap_reason` names why in the error."""

    no_swap_reason = "this KV manager preempts by recompute only"

    def can_swap_out(self, seq_id: str) -> bool:
        return False

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        raise NotImplementedError(self.no_swap_reason)

    def can_swap_in(self, seq_id: str, num_tokens: int = 0) -> bool:
        return False

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        raise NotImplementedError(self.no_swap_reason)

    def free_swapped(self, seq_id: str) -> None:
        return None
