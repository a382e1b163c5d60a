"""What the scheduler needs from its collaborators, as protocols (no torch, no LoRA code).

    Scheduler(limits, kv: KVManager, preemption, lora: AdapterResidency | None)
        kv    core/kv_cache_manager.py  KVCacheManager            (paged: the product)
              core/hybrid_kv_manager.py HybridKVCacheManager      (paged, sliding-window models)
              core/contiguous.py        ContiguousKVCacheManager  (the benchmarks' baselines)
        lora  lora/manager.py           LoRAManager               (None: LoRA off)

Both come in through the constructor; the scheduler never reads their internals (block
pools, swap tables), so `core/` imports nothing heavier than the standard library and its
tests run on fakes. Structural typing: an implementation does not inherit from these, mypy
checks it where it is passed as one (core/factory.py, engine/llm_engine.py).
"""

from __future__ import annotations

import enum
from typing import Any, Protocol

from pagedserve.request import Request

# Where a resident adapter's weights are (lora/segments.py's ResidentAdapter). Opaque to the
# scheduler, which hands it from the residency to the runner, so core/ names no LoRA type.
AdapterPlacement = Any


class Residency(enum.Enum):
    """Whether an adapter can be used this step (the scheduler's question to the LoRA manager)."""

    READY = enum.auto()  # resident on the device now
    LOADING = enum.auto()  # a disk load is under way; try again next step
    FAILED = enum.auto()  # the adapter cannot be loaded; its requests fail


class AdapterResidency(Protocol):
    """Where LoRA adapters live, as far as admitting and running requests goes.

    An adapter used by a running request is pinned (`acquire` / `release` pairs); only idle
    ones are evicted, so a scheduled request's placement holds until the step has run.
    """

    def prepare(self, lora_id: int) -> Residency:
        """Makes the adapter resident if it can be now; never blocks on disk."""
        ...

    def error(self, lora_id: int) -> Exception:
        """Why the adapter failed to load (after `prepare` said FAILED)."""
        ...

    def acquire(self, lora_id: int) -> None: ...

    def release(self, lora_id: int) -> None: ...

    def evict_idle(self) -> bool:
        """Frees the blocks of the least recently used idle adapter; False if there is none."""
        ...

    def resident(self, lora_id: int) -> AdapterPlacement:
        """Where a resident adapter's weights are (handed to the runner in `SchedulerOutput`)."""
        ...

    @property
    def num_device_blocks(self) -> int:
        """KV blocks holding resident adapters (statistics report them apart from requests' KV)."""
        ...


class KVManager(Protocol):
    """Per-sequence KV slots: the paged manager and the contiguous baselines.

    Sequences are named by request id; block ids are plain integers the runner turns into
    slot mappings. Every method that can fail for lack of memory returns False and changes
    nothing.
    """

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def usage(self) -> float: ...

    def get_block_table(self, seq_id: str) -> list[int]:
        """The sequence's block ids; with several layer groups, their tables back to back."""
        ...

    def allocate_slots(
        self,
        seq_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        request: Request | None = None,
    ) -> bool:
        """Room for `num_new_tokens` K/V entries after `num_computed_tokens`; False if it does not fit."""
        ...

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Keeps the slots of the first `num_tokens` tokens (speculative decoding's rejections)."""
        ...

    def fork(self, parent_id: str, child_id: str) -> None:
        """Gives `child_id` the parent's KV, shared."""
        ...

    def free(self, seq_id: str) -> None: ...

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the runner must apply before this step's forward pass."""
        ...

    # ---- swap (preemption by copying to host memory) ---------------------------------------

    def can_swap_out(self, seq_id: str) -> bool: ...

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        """Frees the sequence's device blocks; returns the (device, host) copies to make."""
        ...

    def can_swap_in(self, seq_id: str, num_tokens: int = 0) -> bool:
        """Whether the swapped sequence fits back, with slots for its first `num_tokens` tokens."""
        ...

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        """Gives the swapped sequence device blocks again; returns the (host, device) copies."""
        ...

    def free_swapped(self, seq_id: str) -> None: ...

    # ---- prefix cache ----------------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request ([] without a cache)."""
        ...

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publishes the request's full blocks once its first `num_tokens` are computed."""
        ...

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (only while no sequence holds blocks)."""
        ...

    # ---- checks ----------------------------------------------------------------------------

    def check_integrity(self) -> None: ...

    def assert_all_free(self, adapter_blocks: set[int] | None = None) -> None:
        """The leak check: nothing held except the given LoRA adapter blocks."""
        ...
