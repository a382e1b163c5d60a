"""Per-layer-group block tables for windowed layers (core/kv_groups.py,
core/hybrid_kv_manager.py): the grouping, the window's block bound, the true need counted
at admission, and prefix hits that only reuse windowed blocks still holding their K/V."""

from __future__ import annotations

from pagedserve import SamplingParams
from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager, window_blocks_bound
from pagedserve.core.kv_groups import plan_kv_groups
from pagedserve.request import Request

BS, W = 4, 16


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_id=None)


def test_plan_groups_layers_by_window():
    gemma3 = plan_kv_groups([W] * 5 + [None] + [W] * 5 + [None])
    assert gemma3.page_layers == 2 and gemma3.hybrid
    assert gemma3.windows == (W,) * 5 + (None,)
    assert gemma3.layers[0] == (0, 1) and gemma3.layers[-1] == (5, 11)
    assert gemma3.layers[2] == (4, 6) and gemma3.placement(7) == (3, 0) and gemma3.placement(11) == (5, 1)
    plain = plan_kv_groups([None] * 4)
    assert (plain.num_groups, plain.page_layers, plain.hybrid) == (1, 4, False)
    assert plain.blocks_per_sequence(100, BS, 16) == 25  # the plain manager's cdiv
    # Gemma 2 (alternating): one full and one windowed group of 2 layers; a sequence of 100
    # tokens in 16-token steps holds 25 + (16 + 16 - 2) // 4 + 2 blocks, and the null block.
    gemma2 = plan_kv_groups([W, None, W, None])
    assert gemma2.layers == ((0, 2), (1, 3))
    assert gemma2.blocks_per_sequence(100, BS, 16) == 1 + 25 + 9


def test_decode_holds_only_the_window_and_need_is_true():
    kv = HybridKVCacheManager(64, BS, [W, None])
    bound = window_blocks_bound(W, BS)
    assert kv.num_used_blocks == 0  # the null block is the manager's, not counted
    assert kv.allocate_slots("a", 0, 40)
    assert kv.num_held_blocks("a", 0) == 10 and kv.num_held_blocks("a", 1) == 10
    # The next step's first query (40) sees keys 25..40: blocks 0..5 go back before it.
    assert kv.blocks_needed("a", 40, 1) == 2 - 6  # a new block in each group
    assert kv.allocate_slots("a", 40, 1)
    assert kv.num_held_blocks("a", 0) == 5 <= bound
    table = kv.group_block_tables("a")[0]
    assert table[:6] == [kv.null_block] * 6 and kv.null_block not in table[6:]
    kv.check_integrity()
    # A pool that can hold the window but not the whole prompt admits it once it slides.
    free = kv.num_free_blocks
    assert not kv.allocate_slots("b", 0, 4 * free)
    kv.check_integrity()
    kv.free("a")
    kv.assert_all_free()


def test_prefix_hit_needs_the_windowed_blocks_still_cached():
    kv = HybridKVCacheManager(64, BS, [W, None], enable_caching=True)
    a = _request("a", list(range(3, 43)))  # 40 tokens: 10 full blocks
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate_slots("a", 0, 40)
    a.num_computed_tokens = 40
    kv.cache_full_blocks(a, 40)
    assert kv.allocate_slots("a", 40, 1)  # blocks 0..5 slide out, hashes kept while free
    kv.free("a")
    # Same 40 tokens again: 9 blocks may hit (the last token is recomputed); the windowed
    # group needs only the blocks the query at 36 sees (keys 21.., blocks 5..8).
    b = _request("b", list(range(3, 43)))
    hits = kv.find_cached_prefix(b)
    assert len(hits) == 9
    assert kv.allocate_slots("b", 36, 4, hits)
    windowed = kv.group_block_tables("b")[0]
    assert windowed[:5] == [kv.null_block] * 5 and kv.null_block not in windowed[5:]
    kv.check_integrity()
    kv.free("b")
    # Evict every cached block: a full-attention hit alone is not enough.
    kv.pool.release(kv.pool.allocate(kv.pool.num_free_blocks))
    assert kv.find_cached_prefix(_request("c", list(range(3, 43)))) == []
    kv.assert_all_free()


def test_fork_and_rollback_keep_counts():
    kv = HybridKVCacheManager(128, BS, [W, None, W])
    assert kv.allocate_slots("a", 0, 60)
    assert kv.allocate_slots("a", 60, 1)
    kv.fork("a", "b")
    assert kv.allocate_slots("b", 61, 5)  # copy-on-write of the shared partial block, per group
    assert len(kv.take_pending_copies()) == 3
    kv.rollback("b", 63)
    kv.check_integrity()
    for seq in ("a", "b"):
        kv.free(seq)
    kv.assert_all_free()
