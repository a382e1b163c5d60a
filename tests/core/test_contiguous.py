"""Contiguous KV allocation baselines: placement, growth, fragmentation accounting, and
paged == contiguous greedy outputs on a real (tiny) model."""

from __future__ import annotations

import pytest

from pagedserve.core.contiguous import (
    ContiguousKVCacheManager,
    ExtentPool,
    MemoryBreakdown,
    memory_breakdown,
)
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import Scheduler, SchedulerLimits
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=None,
        arrival_time=arrival,
        max_output_tokens=max_tokens,
    )


def admit(kv: ContiguousKVCacheManager, request: Request) -> bool:
    return kv.allocate_slots(request.request_id, 0, request.num_tokens, request=request)


# ---- the extent pool -------------------------------------------------------------------------


def test_extent_pool_first_fit_and_coalescing():
    pool = ExtentPool(10)
    assert [pool.allocate(n) for n in (3, 2, 3)] == [0, 3, 5]
    pool.release(3, 2)  # hole [3, 5)
    assert pool.free_extents() == [(3, 2), (8, 2)]
    assert pool.allocate(3) is None  # 4 blocks free, but no 3 in a row
    assert pool.allocate(2) == 3  # the first hole that fits
    pool.release(0, 3)
    pool.release(3, 2)
    pool.release(5, 3)
    assert pool.free_extents() == [(0, 10)]
    pool.assert_all_free()


def test_extent_pool_rejects_double_free():
    pool = ExtentPool(8)
    start = pool.allocate(4)
    pool.release(start, 4)
    with pytest.raises(ValueError, match="double free"):
        pool.release(start, 2)
    pool.check_integrity()


