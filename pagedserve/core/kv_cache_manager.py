"""Per-sequence block tables on top of the block pool.

Block table of a sequence with 35 tokens computed, block_size 16:

    logical block:   0          1          2
    block id:      [ 7 ]      [ 3 ]      [ 12 ]
    tokens:        0..15      16..31     32..34 (+13 free slots)

A block shared by several sequences (after a fork) is copied before one of them writes
into it (copy-on-write); the copy is reported to the model runner as (src, dst) pairs,
which it must apply before the step's forward pass.
"""

from __future__ import annotations

from pagedserve.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every sequence's block table; asks the block pool for blocks and references."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_table(self, seq_id: str) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def blocks_needed(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """How many new blocks `allocate_slots` would take for these tokens."""
        table = self.block_tables.get(seq_id, [])
        needed = max(0, cdiv(num_computed_tokens + num_new_tokens, self.block_size) - len(table))
        return needed + int(self._needs_copy_on_write(table, num_computed_tokens, num_new_tokens))

    def allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Makes room for `num_new_tokens` K/V entries after `num_computed_tokens`.

        Returns:
            False, changing nothing, if the pool has too few free blocks; True otherwise.
        """
        if self.blocks_needed(seq_id, num_computed_tokens, num_new_tokens) > self.pool.num_free_blocks:
            return False
        table = self.block_tables.setdefault(seq_id, [])
        if self._needs_copy_on_write(table, num_computed_tokens, num_new_tokens):
            index = num_computed_tokens // self.block_size
            shared = table[index]
            (private,) = self.pool.allocate(1)
            self._pending_copies.append((shared, private))
            table[index] = private
            self.pool.release([shared])
        missing = cdiv(num_computed_tokens + num_new_tokens, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
        return True

    def _needs_copy_on_write(self, table: list[int], num_computed_tokens: int, num_new_tokens: int) -> bool:
        # Only the block receiving the first new token can be shared and partly filled:
        # blocks after it are fresh, blocks before it are full and never written again.
        index = num_computed_tokens // self.block_size
        return num_new_tokens > 0 and index < len(table) and self.pool.ref_cnt[table[index]] > 1

    def fork(self, parent_id: str, child_id: str) -> None:
        """Gives `child_id` the parent's blocks, shared (reference count + 1, no copy)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = list(self.block_tables.get(parent_id, []))
        self.pool.share(table)
        self.block_tables[child_id] = table

    def free(self, seq_id: str) -> None:
        """Releases every block of the sequence, last block first."""
        table = self.block_tables.pop(seq_id, None)
        if table:
            self.pool.release(reversed(table))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs accumulated since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of tables holding it."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block_id in table:
                holders[block_id] += 1
        assert holders == self.pool.ref_cnt, "reference counts differ from the block tables"

    def assert_all_free(self) -> None:
        """The leak check: no block table left and every reference count zero."""
        assert not self.block_tables, f"sequences still hold blocks: {list(self.block_tables)[:10]}"
        self.pool.assert_all_free()
