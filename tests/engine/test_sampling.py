"""Sampling behaviour through the engine, and the sampler's pieces against plain formulas."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.sample.sampler import _apply_top_k_top_p

from hf_reference import hf_greedy, load_hf, make_prompts


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path("llama-gqa"), max_model_len=256, kv_cache_memory_bytes=16 << 20, seed=0)


@pytest.fixture(scope="module")
def prompts(llm):
    return [{"prompt_token_ids": p} for p in make_prompts(llm.llm_engine.vocab_size, [4, 9, 30, 12, 50, 7], seed=3)]


def test_seed_reproducible_whatever_the_batch(llm, prompts):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=42, ignore_eos=True)
    (alone,) = llm.generate([prompts[0]], seeded, use_tqdm=False)
    others = [SamplingParams(temperature=0.7, max_tokens=25, seed=s, ignore_eos=True) for s in (1, 2)]
    others += [SamplingParams(temperature=1.2, max_tokens=15, ignore_eos=True), SamplingParams(temperature=0)]
    batch = llm.generate(prompts[1:5] + [prompts[0]], others + [seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids
    (again,) = llm.generate([prompts[0]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=43, ignore_eos=True), use_tqdm=False)
    assert again.outputs[0].token_ids != alone.outputs[0].token_ids


def _ascii_completion(llm):
    """A prompt whose greedy 8-token completion is printable ASCII, and that completion's pieces."""
    tok = llm.get_tokenizer()
    for prompt in make_prompts(llm.llm_engine.vocab_size, [6] * 40, seed=11):
        (out,) = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        pieces = [tok.decode([i]) for i in out.outputs[0].token_ids]
        if all(p.isascii() and p.isprintable() and p for p in pieces) and len(pieces[4]) >= 2:
            return {"prompt_token_ids": prompt}, pieces, out.outputs[0].text
    pytest.fail("no prompt with an ASCII completion; change the seed")


def test_stop_string_split_across_tokens_is_found_and_excluded(llm):
    prompt, pieces, text = _ascii_completion(llm)
    assert text == "".join(pieces)
    # A stop string made of the end of token 3's text and the start of token 4's.
    stop = pieces[3][-1:] + pieces[4][:2]
    cut = text.find(stop)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop, "never-there"])
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].text == text[:cut]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop, include_stop_str_in_output=True)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert out.outputs[0].text == text[: cut + len(stop)]


def test_streamed_text_equals_decoded_text(llm, prompts):
    """delta outputs concatenate to the final text, which equals decoding the token ids."""
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=40, ignore_eos=True, output_kind="delta")
    rid = engine.add_request(None, prompts[3], params)
    text, ids = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            ids += out.outputs[0].token_ids
    assert len(ids) == 40 and rid == out.request_id
    assert text == tok.decode(ids)


def test_stop_token_ids_and_min_tokens(llm, prompts):
    base = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (full,) = llm.generate([prompts[1]], base, use_tqdm=False)
    ids = full.outputs[0].token_ids
    stop_id = ids[3]
    first = ids.index(stop_id)
    (out,) = llm.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id]), use_tqdm=False)
    assert out.outputs[0].token_ids == ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_id
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=12)
    (out,) = llm.generate([prompts[1]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 12
    assert stop_id not in out.outputs[0].token_ids[:12]


def test_eos_and_ignore_eos(llm, prompts):
    eos = llm.llm_engine.eos_token_id
    push_eos = {eos: 100.0}
    (out,) = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=10, logit_bias=push_eos), use_tqdm=False)
    assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias=push_eos, ignore_eos=True)
    (out,) = llm.generate([prompts[0]], params, use_tqdm=False)
    assert out.outputs[0].token_ids == [eos] * 10 and out.outputs[0].finish_reason == "length"
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias=push_eos, min_tokens=4)
    (out,) = llm.generate([prompts[0]], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].token_ids[-1] == eos