# ---- reservations and placement --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "prompt", "max_tokens", "blocks"),
    [
        ("contiguous-max", 5, 4, 16),  # max_model_len 64 / block 4
        ("contiguous-pow2", 5, 40, 2),  # next power of two >= 6 is 8 tokens
        ("contiguous-pow2", 7, 40, 2),  # 8 holds 7 + 1
        ("contiguous-pow2", 8, 40, 4),  # 16 holds 8 + 1
        ("contiguous-oracle", 5, 6, 3),  # 11 tokens, rounded up to 12
    ],
)
def test_reservation_sizes(kind, prompt, max_tokens, blocks):
    kv = ContiguousKVCacheManager(64, 4, kind, max_model_len=64)
    request = make_request("a", prompt, max_tokens)
    assert admit(kv, request)
    assert kv.regions["a"].num_blocks == blocks
    # The runner sees only the blocks holding the tokens so far.
    assert kv.get_block_table("a") == list(range(0, -(-prompt // 4)))
    kv.free("a")
    kv.assert_all_free()


def test_first_fit_leaves_real_holes():
    kv = ContiguousKVCacheManager(12, 4, "contiguous-oracle", max_model_len=64)
    a, b, c = make_request("a", 8, 8), make_request("b", 4, 4), make_request("c", 8, 8)
    for r in (a, b, c):
        assert admit(kv, r)
    assert [kv.regions[x].start for x in "abc"] == [0, 4, 6]
    kv.free("b")  # a 2-block hole between a and c; 4 blocks free in all
    assert not admit(kv, make_request("d", 8, 4)), "3 blocks do not fit in holes of 2"
    assert admit(kv, make_request("e", 4, 4))
    assert kv.regions["e"].start == 4
    kv.check_integrity()
    for x in "ace":
        kv.free(x)
    kv.assert_all_free()


def test_pow2_growth_moves_and_copies_written_blocks():
    kv = ContiguousKVCacheManager(16, 2, "contiguous-pow2", max_model_len=64)
    request = make_request("a", 3, 20)
    assert admit(kv, request)  # 4 tokens = blocks [0, 2)
    blocker = make_request("b", 1, 1)
    assert admit(kv, blocker)  # 2 tokens at [2, 3): growth cannot happen in place
    request.num_computed_tokens = 4
    assert kv.allocate_slots("a", 4, 1, request=request)
    region = kv.regions["a"]
    assert (region.start, region.num_blocks) == (3, 4)  # 8 tokens, placed after b
    assert kv.take_pending_copies() == [(0, 3), (1, 4)]
    assert kv.take_pending_copies() == []
    assert kv.get_block_table("a") == [3, 4, 5]
    assert kv.pool.free_extents() == [(0, 2), (7, 9)]
    assert kv.num_reallocations == 1
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.assert_all_free()


def test_failed_growth_changes_nothing_and_free_drops_pending_copies():
    kv = ContiguousKVCacheManager(6, 2, "contiguous-pow2", max_model_len=64)
    request = make_request("a", 3, 20)
    assert admit(kv, request)  # blocks [0, 2)
    assert admit(kv, make_request("b", 1, 1))  # block 2; free: [3, 6)
    request.num_computed_tokens = 4
    assert not kv.allocate_slots("a", 4, 1, request=request)  # needs 4 blocks in a row
    assert kv.regions["a"].start == 0 and kv.take_pending_copies() == []
    kv.free("b")  # free: [2, 6)
    assert kv.allocate_slots("a", 4, 1, request=request)
    assert kv.regions["a"].start == 2
    kv.free("a")  # preempted in the step it grew: its copies must not reach the runner
    assert kv.take_pending_copies() == []
    kv.assert_all_free()


def test_no_sharing_features():
    kv = ContiguousKVCacheManager(8, 4, "contiguous-max", max_model_len=16)
    request = make_request("a", 3)
    assert kv.find_cached_prefix(request) == []
    with pytest.raises(NotImplementedError):
        kv.fork("a", "b")
    assert not kv.can_swap_out("a")


# ---- the memory breakdown --------------------------------------------------------------------


def test_breakdown_of_a_contiguous_region():
    kv = ContiguousKVCacheManager(16, 4, "contiguous-max", max_model_len=32)
    request = make_request("a", 5, max_tokens=6)  # final KV length 5 + 6 - 1 = 10
    assert admit(kv, request)
    request.num_computed_tokens = 5
    waiting = make_request("w", 3)
    got = kv.memory_breakdown([request], waiting)
    # Region of 32 slots: 5 written, 5 more to come, 22 never used; 8 blocks free in one
    # extent of 8 blocks = 32 tokens, exactly the head's reservation: usable.
    assert (got.token_states, got.reserved, got.internal, got.external, got.free) == (5, 5, 22, 0, 32)
    b = make_request("b", 3)
    assert admit(kv, b)  # the rest of the pool
    kv.free("b")
    kv.pool.allocate(1)  # pin one block: the free extent (7 blocks) is now too small
    got = kv.memory_breakdown([request], waiting)
    assert got.external == 28 and got.free == 0
    assert sum(got.shares().values()) == pytest.approx(1.0)


def test_breakdown_counts_block_rounding_as_internal():
    kv = ContiguousKVCacheManager(16, 4, "contiguous-oracle", max_model_len=64)
    request = make_request("a", 5, max_tokens=6)  # reserves 11 tokens -> 12 slots
    assert admit(kv, request)
    request.num_computed_tokens = 5
    got = kv.memory_breakdown([request])
    assert (got.token_states, got.reserved, got.internal, got.rounding) == (5, 5, 2, 1)


def test_paged_breakdown_and_shared_blocks_counted_once():
    kv = KVCacheManager(16, 4)
    parent = make_request("p", 6, max_tokens=5)  # final 10
    assert kv.allocate_slots("p", 0, 6)
    parent.num_computed_tokens = 6
    got = memory_breakdown(kv, [parent])
    assert (got.token_states, got.reserved, got.internal, got.external) == (6, 2, 0, 0)
    assert got.free == 14 * 4
    kv.fork("p", "c")
    child = make_request("c", 6, max_tokens=5)
    child.num_computed_tokens = 6
    shared = memory_breakdown(kv, [parent, child])
    assert shared.total == got.total, "the child's blocks are the parent's"
    kv.free("p")
    kv.free("c")


def test_breakdown_shares_sum_to_one_and_add():
    total = MemoryBreakdown()
    total.add(MemoryBreakdown(token_states=3, reserved=1, internal=2, external=2, free=9))
    total.add(MemoryBreakdown(token_states=1))
    assert total.total == 9
    assert sum(total.shares().values()) == pytest.approx(1.0)
    assert MemoryBreakdown().shares()["token_states"] == 0.0


# ---- with the scheduler (fake model outputs) -----------------------------------------------------


@pytest.mark.parametrize("kind", ["contiguous-max", "contiguous-pow2", "contiguous-oracle"])
def test_scheduler_runs_contiguous_to_completion(kind):
    kv = ContiguousKVCacheManager(24, 4, kind, max_model_len=32)
    sched = Scheduler(SchedulerLimits(8, 64, True), kv)
    for i, (p, o) in enumerate([(5, 9), (3, 20), (9, 4), (2, 12), (6, 6)]):
        sched.add_request(make_request(f"r{i}", p, o, arrival=i))
    copies = 0
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        copies += len(out.blocks_to_copy)
        sched.update_from_output(out, [7 if item.sample else None for item in out.scheduled])
        kv.check_integrity()
    assert not sched.has_unfinished_requests()
    kv.assert_all_free()
    if kind == "contiguous-pow2":
        assert copies > 0, "pow2 regions grow"
    if kind == "contiguous-max":
        assert sched.num_preemptions_total == 0, "max reservations never need to grow"


# ---- on the engine: paging does not change what is computed ---------------------------------------


def test_paged_and_contiguous_engines_give_identical_greedy_tokens(model_path):
    from pagedserve import LLM

    path = model_path("llama-gqa")
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 1000 + 8 for j in range(n)]}
               for i, n in enumerate([5, 17, 30, 9, 41, 3])]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (20, 33, 12, 40, 25, 18)]
    results = {}
    for kind in ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"):
        # 24 blocks of 4 = 96 slots: tight, so pow2 regions move and some requests wait.
        llm = LLM(path, kv_allocation=kind, block_size=4, num_gpu_blocks_override=24, max_model_len=96,
                  enable_prefix_caching=False, skip_tokenizer_init=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[kind] = [o.outputs[0].token_ids for o in outputs]
        llm.llm_engine.check_integrity()
    assert [len(t) for t in results["paged"]] == [20, 33, 12, 40, 25, 18]
    for kind, tokens in results.items():
        assert tokens == results["paged"], f"{kind} differs from paged"


# ---- property test: the extent pool against a bitmap ---------------------------------------------


def test_extent_pool_matches_a_first_fit_bitmap():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=60))
    def check(ops):
        pool, used, live = ExtentPool(24), [False] * 24, []
        for allocate, size in ops:
            if allocate or not live:
                start = pool.allocate(size)
                # First fit on the bitmap: the lowest start of `size` free blocks in a row.
                expected = next((s for s in range(24 - size + 1) if not any(used[s:s + size])), None)
                assert start == expected
                if start is not None:
                    used[start:start + size] = [True] * size
                    live.append((start, size))
            else:
                start, n = live.pop(size % len(live))
                pool.release(start, n)
                used[start:start + n] = [False] * n
            pool.check_integrity()
            assert pool.num_free_blocks == used.count(False)

    check()


def test_lora_is_refused_with_contiguous_allocation():
    """Adapters are paged into the KV block pool, which the baselines do not have: refused
    when the config is built (naming the field), not when the first adapter is placed."""
    from pagedserve.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig

    with pytest.raises(ValueError, match="kv_allocation='paged'"):
        EngineConfig(ModelConfig("m"), CacheConfig(kv_allocation="contiguous-max"), lora=LoRAConfig())
    EngineConfig(ModelConfig("m"), CacheConfig(kv_allocation="paged"), lora=LoRAConfig())
