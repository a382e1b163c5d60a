"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers' fp32 log_softmax."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

from hf_reference import load_hf, make_prompts

LENGTHS = [1, 2, 17, 40, 100]
TOP = 3


@torch.inference_mode()
def hf_prompt_logprobs(path: str, prompt: list[int]) -> torch.Tensor:
    """(len(prompt), vocab) log_softmax of transformers' logits at each position."""
    return torch.log_softmax(load_hf(path)(torch.tensor([prompt])).logits[0].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(model_path):
    path = model_path("llama-gqa")
    from transformers import AutoConfig

    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size, LENGTHS, seed=3)
    return path, prompts, [hf_prompt_logprobs(path, p) for p in prompts]


def check(outputs, prompts, expected) -> None:
    for out, prompt, ref in zip(outputs, prompts, expected, strict=True):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prompt)
        assert entries[0] is None
        for position, (token, entry) in enumerate(zip(prompt[1:], entries[1:], strict=True)):
            row = ref[position]
            assert abs(entry[token].logprob - row[token].item()) < 1e-4
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top_values, top_ids = row.topk(TOP)
            others = {t: lp for t, lp in entry.items() if t != token}
            # The prompt token plus the top TOP (fewer keys when the prompt token is among them).
            assert set(entry) == set(top_ids.tolist()) | {token}
            for t, v in zip(top_ids.tolist(), top_values.tolist(), strict=True):
                if t in others:
                    assert abs(others[t].logprob - v) < 1e-4


def run(path, prompts, params, **kwargs):
    kwargs.setdefault("max_model_len", 256)
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    llm = LLM(path, dtype="float32", **kwargs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_prompt_logprobs_match_transformers(reference):
    path, prompts, expected = reference
    _, outputs = run(path, prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP))
    check(outputs, prompts, expected)


def test_prompt_logprobs_with_chunked_prefill(reference):
    path, prompts, expected = reference
    llm, outputs = run(path, prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP),
                       max_num_batched_tokens=16)
    check(outputs, prompts, expected)
    assert llm.llm_engine.get_stats().num_steps_total > sum(LENGTHS) // 16


def test_prompt_logprobs_after_a_prefix_cache_fill(reference):
    """A request for prompt logprobs skips the cache: the second pass still gets every one."""
    path, prompts, expected = reference
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
              enable_prefix_caching=True)
    token_prompts = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(token_prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP)
    outputs = llm.generate(token_prompts, params, use_tqdm=False)
    check(outputs, prompts, expected)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    # The blocks it computed are published for others, who do hit them.
    again = llm.generate(token_prompts, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert again[-1].num_cached_tokens > 0


def test_prompt_logprobs_of_a_sample_group_and_a_stream(reference):
    path, prompts, expected = reference
    params = SamplingParams(temperature=1.0, n=3, seed=1, max_tokens=3, prompt_logprobs=TOP)
    _, outputs = run(path, prompts[2:4], params)
    check(outputs, prompts[2:4], expected[2:4])
    assert all(len(o.outputs) == 3 for o in outputs)


def test_prompt_logprobs_field_is_validated():
    for bad in (-2, 1.5):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    # No fixed cap at 20 (the server's --max-logprobs caps requests): the vocabulary does.
    SamplingParams(prompt_logprobs=21).validate_vocab(1024)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1025).validate_vocab(1024)
