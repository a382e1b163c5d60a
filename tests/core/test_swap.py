"""Swap preemption: identical outputs to an unconstrained run; blocks really move."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

from hf_reference import make_prompts


@pytest.fixture(scope="module")
def setup(model_path):
    path = model_path("llama-gqa")
    from transformers import AutoConfig

    prompts = [{"prompt_token_ids": p} for p in make_prompts(AutoConfig.from_pretrained(path).vocab_size, [30, 50, 12, 70, 5, 41], seed=4)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)] * 3
    free = LLM(path, max_model_len=256, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    expected = [o.outputs[0].token_ids for o in free.generate(prompts, params, use_tqdm=False)]
    return path, prompts, params, expected


def run(path, prompts, params, **kwargs):
    llm = LLM(path, max_model_len=128, num_gpu_blocks_override=10, enable_prefix_caching=False, **kwargs)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm.llm_engine.get_stats().scheduler


def test_forced_swap_moves_blocks_and_changes_nothing(setup):
    path, prompts, params, expected = setup
    tokens, stats = run(path, prompts, params, preemption_mode="swap")
    assert tokens == expected
    assert stats.num_preemptions_total > 0
    assert stats.num_swapped_out_blocks_total > 0
    assert stats.num_swapped_in_blocks_total == stats.num_swapped_out_blocks_total


@pytest.mark.parametrize("mode", ["recompute", "auto"])
def test_recompute_and_auto_change_nothing(setup, mode):
    path, prompts, params, expected = setup
    tokens, stats = run(path, prompts, params, preemption_mode=mode)
    assert tokens == expected and stats.num_preemptions_total > 0
    if mode == "recompute":
        assert stats.num_swapped_out_blocks_total == 0


def test_full_swap_pool_falls_back_to_recompute(setup):
    path, prompts, params, expected = setup
    llm = LLM(path, max_model_len=128, num_gpu_blocks_override=10, enable_prefix_caching=False,
              preemption_mode="swap", swap_space=1e-9)  # 1 byte: too small for a single block
    outputs = llm.generate(prompts, params, use_tqdm=False)
    stats = llm.llm_engine.get_stats().scheduler
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert stats.num_preemptions_total > 0 and stats.num_swapped_out_blocks_total == 0


def test_abort_of_a_swapped_request_frees_its_host_blocks(setup):
    path, prompts, params, _ = setup
    llm = LLM(path, max_model_len=128, num_gpu_blocks_override=10, enable_prefix_caching=False, preemption_mode="swap")
    engine = llm.llm_engine
    ids = [engine.add_request(None, p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)) for p in prompts]
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0].request_id
    engine.abort_request(victim)
    assert victim not in engine.kv_manager.swapped_tables
    engine.kv_manager.check_integrity()
    engine.abort_request(ids)
