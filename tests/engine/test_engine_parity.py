"""Engine output vs Hugging Face transformers on the same weights (fp32, greedy)."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams

from hf_reference import ARCH_MODELS, NEW_TOKENS, hf_greedy, hf_token_logprobs, make_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module", params=ARCH_MODELS)
def reference(request, model_path):
    """(model path, prompts, HF greedy outputs) for one architecture."""
    path = model_path(request.param)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    prompts = make_prompts(vocab)
    expected = [hf_greedy(path, p, min_new_tokens=NEW_TOKENS) for p in prompts]
    return path, prompts, expected


def generate(path: str, prompts: list[list[int]], **engine_kwargs) -> list:
    engine_kwargs.setdefault("max_model_len", 512)
    engine_kwargs.setdefault("kv_cache_memory_bytes", 32 << 20)
    llm = LLM(path, **engine_kwargs)
    outputs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    return llm, outputs


def assert_same_tokens(outputs, expected) -> None:
    for i, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
        assert out.outputs[0].token_ids == exp, f"prompt {i}: engine and transformers differ"


def test_batched_greedy_matches_transformers_with_logprobs(reference):
    path, prompts, expected = reference
    _, outputs = generate(path, prompts)
    assert_same_tokens(outputs, expected)
    for out, prompt in zip(outputs, prompts, strict=True):
        completion = out.outputs[0]
        ours = [entry[token].logprob for entry, token in zip(completion.logprobs, completion.token_ids, strict=True)]
        theirs = hf_token_logprobs(path, prompt, completion.token_ids)
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4
        assert completion.cumulative_logprob == pytest.approx(sum(theirs), abs=1e-3)
        assert completion.finish_reason == "length"


def test_chunked_prefill_under_tiny_budget(reference):
    path, prompts, expected = reference
    llm, outputs = generate(path, prompts, max_num_batched_tokens=16)
    assert_same_tokens(outputs, expected)
    assert llm.llm_engine.get_stats().num_steps_total > 300 // 16


def test_preemption_under_tiny_kv_cache(reference):
    path, prompts, expected = reference
    # 22 blocks of 16 = 352 tokens: room for the longest request, far from all of them.
    llm, outputs = generate(path, prompts, num_gpu_blocks_override=22, max_model_len=340)
    assert_same_tokens(outputs, expected)
    assert llm.llm_engine.get_stats().scheduler.num_preemptions_total > 0


@pytest.mark.parametrize("block_size", [8, 32])
def test_block_sizes(reference, block_size):
    path, prompts, expected = reference
    _, outputs = generate(path, prompts, block_size=block_size)
    assert_same_tokens(outputs, expected)


def test_each_prompt_alone(reference):
    path, prompts, expected = reference
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    for prompt, exp in zip(prompts, expected, strict=True):
        (out,) = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == exp


def test_eos_stops_like_transformers(model_path):
    # Without min_tokens, both sides stop at EOS (if it comes) and include it in the ids.
    path = model_path("llama-gqa")
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size, [3, 40, 90], seed=1)
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    outputs = llm.generate(token_prompts(prompts), SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    for out, prompt in zip(outputs, prompts, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, new_tokens=48)
