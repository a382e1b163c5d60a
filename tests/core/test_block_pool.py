"""Block pool and KV cache manager: exact block ids, fork, copy-on-write, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams


def test_allocate_hands_out_lowest_ids_first_and_reuses_freed_in_order():
    pool = BlockPool(6)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.release([1, 0])
    # Free queue order: 5 (never used), then 1, then 0 (freed in that order).
    assert pool.allocate(3) == [5, 1, 0]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError, match="only 0 free"):
        pool.allocate(1)
    pool.check_integrity()


def test_double_free_is_refused_without_side_effects():
    pool = BlockPool(4)
    ids = pool.allocate(2)
    pool.release(ids)
    with pytest.raises(ValueError, match="double free"):
        pool.release([ids[0]])
    pool.assert_all_free()


def test_share_keeps_block_until_last_holder_releases():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.share([b])
    assert pool.ref_cnt[b] == 2
    pool.release([b])
    assert pool.num_free_blocks == 2
    pool.release([b])
    pool.assert_all_free()


def test_kv_manager_grows_one_block_per_block_size_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 0, 5)  # 5 tokens -> 2 blocks
    assert kv.get_block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 5, 3)  # 8 tokens -> still 2 blocks
    assert kv.get_block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 8, 1)  # 9th token -> 3rd block
    assert kv.get_block_table("a") == [0, 1, 2]
    kv.free("a")
    kv.assert_all_free()


def test_allocate_slots_fails_atomically_when_pool_is_short():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 0, 8)
    assert not kv.allocate_slots("b", 0, 9)  # needs 3, 1 free
    assert kv.get_block_table("b") == []
    assert kv.num_free_blocks == 1
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.assert_all_free()


def test_fork_shares_all_blocks_and_copy_on_write_splits_the_partial_one():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("p", 0, 6)  # blocks [0, 1]; block 1 holds 2 tokens
    kv.fork("p", "c")
    assert kv.get_block_table("c") == [0, 1]
    assert kv.pool.ref_cnt[:2] == [2, 2]
    # The child writes token 6 into shared block 1: it gets a private copy first.
    assert kv.allocate_slots("c", 6, 1)
    assert kv.get_block_table("c") == [0, 2]
    assert kv.take_pending_copies() == [(1, 2)]
    assert kv.pool.ref_cnt[:3] == [2, 1, 1]
    # Now the parent is block 1's only holder: it writes in place, no copy.
    assert kv.allocate_slots("p", 6, 1)
    assert kv.get_block_table("p") == [0, 1]
    assert kv.take_pending_copies() == []
    kv.check_integrity()
    kv.free("p")
    kv.free("c")
    kv.assert_all_free()


def test_fork_at_block_boundary_needs_no_copy():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("p", 0, 8)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 8, 1)
    assert kv.take_pending_copies() == []
    assert kv.get_block_table("c") == [0, 1, 2]
    kv.free("c")
    kv.free("p")
    kv.assert_all_free()


@st.composite
def _operations(draw):
    kinds = ["alloc", "append", "fork", "free", "hit", "swap_out", "swap_in"]
    return draw(
        st.lists(
            st.tuples(st.sampled_from(kinds), st.integers(0, 5), st.integers(0, 5), st.integers(1, 20)),
            max_size=60,
        )
    )


class _Model:
    """The reference: each sequence is just its token list; block tables must cover it."""

    def __init__(self, block_size: int) -> None:
        self.kv = KVCacheManager(num_blocks=24, block_size=block_size, enable_caching=True, num_swap_blocks=10)
        self.tokens: dict[str, list[int]] = {}
        self.swapped: set[str] = set()

    def request(self, seq: str) -> Request:
        r = Request(seq, self.tokens[seq], SamplingParams(), eos_token_id=None)
        r.num_computed_tokens = len(self.tokens[seq])
        return r

    def grow(self, seq: str, n: int, token: int) -> None:
        kv = self.kv
        start = len(self.tokens.get(seq, []))
        before, needed = kv.num_free_blocks, kv.blocks_needed(seq, start, n)
        if kv.allocate_slots(seq, start, n):
            self.tokens[seq] = self.tokens.get(seq, []) + [token] * n
            kv.cache_full_blocks(self.request(seq), len(self.tokens[seq]))
        else:
            assert needed > before and kv.num_free_blocks == before

    def hit(self, seq: str, source: str) -> None:
        # A new sequence whose tokens repeat `source`: it must find source's published blocks.
        tokens = list(self.tokens[source])
        self.tokens[seq] = tokens
        req = self.request(seq)
        req.num_computed_tokens = 0
        hits = self.kv.find_cached_prefix(req)
        n_hit = len(hits) * self.kv.block_size
        if self.kv.allocate_slots(seq, n_hit, len(tokens) - n_hit, hits):
            self.kv.cache_full_blocks(self.request(seq), len(tokens))
        else:
            del self.tokens[seq]

    def free(self, seq: str) -> None:
        self.kv.free(seq)
        self.kv.free_swapped(seq)
        self.tokens.pop(seq, None)
        self.swapped.discard(seq)


@settings(max_examples=200, deadline=None)
@given(ops=_operations(), block_size=st.sampled_from([1, 2, 4, 16]))
def test_random_operations_keep_refcounts_exact(ops, block_size):
    m = _Model(block_size)
    kv = m.kv
    for op, a, b, n in ops:
        sa, sb = f"s{a}", f"s{b}"
        live = sa in m.tokens and sa not in m.swapped
        if op in ("alloc", "append") and (sa not in m.tokens or live):
            m.grow(sa, n, token=a * 100 + b)
        elif op == "fork" and live and sb not in m.tokens:
            kv.fork(sa, sb)
            m.tokens[sb] = list(m.tokens[sa])
        elif op == "hit" and live and sb not in m.tokens and m.tokens[sa]:
            m.hit(sb, sa)
        elif op == "free":
            m.free(sa)
        elif op == "swap_out" and live and kv.can_swap_out(sa):
            pairs = kv.swap_out(sa)
            assert len(pairs) == len({d for d, _ in pairs}) and sa in kv.swapped_tables
            m.swapped.add(sa)
        elif op == "swap_in" and sa in m.swapped and kv.can_swap_in(sa):
            kv.swap_in(sa)
            m.swapped.discard(sa)
        kv.take_pending_copies()
        kv.check_integrity()
        for seq, tokens in m.tokens.items():
            table = kv.swapped_tables[seq] if seq in m.swapped else kv.get_block_table(seq)
            assert len(table) * block_size >= len(tokens)
    for seq in list(m.tokens):
        m.free(seq)
    kv.assert_all_free()