def test_repetition_penalty_matches_transformers(llm, model_path, prompts):
    path = model_path("llama-gqa")
    prompt = prompts[4]["prompt_token_ids"]
    model = load_hf(path)
    expected = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=24, min_new_tokens=24, do_sample=False, repetition_penalty=1.5,
        pad_token_id=model.config.pad_token_id,
    )[0, len(prompt):].tolist()
    assert expected != hf_greedy(path, prompt, new_tokens=24, min_new_tokens=24)  # the penalty matters here
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, repetition_penalty=1.5)
    (out,) = llm.generate([prompts[4]], params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected


def test_presence_and_frequency_penalties_follow_openai_formula():
    from pagedserve.sample.metadata import PenaltyInputs
    from pagedserve.sample.sampler import _apply_penalties

    vocab = 6
    logits = torch.tensor([[1.0, 2.0, 3.0, -1.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    outputs = torch.tensor([[2, 2, 4], [vocab, vocab, vocab]])  # row 1 has no outputs yet
    p = PenaltyInputs(
        rows=torch.tensor([0, 1]), presence=torch.tensor([0.5, 0.5]), frequency=torch.tensor([0.25, 0.25]),
        repetition=torch.tensor([1.0, 1.0]), output_token_ids=outputs, prompt_token_ids=torch.tensor([[0], [1]]),
    )
    expected = logits.clone()
    # OpenAI: logit -= count * frequency + (count > 0) * presence; output tokens only.
    expected[0, 2] -= 2 * 0.25 + 0.5
    expected[0, 4] -= 1 * 0.25 + 0.5
    _apply_penalties(logits, p)
    assert torch.allclose(logits, expected)


def test_top_k_top_p_keep_exactly_the_nucleus():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    out = _apply_top_k_top_p(logits.clone(), torch.tensor([2, 4]), torch.tensor([1.0, 0.65]))
    kept = torch.isfinite(out)
    # Row 0: top-2. Row 1: smallest set with mass >= 0.65 is {0.4, 0.3}.
    assert kept.tolist() == [[True, True, False, False], [True, True, False, False]]


def test_sampling_follows_the_temperature_scaled_distribution():
    from pagedserve.sample.metadata import SamplingMetadata
    from pagedserve.sample.sampler import Sampler

    torch.manual_seed(0)
    rows = 4000
    base = torch.tensor([2.0, 1.0, 0.0, -1.0])
    meta = SamplingMetadata(
        num_rows=rows, all_greedy=False, temperature=torch.full((rows,), 0.5), greedy_mask=None,
        top_p=None, top_k=None, min_p=None, generators={}, penalties=None, logit_bias=None, max_num_logprobs=None,
    )
    tokens = Sampler()(base.repeat(rows, 1), meta).token_ids
    freq = torch.bincount(tokens, minlength=4).float() / rows
    expected = torch.softmax(base / 0.5, dim=0)
    assert torch.allclose(freq, expected, atol=0.03)


def test_too_long_prompt_is_rejected_and_engine_goes_on(llm, prompts):
    too_long = {"prompt_token_ids": [10] * 256}
    with pytest.raises(ValueError, match="maximum context length is 256"):
        llm.generate([prompts[0], too_long], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(
    "field,value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2.0), ("max_tokens", 0),
     ("min_tokens", -1), ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
     ("logprobs", -2), ("stop", [""]), ("stop_token_ids", [-1]), ("n", 0), ("seed", "x")],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_out_of_vocab_ids_fail_alone(llm, prompts):
    engine = llm.llm_engine
    good = engine.add_request(None, prompts[0], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request(None, prompts[1], SamplingParams(stop_token_ids=[10**9]))
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.add_request(None, {"prompt_token_ids": [10**9]}, SamplingParams())
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert list(finished) == [good] and len(finished[good].outputs[0].token_ids) == 3


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello there"}]
    (out,) = llm.chat(messages, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert out.prompt == expected
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)
