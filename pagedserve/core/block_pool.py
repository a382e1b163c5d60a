"""The block pool: the single owner of KV block reference counts, the free queue and the
prefix-cache map.

Every KV block is in exactly one of three states:

    used       ref_cnt > 0                 in the block table of one or more sequences
    cached     ref_cnt == 0, has a hash    in the free queue; reusable as is by a cache hit
    free       ref_cnt == 0, no hash       in the free queue

The free queue is ordered, least recently freed first. Allocation takes from the front
and evicts a cached block's hash only when it takes that block. Sequences free their
blocks tail first, so a finished request's tail goes before the prompt head that other
requests are more likely to share.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Hands out KV block ids, tracks how many sequences hold each, and keeps the cache map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # An OrderedDict gives O(1) pop from the front and O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def num_evictable_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a cached prefix (O(free blocks); for on-demand stats)."""
        return sum(1 for b in self._free if self.block_hash[b] is not None)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` blocks from the front of the free queue, each with ref_cnt 1.

        A cached block taken here loses its hash (it is evicted).

        Raises:
            ValueError: if fewer blocks are free; callers check `num_free_blocks` first.
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self.block_hash[block_id]
            if block_hash is not None:
                del self._cached[block_hash]
                self.block_hash[block_id] = None
                self.num_evictions += 1
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Adds one holder to each block (a fork, or a cache hit on a used or cached block)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def release(self, block_ids: Iterable[int]) -> None:
        """Drops one holder from each block; blocks nobody holds go to the free queue's tail.

        Raises:
            ValueError: on a double free, before changing anything.
        """
        block_ids = list(block_ids)
        for block_id in block_ids:
            if self.ref_cnt[block_id] <= 0:
                raise ValueError(f"double free of KV block {block_id}")
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def allocate_contiguous(self, num_blocks: int) -> int | None:
        """Takes `num_blocks` consecutive free blocks (ids start..start+n-1), each ref_cnt 1.

        LoRA adapters live in such runs (their weights are read in place, so they must be
        contiguous). The highest-addressed free run is taken, away from where the free
        queue hands out KV blocks first. Cached blocks in the run are evicted.

        Returns:
            The first block id, or None if no run of that length is free.
        """
        run = 0
        for block_id in range(self.num_blocks - 1, -1, -1):
            run = run + 1 if self.ref_cnt[block_id] == 0 else 0
            if run == num_blocks:
                start = block_id
                for b in range(start, start + num_blocks):
                    del self._free[b]
                    old_hash = self.block_hash[b]
                    if old_hash is not None:
                        del self._cached[old_hash]
                        self.block_hash[b] = None
                        self.num_evictions += 1
                    self.ref_cnt[b] = 1
                return start
        return None

    # ---- prefix cache --------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding the KV of this hash, if cached (used or evictable)."""
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes) -> None:
        """Publishes a full, held block under its hash. A hash already cached keeps its block."""
        if self.ref_cnt[block_id] <= 0:
            raise ValueError(f"cannot cache unreferenced block {block_id}")
        if self.block_hash[block_id] is None and block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

    def is_evictable(self, block_id: int) -> bool:
        return self.ref_cnt[block_id] == 0

    def reset_prefix_cache(self) -> None:
        """Forgets every cached hash (blocks stay where they are)."""
        for block_id in self._cached.values():
            self.block_hash[block_id] = None
        self._cached.clear()

    # ---- checks --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts free + used == total, the free queue holds exactly the unreferenced blocks,
        and the cache map and per-block hashes agree."""
        assert all(c >= 0 for c in self.ref_cnt), "negative reference count"
        unreferenced = {i for i, c in enumerate(self.ref_cnt) if c == 0}
        assert unreferenced == set(self._free), "free queue differs from the unreferenced blocks"
        assert len(self._free) + sum(1 for c in self.ref_cnt if c > 0) == self.num_blocks
        for block_hash, block_id in self._cached.items():
            assert self.block_hash[block_id] == block_hash, f"cache map and block {block_id} disagree"
        assert sum(h is not None for h in self.block_hash) == len(self._cached)

    def assert_all_free(self, pinned: set[int] | None = None) -> None:
        """The leak check: every reference count is zero, except `pinned` blocks (held once each)."""
        self.check_integrity()
        pinned = pinned or set()
        held = [i for i, c in enumerate(self.ref_cnt) if c != (1 if i in pinned else 0)]
        assert not held, f"leaked KV blocks (unexpected reference counts): {held[:20]}"
