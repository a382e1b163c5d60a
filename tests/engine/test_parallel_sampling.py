"""n / best_of: samples share the prompt's blocks (fork + copy-on-write) and equal
independent requests with their per-sample seeds."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

from hf_reference import make_prompts


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path("llama-gqa"), max_model_len=256, kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def prompts(llm):
    return [{"prompt_token_ids": p} for p in make_prompts(llm.llm_engine.vocab_size, [40, 7, 23], seed=9)]


def test_n_samples_equal_single_requests_with_per_sample_seeds(llm, prompts):
    params = SamplingParams(n=4, temperature=1.0, top_p=0.95, seed=100, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        for completion in out.outputs:
            single = SamplingParams(temperature=1.0, top_p=0.95, seed=100 + completion.index, max_tokens=16, ignore_eos=True)
            (alone,) = llm.generate([prompt], single, use_tqdm=False)
            assert completion.token_ids == alone.outputs[0].token_ids
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_best_of_returns_the_most_likely_samples(llm, prompts):
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([prompts[1]], params, use_tqdm=False)
    scored = []
    for i in range(5):
        single = SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True, logprobs=0)
        (alone,) = llm.generate([prompts[1]], single, use_tqdm=False)
        scored.append((alone.outputs[0].cumulative_logprob, alone.outputs[0].token_ids))
    best = sorted(scored, key=lambda s: s[0], reverse=True)[:2]
    assert [c.token_ids for c in out.outputs] == [b[1] for b in best]
    assert [c.cumulative_logprob for c in out.outputs] == pytest.approx([b[0] for b in best], abs=1e-4)
    assert all(c.logprobs is None for c in out.outputs)  # not asked for


def test_samples_share_prompt_blocks_and_copy_only_the_partial_one(llm, prompts):
    engine = llm.llm_engine
    kv = engine.kv_manager
    # 40 prompt tokens, block 16: two full blocks and a partial third.
    rid = engine.add_request(None, prompts[0], SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True))
    engine.step()  # prefill + first tokens: the siblings fork the parent's blocks
    tables = [kv.get_block_table(f"{rid}#{i}") for i in range(4)]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 3
    assert [kv.pool.ref_cnt[b] for b in tables[0]] == [4, 4, 4]
    engine.step()  # each sample writes its first token into the shared partial block
    tables = [kv.get_block_table(f"{rid}#{i}") for i in range(4)]
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 1
    assert len({t[2] for t in tables}) == 4  # 3 copies + the original
    assert kv.pool.num_used_blocks == 2 + 4  # vs 12 without sharing
    kv.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()


def test_abort_of_a_group_frees_every_sample(llm, prompts):
    engine = llm.llm_engine
    rid = engine.add_request(None, prompts[2], SamplingParams(n=3, temperature=0.8, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    engine.kv_manager.assert_all_free()
    # Aborted before any fork: siblings leave with their first sample.
    rid = engine.add_request(None, prompts[2], SamplingParams(n=3, temperature=0.8, max_tokens=5))
    engine.abort_request(rid)
    assert not engine.has_unfinished_requests()


def test_greedy_best_of_is_rejected_and_greedy_n_gives_copies(llm, prompts):
    with pytest.raises(ValueError, match="best_of must be n .* with greedy"):
        SamplingParams(n=1, best_of=2, temperature=0.0)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2, temperature=1.0)
    # n greedy samples (OpenAI accepts n > 1 at temperature 0): n copies of the greedy answer.
    (out,) = llm.generate([prompts[1]], SamplingParams(n=3, temperature=0, max_tokens=8), use_tqdm=False)
    (alone,) = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == alone.outputs[0].token_ids for c in out.outputs)


def test_samples_survive_preemption(model_path, prompts):
    # So little KV memory that the samples preempt each other; each still equals its single run.
    llm = LLM(model_path("llama-gqa"), max_model_len=96, num_gpu_blocks_override=9, enable_prefix_caching=False)
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40, ignore_eos=True)
    (out,) = llm.generate([prompts[0]], params, use_tqdm=False)
    assert llm.llm_engine.get_stats().scheduler.num_preemptions_total > 0
    for completion in out.outputs:
        single = SamplingParams(temperature=1.0, seed=3 + completion.index, max_tokens=40, ignore_eos=True)
        (alone,) = llm.generate([prompts[0]], single, use_tqdm=False)
        assert completion.token_ids == alone.outputs[0].token_ids
