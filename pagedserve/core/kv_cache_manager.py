"""Per-sequence block tables on top of the block pool.

Block table of a sequence with 35 tokens computed, block_size 16:

    logical block:   0          1          2
    block id:      [ 7 ]      [ 3 ]      [ 12 ]
    tokens:        0..15      16..31     32..34 (+13 free slots)

A block shared by several sequences (after a fork) is copied before one of them writes
into it (copy-on-write); the copy is reported to the model runner as (src, dst) pairs,
which it must apply before the step's forward pass.

Prefix caching: each full block is named by SHA-256 over (parent block's hash, its token
ids), chained from a root that holds the request's extra keys (LoRA adapter id and
cache salt), so equal hashes mean equal full prefixes under the same adapter and salt.
SHA-256 rather than Python's hash(): stable across processes and collision resistant, so
one tenant cannot craft a prompt that aliases another tenant's cached KV.
"""

from __future__ import annotations

import hashlib
from array import array

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_manager_base import KVManagerBase
from pagedserve.request import Request

_HASH_VERSION = b"pagedserve-kv-v1"


def root_hash(lora_id: int, cache_salt: str | None) -> bytes:
    """The chain's seed: requests share cached blocks only with the same adapter and salt."""
    key = _HASH_VERSION + lora_id.to_bytes(8, "little", signed=True) + (cache_salt or "").encode()
    return hashlib.sha256(key).digest()


