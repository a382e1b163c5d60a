"""Contiguous KV allocation: the baselines paging is measured against (the vLLM paper's
Orca-Max, Orca-Pow2 and Orca-Oracle), behind the `core.protocols.KVManager` interface.

The KV memory is the same array of `num_blocks` blocks the paged manager gets. Each
sequence owns ONE region of consecutive block ids, reserved when it is first admitted:

    block id: 0                                                         num_blocks-1
              [ seq A: 128 blocks ][ 3 free ][ seq B: 32 blocks ][ free ............ ]
                                    ^ a hole too small for the next reservation:
                                      external fragmentation

Region size R (tokens) by kind, rounded UP to whole blocks (at most block_size - 1 slots
per region; those slots lie past the request's last token, so the memory breakdown counts
them as internal fragmentation and also reports them as `rounding`):

    contiguous-max     max_model_len
    contiguous-pow2    next power of two >= prompt + 1; when the sequence outgrows it, a region
                       of the next power of two is placed, the written blocks are copied (the
                       runner applies `take_pending_copies()` before the forward pass, so all
                       sources are read before any destination is written) and the old region
                       is freed: a reallocating buffer, never grown in place
    contiguous-oracle  prompt + max_output_tokens (the output budget, known in advance)

R is capped at max_model_len, which no sequence can exceed. Placement is first fit over the
free extents (sorted by start, coalesced on free), so holes between live regions are real.

The runner sees the region's first cdiv(tokens allocated, block_size) block ids as the
block table, the same length a paged table would have, so both kinds cost the same per step.
No prefix caching and no fork: a region cannot be shared.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.config import KV_ALLOCATIONS
from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.kv_manager_base import KVManagerBase, RecomputeOnly
from pagedserve.request import Request

CONTIGUOUS_KINDS = tuple(k for k in KV_ALLOCATIONS if k.startswith("contiguous-"))


class ExtentPool:
    """First-fit allocator of runs of consecutive blocks; the only owner of the free extents.

    Invariant: `_free` holds [start, length] extents sorted by start, disjoint, never adjacent
    (adjacent extents are merged on release), all inside [0, num_blocks).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[list[int]] = [[0, num_blocks]]
        self._num_free = num_blocks
        # The scheduler's stats read these from any pool; contiguous memory caches nothing.
        self.num_cached_blocks = 0
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_evictable_cached_blocks(self) -> int:
        """Always 0 (nothing is cached); for stats that read either kind of pool."""
        return 0

    def free_extents(self) -> list[tuple[int, int]]:
        """(start, length) of every free extent, by start."""
        return [(s, n) for s, n in self._free]

    def largest_free_extent(self) -> int:
        return max((n for _, n in self._free), default=0)

    def allocate(self, num_blocks: int) -> int | None:
        """Start of the first free extent that holds `num_blocks`, now used; None if none does."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        for index, (start, length) in enumerate(self._free):
            if length >= num_blocks:
                if length == num_blocks:
                    del self._free[index]
                else:
                    self._free[index] = [start + num_blocks, length - num_blocks]
                self._num_free -= num_blocks
                return start
        return None

    def release(self, start: int, num_blocks: int) -> None:
        """Returns [start, start + num_blocks) to the free extents, merging neighbours.

        Raises:
            ValueError: if any of those blocks is already free (a double free).
        """
        end = start + num_blocks
        index = 0
        while index < len(self._free) and self._free[index][0] < start:
            index += 1
        prev = self._free[index - 1] if index > 0 else None
        nxt = self._free[index] if index < len(self._free) else None
        if start < 0 or end > self.num_blocks or (prev and prev[0] + prev[1] > start) or (nxt and nxt[0] < end):
            raise ValueError(f"double free or out-of-range release of blocks [{start}, {end})")
        if prev and prev[0] + prev[1] == start:
            prev[1] += num_blocks
            if nxt and nxt[0] == end:
                prev[1] += nxt[1]
                del self._free[index]
        elif nxt and nxt[0] == end:
            nxt[0], nxt[1] = start, nxt[1] + num_blocks
        else:
            self._free.insert(index, [start, num_blocks])
        self._num_free += num_blocks

    def check_integrity(self) -> None:
        """Asserts the extents are sorted, in range, disjoint, coalesced, and add up."""
        end = -1
        for start, length in self._free:
            assert length > 0 and start > end, f"free extents overlap, touch or are unsorted at {start}"
            end = start + length
        assert end <= self.num_blocks, "free extent past the end of the pool"
        assert sum(n for _, n in self._free) == self._num_free, "free count differs from the extents"

    def assert_all_free(self) -> None:
        self.check_integrity()
        assert self._free == [[0, self.num_blocks]], f"leaked KV blocks: free extents {self._free[:10]}"


@dataclass(slots=True)
class Region:
    start: int
    num_blocks: int
    # The reservation before rounding to blocks; the rest of the region is rounding slack.
    reserved_tokens: int
    # Slots handed to the runner so far (largest num_computed + num_new asked for).
    num_tokens: int


@dataclass(slots=True)
class MemoryBreakdown:
    """KV slots by what they hold at one instant (the vLLM paper's Fig. 2 categories).

    For a live sequence with W tokens written (num_computed_tokens) and a final length of
    F = prompt + max_output_tokens - 1 KV entries (the last sampled token is never written;
    exact for ignore_eos runs, an upper bound otherwise), a slot at logical position p of
    the memory it holds is:

        token_states   p < W        K/V of a token, in use now
        reserved       W <= p < F   held for a token this request will still write
        internal       p >= F       held but never written before the request ends
                                    (over-reservation, incl. `rounding` to whole blocks)
    and for the pool as a whole:
        external       free slots in extents too small for the reservation the head of the
                       waiting queue needs (free but unusable by the allocator now; 0 when
                       nothing waits, and always 0 when paged: any free block serves anyone)

    Shares are of token_states + reserved + internal + external: the KV memory in use or
    unusable. `free` (usable free slots) is reported but not part of the total. A block held
    by several sequences (prefix cache, fork) is counted once, for its first holder.
    """

    token_states: int = 0
    reserved: int = 0
    internal: int = 0
    external: int = 0
    free: int = 0
    rounding: int = 0

    @property
    def total(self) -> int:
        return self.token_states + self.reserved + self.internal + self.external

    def add(self, other: MemoryBreakdown) -> None:
        for name in ("token_states", "reserved", "internal", "external", "free", "rounding"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def shares(self) -> dict[str, float]:
        """Fractions of `total` for the four categories (they sum to 1; all 0 when empty)."""
        total = self.total
        names = ("token_states", "reserved", "internal", "external")
        return {name: (getattr(self, name) / total if total else 0.0) for name in names}


def final_kv_len(request: Request) -> int:
    """KV entries the request writes if it runs to its output budget."""
    return request.num_prompt_tokens + request.max_output_tokens - 1


def _classify(out: MemoryBreakdown, lo: int, hi: int, written: int, final: int) -> None:
    """Adds the slots of logical positions [lo, hi) of one sequence to `out`."""
    token = max(0, min(hi, written) - lo)
    reserved = max(0, min(hi, final) - max(lo, written))
    out.token_states += token
    out.reserved += reserved
    out.internal += (hi - lo) - token - reserved


class ContiguousKVCacheManager(RecomputeOnly, KVManagerBase):
    """One contiguous region per sequence; same interface as `KVCacheManager`."""

    no_swap_reason = "contiguous allocation preempts by recompute only"

    pool: ExtentPool

    def __init__(self, num_blocks: int, block_size: int, kind: str, max_model_len: int) -> None:
        if kind not in CONTIGUOUS_KINDS:
            raise ValueError(f"kind must be one of {', '.join(CONTIGUOUS_KINDS)}; got {kind!r}")
        self.kind = kind
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = False
        self.pool = ExtentPool(num_blocks)
        self.swap_pool = None
        self.swapped_tables: dict[str, list[int]] = {}
        self.regions: dict[str, Region] = {}
        # Per sequence, so that a region freed in the step it grew drops its stale copies.
        self._pending_copies: dict[str, list[tuple[int, int]]] = {}
        self.num_reallocations = 0
        self.num_copied_blocks = 0

    def get_block_table(self, seq_id: str) -> list[int]:
        region = self.regions.get(seq_id)
        if region is None:
            return []
        return list(range(region.start, region.start + cdiv(region.num_tokens, self.block_size)))

    def reservation_tokens(self, request: Request | None, num_tokens: int) -> int:
        """Tokens to reserve for a sequence that needs `num_tokens` slots now."""
        if self.kind == "contiguous-max":
            want = self.max_model_len
        elif self.kind == "contiguous-oracle" and request is not None:
            want = request.num_prompt_tokens + request.max_output_tokens
        else:
            # pow2 (and an oracle without its request): the next power of two that holds
            # the sequence plus one token (the prompt + 1 when new; after a recompute
            # preemption, prompt + outputs so far + 1), or all that is needed now.
            plus_one = request.num_tokens + 1 if request is not None else 0
            want = 1 << (max(num_tokens, plus_one, 1) - 1).bit_length()
        return max(min(want, self.max_model_len), num_tokens)

    def allocate_slots(
        self,
        seq_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        request: Request | None = None,
    ) -> bool:
        """Makes room for `num_new_tokens` K/V entries after `num_computed_tokens`.

        A new sequence gets its whole reservation now; a pow2 sequence that outgrows its
        region moves to one twice as big (or more, if needed). Returns False, changing
        nothing, when no free extent is big enough; True otherwise.
        """
        if cached_blocks:
            raise ValueError("contiguous allocation has no prefix cache")
        needed = num_computed_tokens + num_new_tokens
        region = self.regions.get(seq_id)
        if region is None:
            reserve = self.reservation_tokens(request, needed)
            start = self.pool.allocate(cdiv(reserve, self.block_size))
            if start is None:
                return False
            self.regions[seq_id] = Region(start, cdiv(reserve, self.block_size), reserve, needed)
            return True
        if needed > region.num_blocks * self.block_size and not self._grow(seq_id, region, needed, num_computed_tokens):
            return False
        region.num_tokens = max(region.num_tokens, needed)
        return True

    def _grow(self, seq_id: str, region: Region, needed: int, num_computed_tokens: int) -> bool:
        # A reallocating buffer: the new region is placed while the old one is still held.
        reserve = 1 << (needed - 1).bit_length()
        if self.kind == "contiguous-pow2":
            reserve = max(reserve, 2 * region.reserved_tokens)
        reserve = max(min(reserve, self.max_model_len), needed)
        num_blocks = cdiv(reserve, self.block_size)
        start = self.pool.allocate(num_blocks)
        if start is None:
            return False
        written = cdiv(num_computed_tokens, self.block_size)
        # A copy into the old region still pending (a second growth before the runner ran)
        # must now come from its original source.
        src_of = {dst: src for src, dst in self._pending_copies.get(seq_id, [])}
        self._pending_copies[seq_id] = [
            (src_of.get(region.start + i, region.start + i), start + i) for i in range(written)
        ]
        self.pool.release(region.start, region.num_blocks)
        self.num_reallocations += 1
        self.num_copied_blocks += written
        region.start, region.num_blocks, region.reserved_tokens = start, num_blocks, reserve
        return True

    def fork(self, parent_id: str, child_id: str) -> None:
        raise NotImplementedError("contiguous allocation cannot share a region between sequences")

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        raise NotImplementedError("speculative decoding needs the paged KV cache")

    def free(self, seq_id: str) -> None:
        """Releases the sequence's region and drops copies into it not yet applied."""
        region = self.regions.pop(seq_id, None)
        self._pending_copies.pop(seq_id, None)
        if region is not None:
            self.pool.release(region.start, region.num_blocks)

    # ---- prefix cache: none (a region is private to its sequence) -------------------------

    def find_cached_prefix(self, request: Request) -> list[int]:
        return []

    def cache_full_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        return None

    def reset_prefix_cache(self) -> None:
        return None

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Growth copies (src, dst) accumulated since the last call."""
        copies = [pair for pairs in self._pending_copies.values() for pair in pairs]
        self._pending_copies.clear()
        return copies

    # ---- accounting ----------------------------------------------------------------------

    def memory_breakdown(self, running: Iterable[Request], waiting_head: Request | None = None) -> MemoryBreakdown:
        """Classifies every KV slot (see `MemoryBreakdown`).

        Args:
            running: the requests holding regions (the scheduler's running list).
            waiting_head: the next request to admit; its reservation decides which free
                extents count as external fragmentation.
        """
        out = MemoryBreakdown()
        bs = self.block_size
        for request in running:
            region = self.regions.get(request.request_id)
            if region is None:
                continue
            before = out.internal
            _classify(out, 0, region.num_blocks * bs, request.num_computed_tokens, final_kv_len(request))
            out.rounding += min(region.num_blocks * bs - region.reserved_tokens, out.internal - before)
        need = 0
        if waiting_head is not None:
            need = cdiv(self.reservation_tokens(waiting_head, waiting_head.num_tokens), bs)
        for _, length in self.pool.free_extents():
            if length < need:
                out.external += length * bs
            else:
                out.free += length * bs
        return out

    def check_integrity(self) -> None:
        """Pool invariants, plus: regions are disjoint and, with the free extents, tile the pool."""
        self.pool.check_integrity()
        spans = sorted([(r.start, r.num_blocks) for r in self.regions.values()] + self.pool.free_extents())
        position = 0
        for start, length in spans:
            assert start == position, f"blocks [{position}, {start}) lost, or regions overlap at {start}"
            position = start + length
        assert position == self.pool.num_blocks, "regions and free extents do not cover the pool"
        for seq_id, region in self.regions.items():
            assert region.num_tokens <= region.num_blocks * self.block_size, f"{seq_id} overflows its region"

    def assert_all_free(self, adapter_blocks: set[int] | None = None) -> None:
        """The leak check: no region left and the whole pool one free extent.

        `adapter_blocks` (LoRA weights kept in KV blocks) must be empty: adapters live in a
        paged pool, which the contiguous baselines do not offer."""
        assert not adapter_blocks, "contiguous allocation cannot hold LoRA adapters in KV blocks"
        assert not self.regions, f"sequences still hold regions: {list(self.regions)[:10]}"
        self.pool.assert_all_free()


def paged_memory_breakdown(kv: KVCacheManager | HybridKVCacheManager, running: Iterable[Request]) -> MemoryBreakdown:
    """`MemoryBreakdown` of a paged manager, read from its block tables and reference counts.

    Kept outside `KVCacheManager` (another owner's file); it only reads. External
    fragmentation is 0 by construction, so every free block counts as `free`. With windowed
    layers (`HybridKVCacheManager`) a slot is one token of one page (a group's layers), every
    group's table counts, and the null block standing for what a window gave back holds nothing.
    """
    out = MemoryBreakdown()
    bs = kv.block_size
    null = kv.null_block if isinstance(kv, HybridKVCacheManager) else None
    seen: set[int] = set()  # blocks held by several sequences, counted for their first holder
    for request in running:
        written, final = request.num_computed_tokens, final_kv_len(request)
        tables = (kv.group_block_tables(request.request_id) if isinstance(kv, HybridKVCacheManager)
                  else [kv.get_block_table(request.request_id)])
        for table in tables:
            for index, block_id in enumerate(table):
                if block_id == null or block_id in seen:
                    continue
                if kv.pool.ref_cnt[block_id] > 1:
                    seen.add(block_id)
                _classify(out, index * bs, (index + 1) * bs, written, final)
    out.free = kv.pool.num_free_blocks * bs
    return out


def memory_breakdown(kv: object, running: Iterable[Request], waiting_head: Request | None = None) -> MemoryBreakdown:
    """The breakdown of either kind of manager (see `MemoryBreakdown`)."""
    if isinstance(kv, ContiguousKVCacheManager):
        return kv.memory_breakdown(running, waiting_head)
    if isinstance(kv, KVCacheManager | HybridKVCacheManager):
        return paged_memory_breakdown(kv, running)
    raise TypeError(f"no memory breakdown for {type(kv).__name__}")
