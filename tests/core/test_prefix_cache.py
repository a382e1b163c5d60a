"""Automatic prefix caching: pool eviction order, hit == miss through the engine, counters."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.request import Request

from hf_reference import make_prompts


def _request(rid: str, tokens: list[int], salt: str | None = None, lora_id: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(), eos_token_id=None, cache_salt=salt, lora_id=lora_id)


def _admit(kv: KVCacheManager, req: Request) -> list[int]:
    hits = kv.find_cached_prefix(req)
    computed = len(hits) * kv.block_size
    assert kv.allocate_slots(req.request_id, computed, req.num_tokens - computed, hits)
    req.num_computed_tokens = req.num_tokens
    kv.cache_full_blocks(req, req.num_tokens)
    return hits


def test_hits_reuse_exact_blocks_and_last_token_is_recomputed():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = _request("a", list(range(1, 13)))  # 3 full blocks
    assert _admit(kv, a) == []
    assert kv.get_block_table("a") == [0, 1, 2]
    # Same 12 tokens: only 2 blocks may hit, the last token must be computed again.
    b = _request("b", list(range(1, 13)))
    assert _admit(kv, b) == [0, 1]
    assert kv.get_block_table("b") == [0, 1, 3]
    assert kv.pool.ref_cnt[:4] == [2, 2, 1, 1]
    # Diverging after one block.
    c = _request("c", list(range(1, 5)) + [99] * 8)
    assert _admit(kv, c) == [0]
    for r in ("a", "b", "c"):
        kv.free(r)
    kv.assert_all_free()


def test_freed_blocks_stay_cached_and_evict_lru_tail_first():
    kv = KVCacheManager(num_blocks=7, block_size=2, enable_caching=True)
    a = _request("a", [1, 2, 3, 4, 5, 6])  # blocks 0,1,2
    _admit(kv, a)
    kv.free("a")
    # Freed tail first: the free queue is now 3,4,5,6 (never used), then 2,1,0.
    assert kv.pool.num_cached_blocks == 3 and kv.num_free_blocks == 7
    b = _request("b", [7, 8, 9, 10, 11, 12, 13, 14, 15, 16])  # 5 blocks: 3,4,5,6, then evicts 2 (a's tail)
    _admit(kv, b)
    assert kv.get_block_table("b") == [3, 4, 5, 6, 2]
    assert kv.pool.num_evictions == 1
    kv.free("b")
    # Free queue: 1, 0 (a's head, cached), then b's blocks tail first: 2, 6, 5, 4, 3.
    # a's first two blocks survived: a repeat of a hits them, and its new block
    # evicts the least recently freed one, b's tail (block 2).
    a2 = _request("a2", [1, 2, 3, 4, 5, 6])
    assert _admit(kv, a2) == [0, 1]
    assert kv.get_block_table("a2") == [0, 1, 2]
    assert kv.pool.num_evictions == 2
    kv.free("a2")
    kv.assert_all_free()


def test_salt_and_adapter_separate_cache_entries():
    kv = KVCacheManager(num_blocks=12, block_size=2, enable_caching=True)
    tokens = [1, 2, 3, 4, 5]
    _admit(kv, _request("a", tokens))
    assert _admit(kv, _request("salted", tokens, salt="tenant-2")) == []
    assert _admit(kv, _request("lora", tokens, lora_id=3)) == []
    assert _admit(kv, _request("same", tokens)) == [0, 1]
    for r in ("a", "salted", "lora", "same"):
        kv.free(r)
    kv.assert_all_free()


@pytest.fixture(scope="module")
def shared_prefix_prompts(model_path):
    path = model_path("llama-gqa")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    (prefix,) = make_prompts(vocab, [70], seed=5)
    tails = make_prompts(vocab, [3, 9, 17, 30, 1, 12], seed=6)
    return path, [{"prompt_token_ids": prefix + t} for t in tails]


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"max_num_batched_tokens": 24}, {"num_gpu_blocks_override": 14, "max_model_len": 200}],
    ids=["plain", "chunked", "preempting"],
)
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_cache_hit_gives_the_output_of_a_miss(shared_prefix_prompts, engine_kwargs, params):
    path, prompts = shared_prefix_prompts
    kwargs = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, **engine_kwargs}
    miss = LLM(path, enable_prefix_caching=False, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, enable_prefix_caching=True, **kwargs)
    # First pass warms the cache (and already shares the prefix between requests),
    # second pass hits it for every request.
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    for a, b, c in zip(miss, first, second, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert all(o.num_cached_tokens >= 64 for o in second)
    stats = llm.llm_engine.get_stats().scheduler
    assert stats.prefix_cache_hits >= sum(o.num_cached_tokens for o in second)
    if "num_gpu_blocks_override" in engine_kwargs:
        assert stats.num_preemptions_total > 0


def test_requests_admitted_together_share_their_prefix(shared_prefix_prompts):
    # Blocks are published when scheduled, so a request admitted in the same step as the
    # one computing a shared prefix already reuses it.
    path, prompts = shared_prefix_prompts
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert outs[0].num_cached_tokens == 0
    assert [o.num_cached_tokens for o in outs[1:]] == [64] * (len(outs) - 1)
    assert llm.llm_engine.get_stats().num_steps_total == 4  # one prefill step for all of them


def test_hit_counters_match_reused_tokens(shared_prefix_prompts):
    path, prompts = shared_prefix_prompts
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (first,) = llm.generate([prompts[0]], params, use_tqdm=False)
    assert first.num_cached_tokens == 0
    outs = llm.generate(prompts[1:], params, use_tqdm=False)
    stats = llm.llm_engine.get_stats().scheduler
    # Each later prompt shares 70 prefix tokens = 4 full blocks of 16 with the first.
    assert [o.num_cached_tokens for o in outs] == [64] * len(outs)
    assert stats.prefix_cache_hits == 64 * len(outs)
    total = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert stats.prefix_cache_queries == total
