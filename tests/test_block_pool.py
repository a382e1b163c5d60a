"""Block pool and KV cache manager: exact block ids, fork, copy-on-write, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.core.block_pool import BlockPool
from pagedserve.core.kv_cache_manager import KVCacheManager


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
    return draw(
        st.lists(
            st.tuples(
                st.sampled_from(["alloc", "append", "fork", "free"]),
                st.integers(0, 5),
                st.integers(0, 5),
                st.integers(1, 20),
            ),
            max_size=60,
        )
    )


@settings(max_examples=200, deadline=None)
@given(ops=_operations(), block_size=st.sampled_from([1, 2, 4, 16]))
def test_random_operations_keep_refcounts_exact(ops, block_size):
    kv = KVCacheManager(num_blocks=24, block_size=block_size)
    lengths: dict[str, int] = {}
    for op, a, b, n in ops:
        sa, sb = f"s{a}", f"s{b}"
        if op in ("alloc", "append"):
            start = lengths.get(sa, 0)
            before = kv.num_free_blocks
            needed = kv.blocks_needed(sa, start, n)
            if kv.allocate_slots(sa, start, n):
                lengths[sa] = start + n
                assert kv.num_free_blocks == before - needed
            else:
                assert needed > before and kv.num_free_blocks == before
        elif op == "fork" and sa in lengths and sb not in lengths:
            kv.fork(sa, sb)
            lengths[sb] = lengths[sa]
        elif op == "free":
            kv.free(sa)
            lengths.pop(sa, None)
        kv.take_pending_copies()
        kv.check_integrity()
        for seq, length in lengths.items():
            assert len(kv.get_block_table(seq)) * block_size >= length
    for seq in list(lengths):
        kv.free(seq)
    kv.assert_all_free()