def hash_block(parent: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager(KVManagerBase):
    """Owns every sequence's block table; asks the block pool for blocks and references.

    Implements `core.protocols.KVManager`, the scheduler's view of it.
    """

    pool: BlockPool

    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = False, num_swap_blocks: int = 0,
        pool: BlockPool | None = None, hash_salt: bytes = b"",
    ) -> None:
        """`pool`: a pool shared with other managers (the layer groups of
        core/hybrid_kv_manager.py); None: a pool of `num_blocks` of its own. `hash_salt`:
        mixed into the root of every hash chain, so groups sharing a pool never share a
        cached block (each layer group's block holds other layers' K/V)."""
        self.block_size = block_size
        self.hash_salt = hash_salt
        # A block id that stands for "no block" in tables (the hybrid manager's null block):
        # never published to the prefix cache. -1: there is none.
        self.null_block = -1
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks) if pool is None else pool
        # Host-memory blocks for swapped-out sequences; the same pool logic owns their counts.
        self.swap_pool = BlockPool(num_swap_blocks) if num_swap_blocks > 0 else None
        self.swapped_tables: dict[str, list[int]] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._pending_copies: list[tuple[int, int]] = []
        # Per sequence: hashes of its full blocks so far, and how many are published.
        self._hashes: dict[str, list[bytes]] = {}
        self._num_published: dict[str, int] = {}

    def get_block_table(self, seq_id: str) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def blocks_needed(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int) -> int:
        """How many new blocks `allocate_slots` would take for these tokens."""
        table = self.block_tables.get(seq_id, [])
        needed = max(0, cdiv(num_computed_tokens + num_new_tokens, self.block_size) - len(table))
        return needed + int(self._needs_copy_on_write(table, num_computed_tokens, num_new_tokens))

    def allocate_slots(
        self,
        seq_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        request: Request | None = None,
    ) -> bool:
        """See `KVManagerBase.allocate_slots`; a prefix hit's blocks are shared, not copied."""
        cached_blocks = cached_blocks or []
        needed = self.blocks_needed(seq_id, num_computed_tokens, num_new_tokens) - len(cached_blocks)
        # Hits on evictable blocks take them out of the free queue too.
        available = self.pool.num_free_blocks - sum(self.pool.is_evictable(b) for b in cached_blocks)
        if needed > available:
            return False
        table = self.block_tables.setdefault(seq_id, [])
        if cached_blocks:
            assert not table and num_computed_tokens == len(cached_blocks) * self.block_size
            self.pool.share(cached_blocks)
            table.extend(cached_blocks)
            self._num_published[seq_id] = len(cached_blocks)
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

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Keeps the blocks holding the first `num_tokens` tokens and frees the rest.

        Speculative decoding: slots for proposed tokens were allocated before they were
        verified; the blocks past the accepted ones go back to the pool in the same step.
        Those blocks were allocated this step (never shared, never published: publishing
        stops at the verified tokens), so this only drops references. Slots past
        `num_tokens` inside the kept last block hold stale K/V, overwritten before any
        attention reads them (reads stop at the sequence length).
        """
        table = self.block_tables.get(seq_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return
        assert self._num_published.get(seq_id, 0) <= keep, "a block with unverified tokens was published"
        tail = table[keep:]
        del table[keep:]
        self.pool.release(reversed(tail))

    def fork(self, parent_id: str, child_id: str) -> None:
        """Gives `child_id` the parent's blocks, shared (reference count + 1, no copy)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has blocks")
        table = list(self.block_tables.get(parent_id, []))
        self.pool.share(table)
        self.block_tables[child_id] = table
        self._num_published[child_id] = self._num_published.get(parent_id, 0)

    def free(self, seq_id: str) -> None:
        """Releases every block of the sequence, last block first."""
        table = self.block_tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._num_published.pop(seq_id, None)
        if table:
            self.pool.release(reversed(table))

    # ---- swap ----------------------------------------------------------------------------

    def can_swap_out(self, seq_id: str) -> bool:
        table = self.block_tables.get(seq_id, [])
        return self.swap_pool is not None and 0 < len(table) <= self.swap_pool.num_free_blocks

    def swap_out(self, seq_id: str) -> list[tuple[int, int]]:
        """Moves the sequence's blocks to host blocks; returns (device, host) pairs to copy.

        The device blocks are released at once: the copy runs before this step's forward
        pass, so another sequence may reuse them in the same step.
        """
        assert self.swap_pool is not None
        table = self.block_tables.pop(seq_id)
        host = self.swap_pool.allocate(len(table))
        self.swapped_tables[seq_id] = host
        self._num_published.pop(seq_id, None)
        self.pool.release(reversed(table))
        return list(zip(table, host, strict=True))

    def can_swap_in(self, seq_id: str, num_tokens: int = 0) -> bool:
        """Whether the swapped sequence's blocks fit back, and with them slots for its first
        `num_tokens` tokens (what `allocate_slots` will ask right after `swap_in`)."""
        needed = max(len(self.swapped_tables[seq_id]), cdiv(num_tokens, self.block_size))
        return needed <= self.pool.num_free_blocks

    def swap_in(self, seq_id: str) -> list[tuple[int, int]]:
        """Brings a swapped sequence back to fresh device blocks; returns (host, device) pairs."""
        assert self.swap_pool is not None
        host = self.swapped_tables.pop(seq_id)
        device = self.pool.allocate(len(host))
        self.block_tables[seq_id] = device
        self.swap_pool.release(host)
        return list(zip(host, device, strict=True))

    def free_swapped(self, seq_id: str) -> None:
        host = self.swapped_tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        if host and self.swap_pool is not None:
            self.swap_pool.release(host)

    # ---- prefix cache --------------------------------------------------------------------

    def block_hashes(self, request: Request) -> list[bytes]:
        """Hashes of the request's full blocks (prompt and outputs), extended as it grows."""
        hashes = self._hashes.setdefault(request.request_id, [])
        bs = self.block_size
        num_full = request.num_tokens // bs
        if hashes:
            parent = hashes[-1]
        else:
            parent = root_hash(request.lora_id, request.cache_salt)
            if self.hash_salt:
                parent = hashlib.sha256(parent + self.hash_salt).digest()
        for index in range(len(hashes), num_full):
            parent = hash_block(parent, request.token_ids_slice(index * bs, (index + 1) * bs))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request, in order.

        Stops one token short of the whole request: its last token must be computed
        again to give the logits for the next one. A request that wants prompt logprobs
        reads no cached block: those positions' logits would never be computed.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self.block_hashes(request)[:max_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publishes the request's blocks that are full once its first `num_tokens` are computed.

        Called at scheduling time for the tokens this step computes: a request admitted
        later in the same step may hit these blocks, which is safe because every layer
        writes the step's new K/V before any attention reads the cache.
        """
        if not self.enable_caching:
            return
        seq_id = request.request_id
        table = self.block_tables.get(seq_id)
        if not table:
            return
        start = self._num_published.get(seq_id, 0)
        end = min(num_tokens // self.block_size, len(table))
        if end <= start:
            return
        hashes = self.block_hashes(request)
        for index in range(start, end):
            if table[index] != self.null_block:
                self.pool.cache(table[index], hashes[index])
        self._num_published[seq_id] = end

    def reset_prefix_cache(self) -> None:
        """Forgets every published block hash (the engine refuses this while requests run)."""
        self.pool.reset_prefix_cache()

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write (src, dst) block pairs accumulated since the last call."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of tables holding it
        (device and host pools alike)."""
        for pool, tables in ((self.pool, self.block_tables), (self.swap_pool, self.swapped_tables)):
            if pool is None:
                continue
            pool.check_integrity()
            holders = [0] * pool.num_blocks
            for table in tables.values():
                for block_id in table:
                    holders[block_id] += 1
            assert holders == pool.ref_cnt, "reference counts differ from the block tables"

    def assert_all_free(self, adapter_blocks: set[int] | None = None) -> None:
        """The leak check: no block table left and every reference count zero, except the
        blocks of resident LoRA adapters (`adapter_blocks`), each held exactly once."""
        assert not self.block_tables, f"sequences still hold blocks: {list(self.block_tables)[:10]}"
        assert not self.swapped_tables, f"sequences still hold swap blocks: {list(self.swapped_tables)[:10]}"
        self.pool.assert_all_free(adapter_blocks or set())
        if self.swap_pool is not None:
            self.swap_pool.assert_all_free()
