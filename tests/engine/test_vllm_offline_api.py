"""vLLM's offline names and fields (issue: drop-in for vLLM users), each against an oracle."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams

from hf_reference import load_hf, make_prompts

MODEL = "llama-gqa"


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path(MODEL), max_model_len=256, kv_cache_memory_bytes=16 << 20, dtype="float32")


@torch.inference_mode()
def hf_greedy_masked(path: str, prompt: list[int], steps: int, allowed: list[int] | None = None,
                     banned: list[int] | None = None) -> list[int]:
    """transformers' logits, argmax over the allowed (or not banned) tokens, step by step."""
    model = load_hf(path)
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(torch.tensor([tokens])).logits[0, -1]
        if allowed is not None:
            mask = torch.full_like(logits, float("-inf"))
            mask[allowed] = 0
            logits = logits + mask
        if banned is not None:
            logits[banned] = float("-inf")
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def test_top_level_names_import() -> None:
    import pagedserve
    from pagedserve import (
        AsyncEngineArgs,
        AsyncLLMEngine,
        EngineArgs,
        LLMEngine,
        TextPrompt,
        TokensPrompt,
    )
    from pagedserve.inputs import TextPrompt as TextPrompt2
    from pagedserve.logprobs import Logprob
    from pagedserve.sampling_params import BeamSearchParams, RequestOutputKind

    assert TextPrompt is TextPrompt2 and issubclass(AsyncEngineArgs, EngineArgs)
    assert LLMEngine.__name__ == "LLMEngine" and AsyncLLMEngine.__name__ == "AsyncLLMEngine"
    assert BeamSearchParams(beam_width=2, max_tokens=4).beam_width == 2
    assert Logprob(-1.0).logprob == -1.0 and TokensPrompt(prompt_token_ids=[1]) == {"prompt_token_ids": [1]}
    assert RequestOutputKind.DELTA == 1 and set(pagedserve.__all__) >= {"LLMEngine", "TokensPrompt"}
    with pytest.raises(AttributeError):
        _ = pagedserve.NoSuchName  # type: ignore[attr-defined]


def test_allowed_token_ids_equal_transformers_masked(llm, model_path) -> None:
    path = model_path(MODEL)
    prompt = make_prompts(llm.llm_engine.vocab_size, [9])[0]
    allowed = list(range(20, 60))
    params = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert out == hf_greedy_masked(path, prompt, 6, allowed=allowed)
    free = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    assert free != out, "the mask must change this output, or the test proves nothing"


def test_bad_words_are_never_generated(llm, model_path) -> None:
    """A one-token bad word equals transformers with that token banned."""
    path = model_path(MODEL)
    tok = llm.get_tokenizer()
    prompt = make_prompts(llm.llm_engine.vocab_size, [7], seed=3)[0]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    free = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    word = tok.decode([free[0]]).strip()
    banned_ids = sorted({ids[-1] for v in (word, " " + word) if len(ids := tok.encode(v, add_special_tokens=False)) == 1})
    assert free[0] in banned_ids
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word])
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert not set(out) & set(banned_ids)
    assert out == hf_greedy_masked(path, prompt, 8, banned=banned_ids)


def test_truncate_detokenize_final_only_and_logprobs_all(llm) -> None:
    from pagedserve.sampling_params import RequestOutputKind

    prompt = make_prompts(llm.llm_engine.vocab_size, [30], seed=5)[0]
    base = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tail = llm.generate({"prompt_token_ids": prompt[-10:]}, base, use_tqdm=False)[0]
    cut = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                   truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-10:] and cut.outputs[0].token_ids == tail.outputs[0].token_ids
    raw = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                   detokenize=False), use_tqdm=False)[0]
    assert raw.outputs[0].text == "" and len(raw.outputs[0].token_ids) == 4
    engine = llm.llm_engine
    engine.add_request("final", {"prompt_token_ids": prompt},
                       SamplingParams(max_tokens=5, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY))
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert len(seen) == 1 and seen[0].finished and len(seen[0].outputs[0].token_ids) == 5
    full = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, logprobs=-1),
                        use_tqdm=False)[0].outputs[0]
    assert all(len(entry) == engine.vocab_size for entry in full.logprobs)
    probs = torch.tensor([lp.logprob for lp in full.logprobs[0].values()]).exp().sum()
    assert abs(float(probs) - 1.0) < 1e-4


def test_sampling_params_helpers_and_errors() -> None:
    p = SamplingParams(stop=["x"], logit_bias={1: 1.0}, extra_args={"k": [1]})
    q = p.clone()
    assert q == p and q.extra_args is not p.extra_args and q.logit_bias is not p.logit_bias
    assert SamplingParams.from_optional(temperature=None, top_p=0.5).temperature == 1.0
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams.from_optional(bogus=1)
    for kwargs, field in [({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words"),
                          ({"detokenize": False, "stop": "a"}, "detokenize"),
                          ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                          ({"output_kind": "sometimes"}, "output_kind"), ({"logprobs": -2}, "logprobs")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_llm_helpers(llm) -> None:
    from pagedserve import LoRARequest

    assert llm.get_default_sampling_params() == SamplingParams()
    prompt = {"prompt_token_ids": make_prompts(llm.llm_engine.vocab_size, [40], seed=9)[0]}
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    again = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert llm.reset_prefix_cache() is True
    cold = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert cold.num_cached_tokens == 0
    metrics = {m.name: m.value for m in llm.get_metrics()}
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:generation_tokens"] >= 3
    calls = []

    class Bar:
        def __init__(self, **kwargs):
            calls.append(kwargs["total"])
            self.format_dict = {"elapsed": 1.0}

        def update(self, n): ...
        def set_postfix_str(self, s): ...
        def close(self): ...

    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=Bar)
    assert calls == [1]
    lora = LoRARequest("a", 1, "/adapters/a", base_model_name="m")
    assert (lora.name, lora.path, lora.base_model_name) == ("a", "/adapters/a", "m")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1)
    llm.set_tokenizer(llm.get_tokenizer())


def test_generate_priority_needs_the_priority_policy(llm, model_path) -> None:
    prompt = {"prompt_token_ids": [11, 12, 13]}
    with pytest.raises(ValueError, match="priority"):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False, priority=[1])
    ranked = LLM(model_path(MODEL), max_model_len=64, kv_cache_memory_bytes=4 << 20, scheduling_policy="priority",
                 max_num_seqs=1)
    outs = ranked.generate([prompt, {"prompt_token_ids": [14, 15]}], SamplingParams(max_tokens=2, ignore_eos=True),
                           use_tqdm=False, priority=[3, 0])
    # max_num_seqs=1: the priority-0 request runs (and finishes) first.
    assert outs[1].metrics.finished_time < outs[0].metrics.first_scheduled_time
