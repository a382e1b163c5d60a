"""Paged KV for models with windowed layers: one block table per layer group
(core/kv_groups.py), all on one block pool, and windowed groups give back the blocks that
slid out of their window (vLLM's hybrid KV-cache manager).

Block tables of one sequence, 23 tokens computed, block_size 4, window 8, 2 groups:

    logical block:     0    1    2    3    4    5
    full group:      [ 7 ][ 3 ][ 12][ 9 ][ 4 ][ 8 ]
    windowed group:  [ N ][ N ][ N ][ N ][ 6 ][ 11]     N = the null block

The step's first query, position 23, sees keys 16..23 (p - W < j <= p), and later queries
see less of the past, so blocks 0..3 (keys 0..15) are never read again: before the step
they went back to the pool. A block is given back once all of it lies before the step's
first query's window, so a windowed group holds at most ceil(W / block_size) + 1 blocks
per decoding sequence, plus what a prefill chunk needs. The null block stands in for the
blocks given back so positions keep their table index: one block held by the manager,
never written (no new token maps to it) and read by windowed attention only at positions
its mask hides.

Every table of a sequence has the same length (the blocks for its tokens so far), so the
scheduler sees them back to back as one list (`get_block_table`), which the model runner
cuts into `num_groups` equal parts (worker/model_runner.py).

Prefix caching: every group publishes its full blocks under its own hash chain (salted by
the group, since a block of one group holds other layers' K/V than another's). A block a
windowed group gave back keeps its hash in the pool's free queue until it is reallocated,
which evicts the hash; so a lookup finds only blocks whose K/V are still there. A hit of
k blocks needs all k from every full-attention group but, from a windowed group, only the
blocks the first recomputed query can see (those from (k * block_size - W + 1) //
block_size on); the blocks before them stay the null block. The longest k that every
group can serve wins.

Not offered here (each one is refused, not silently wrong):
  * swap: preemption recomputes (`can_swap_out` is False);
  * contiguous allocation: the baselines keep every block.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.kv_manager_base import KVManagerBase, RecomputeOnly
from pagedserve.request import Request


class HybridKVCacheManager(RecomputeOnly, KVManagerBase):
    """Per-group block tables on one pool; implements `core.protocols.KVManager`.

    Args:
        windows: per layer group, its window in tokens (None = full attention).
    """

    no_swap_reason = "models with windowed layers preempt by recompute only"

    pool: BlockPool

    def __init__(
        self, num_blocks: int, block_size: int, windows: Sequence[int | None], enable_caching: bool = False
    ) -> None:
        if not windows:
            raise ValueError("a hybrid KV manager needs at least one layer group")
        self.block_size = block_size
        self.windows = list(windows)
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        (self.null_block,) = self.pool.allocate(1)
        self.groups = [
            KVCacheManager(num_blocks, block_size, enable_caching, pool=self.pool, hash_salt=b"group%d" % index)
            for index in range(len(self.windows))
        ]
        for group in self.groups:
            group.null_block = self.null_block
        # Per windowed group: how many leading blocks of each sequence were given back.
        self._slid: list[dict[str, int]] = [{} for _ in self.windows]
        # A prefix hit's blocks for every group, from `find_cached_prefix` to `allocate_slots`.
        self._hits: dict[str, list[list[int]]] = {}

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    # The null block is the manager's, not a sequence's: counters leave it out, so usage
    # reads 0 when no sequence holds blocks, as with the plain manager.
    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks - 1

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.pool.num_blocks

    def get_block_table(self, seq_id: str) -> list[int]:
        """The groups' tables back to back (all of one length: the runner splits them)."""
        return [b for group in self.groups for b in group.get_block_table(seq_id)]

    def group_block_tables(self, seq_id: str) -> list[list[int]]:
        return [list(group.get_block_table(seq_id)) for group in self.groups]

    def num_held_blocks(self, seq_id: str, group: int) -> int:
        """Real blocks (not the null block) that `group`'s table holds for the sequence."""
        return sum(b != self.null_block for b in self.groups[group].get_block_table(seq_id))

    def _slide_target(self, group: int, seq_id: str, num_computed_tokens: int) -> tuple[int, int]:
        """(blocks given back so far, blocks that may be given back before a step whose
        first query is at `num_computed_tokens`): those wholly before its first key."""
        done = self._slid[group].get(seq_id, 0)
        window = self.windows[group]
        if window is None:
            return done, done
        table = self.groups[group].get_block_table(seq_id)
        first_key = num_computed_tokens - window + 1
        return done, max(done, min(first_key // self.block_size, len(table)))

    def blocks_needed(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Free blocks `allocate_slots` would take: every group's new blocks, less the
        windowed blocks it gives back first."""
        needed = 0
        for index, group in enumerate(self.groups):
            done, target = self._slide_target(index, seq_id, num_computed_tokens)
            needed += group.blocks_needed(seq_id, num_computed_tokens, num_new_tokens) - (target - done)
        return needed

    def allocate_slots(
        self,
        seq_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        request: Request | None = None,
    ) -> bool:
        """See `KVManagerBase.allocate_slots`. Windowed groups first give back the blocks
        the step's queries cannot see, so the need counted is the true one."""
        if cached_blocks:
            return self._allocate_with_hits(seq_id, num_computed_tokens, num_new_tokens, cached_blocks)
        if self.blocks_needed(seq_id, num_computed_tokens, num_new_tokens) > self.pool.num_free_blocks:
            return False
        for index in range(self.num_groups):
            self._slide(index, seq_id, num_computed_tokens)
        for group in self.groups:
            allocated = group.allocate_slots(seq_id, num_computed_tokens, num_new_tokens)
            assert allocated, "counted above"
        return True

    def _allocate_with_hits(
        self, seq_id: str, num_computed_tokens: int, num_new_tokens: int, cached_blocks: list[int]
    ) -> bool:
        """A new sequence starting on the prefix hit `find_cached_prefix` found for it."""
        hits = self._hits.get(seq_id)
        assert hits is not None and hits[0] == cached_blocks, "cached_blocks must come from find_cached_prefix"
        total = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        # New blocks, plus the hits taken out of the free queue (cached, unreferenced).
        needed = sum(total - len(h) + sum(b != self.null_block and self.pool.is_evictable(b) for b in h)
                     for h in hits)
        if needed > self.pool.num_free_blocks:
            return False
        del self._hits[seq_id]
        for index, (group, group_hits) in enumerate(zip(self.groups, hits, strict=True)):
            allocated = group.allocate_slots(seq_id, num_computed_tokens, num_new_tokens, group_hits)
            assert allocated, "counted above"
            slid = sum(b == self.null_block for b in group_hits)
            if slid:
                self._slid[index][seq_id] = slid
        return True

    def _slide(self, group: int, seq_id: str, num_computed_tokens: int) -> None:
        done, target = self._slide_target(group, seq_id, num_computed_tokens)
        if target == done:
            return
        table = self.groups[group].block_tables[seq_id]
        gone = table[done:target]
        # Shared blocks (after a fork) lose one holder; the null block gains one per entry,
        # so reference counts still equal the tables holding each block.
        self.pool.share([self.null_block] * len(gone))
        table[done:target] = [self.null_block] * len(gone)
        self.pool.release(reversed(gone))
        self._slid[group][seq_id] = target

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Speculative decoding's rejections: the tail blocks go in every group (never slid:
        the kept tokens include the step's first query, which the slide kept in view)."""
        for group in self.groups:
            group.rollback(seq_id, num_tokens)

    def fork(self, parent_id: str, child_id: str) -> None:
        for index, group in enumerate(self.groups):
            group.fork(parent_id, child_id)
            if parent_id in self._slid[index]:
                self._slid[index][child_id] = self._slid[index][parent_id]

    def free(self, seq_id: str) -> None:
        self._hits.pop(seq_id, None)
        for index, group in enumerate(self.groups):
            group.free(seq_id)
            self._slid[index].pop(seq_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        return [pair for group in self.groups for pair in group.take_pending_copies()]

    # ---- prefix cache: off ---------------------------------------------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The hit for the first group (its length is the hit's, in blocks); the other
        groups' blocks wait for `allocate_slots`. See the module docstring."""
        self._hits.pop(request.request_id, None)
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        bs = self.block_size
        num = (request.num_tokens - 1) // bs
        for group, window in zip(self.groups, self.windows, strict=True):
            if window is None:  # full attention: the longest prefix cached in every such group
                num = min(num, len(group.find_cached_prefix(request)))
        hashes = [group.block_hashes(request) for group in self.groups]
        lookup = self.pool.lookup
        for k in range(num, 0, -1):
            hits: list[list[int]] = []
            for group_hashes, window in zip(hashes, self.windows, strict=True):
                first = 0 if window is None else max(0, (k * bs - window + 1) // bs)
                blocks = [lookup(h) for h in group_hashes[first:k]]
                if None in blocks:
                    break
                hits.append([self.null_block] * first + [b for b in blocks if b is not None])
            else:
                self._hits[request.request_id] = hits
                return hits[0]
        return []

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        for group in self.groups:
            group.cache_full_blocks(request, num_tokens)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    # ---- checks --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Pool invariants; each block's reference count equals the tables holding it (the
        null block: one more, the manager's own); windowed tables keep their window."""
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        holders[self.null_block] = 1
        for group in self.groups:
            for table in group.block_tables.values():
                for block_id in table:
                    holders[block_id] += 1
        assert holders == self.pool.ref_cnt, "reference counts differ from the block tables"

    def assert_all_free(self, adapter_blocks: set[int] | None = None) -> None:
        """The leak check: no table left, every reference count zero but the null block's
        (held once, by the manager) and the given LoRA adapter blocks'."""
        for group in self.groups:
            assert not group.block_tables, f"sequences still hold blocks: {list(group.block_tables)[:10]}"
        self.pool.assert_all_free({self.null_block, *(adapter_blocks or set())})


def window_blocks_bound(window: int, block_size: int) -> int:
    """Blocks a windowed group holds for one decoding sequence, at most."""
    return cdiv(window, block_size) + 1
