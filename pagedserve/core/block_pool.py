"""The block pool: the single owner of KV block reference counts and the free queue.

Every KV block is in exactly one of two states:

    used  (ref_cnt > 0): in the block table of one or more sequences
    free  (ref_cnt == 0): in the free queue, reusable

The free queue is ordered: blocks freed earlier are handed out first. A sequence frees
its blocks tail first, so when prefix caching keeps freed blocks around, the blocks
most likely to be useful again (a prompt's head) are the last to be reused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class BlockPool:
    """Hands out KV block ids and tracks how many sequences hold each one."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        # An OrderedDict gives O(1) pop from the front and O(1) removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.num_used_blocks / self.num_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` free blocks, each with ref_cnt 1.

        Raises:
            ValueError: if fewer blocks are free; callers check `num_free_blocks` first.
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Adds one holder to each block (a fork, or a reuse of a cached block)."""
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

    def check_integrity(self) -> None:
        """Asserts free + used == total and that the free queue holds exactly the unreferenced blocks."""
        unreferenced = {i for i, c in enumerate(self.ref_cnt) if c == 0}
        assert all(c >= 0 for c in self.ref_cnt), "negative reference count"
        assert unreferenced == set(self._free), "free queue differs from the unreferenced blocks"
        assert len(self._free) + sum(1 for c in self.ref_cnt if c > 0) == self.num_blocks

    def assert_all_free(self) -> None:
        """Asserts that no block is held: every reference count is zero (the leak check)."""
        self.check_integrity()
        held = [i for i, c in enumerate(self.ref_cnt) if c != 0]
        assert not held, f"leaked KV blocks (still referenced): {held[:20]}"
