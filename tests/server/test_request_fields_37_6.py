"""Issue #37.6, vLLM's request extras on /v1/completions and /v1/chat/completions:
prompt_logprobs on chat, bad_words, allowed_token_ids, truncate_prompt_tokens, cache_salt,
and --max-logprobs above OpenAI's 20, through the real openai client on a live server.

Oracles: transformers (fp32) on the same weights: its logits give the prompt logprobs and
the top logprobs, and a greedy loop over them with vLLM's masks written out here (a bad
word's last token is banned wherever the output so far ends with the word's other tokens;
only allowed_token_ids may be chosen) gives the expected tokens; the Hugging Face tokenizer
counts the kept suffix of a truncated prompt; cached tokens follow the prefix cache's block
arithmetic (a repeated prompt hits every full block but the one holding its last token).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from hf_reference import load_hf, make_prompts
from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

MAX_LOGPROBS = 40
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog"}]
PROMPT = "The quick brown fox jumps over the lazy dog because it is late"
NEW = 12


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--dtype", "float32", "--enable-prompt-tokens-details",
                         "--max-logprobs", str(MAX_LOGPROBS)]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(server: LiveServer):
    return AutoTokenizer.from_pretrained(server.model_path)



def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@torch.inference_mode()
def _hf_greedy(path: str, prompt: list[int], new_tokens: int, allowed: Sequence[int] | None = None,
               bad_words: Sequence[Sequence[int]] = ()) -> list[int]:
    """Greedy over transformers' logits with vLLM's allowed_token_ids and bad_words masks."""
    model = load_hf(path)
    out: list[int] = []
    for _ in range(new_tokens):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        if allowed is not None:
            keep = torch.full_like(logits, float("-inf"))
            keep[list(allowed)] = 0.0
            logits = logits + keep
        for word in bad_words:
            prefix = list(word[:-1])
            if not prefix or out[-len(prefix):] == prefix:
                logits[word[-1]] = float("-inf")
        out.append(int(logits.argmax()))
    return out


def _complete(client: openai.OpenAI, prompt: str | list[int], **extra: object):
    return client.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True, **extra})


def _contains(ids: list[int], seq: list[int]) -> bool:
    return any(ids[i:i + len(seq)] == seq for i in range(len(ids) - len(seq) + 1))


# ---- prompt_logprobs on chat, --max-logprobs above 20 -----------------------------------------


def test_chat_prompt_logprobs_match_transformers(server: LiveServer, tokenizer) -> None:
    ids = _chat_ids(tokenizer, MESSAGES)
    with torch.inference_mode():
        ref = torch.log_softmax(load_hf(server.model_path)(torch.tensor([ids])).logits[0].float(), dim=-1)
    body = {"model": TEST_MODEL, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 25}
    out = httpx.post(server.v1 + "/chat/completions", json=body, timeout=60).json()
    entries = out["prompt_logprobs"]
    assert out["usage"]["prompt_tokens"] == len(ids) and len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        record = entries[i][str(ids[i])]
        assert abs(record["logprob"] - ref[i - 1, ids[i]].item()) < 1e-4
        assert record["rank"] == int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        # The prompt token, then the top 25 (one fewer key when the token is among them).
        assert 25 <= len(entries[i]) <= 26
    streamed = httpx.post(server.v1 + "/chat/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    server.assert_no_leaks()


def test_max_logprobs_above_20(server: LiveServer, client: openai.OpenAI, tokenizer) -> None:
    ids = tokenizer(PROMPT).input_ids
    out = client.completions.create(model=TEST_MODEL, prompt=ids, max_tokens=1, temperature=0, logprobs=30,
                                    extra_body={"return_tokens_as_token_ids": True})
    with torch.inference_mode():
        logits = load_hf(server.model_path)(torch.tensor([ids])).logits[0, -1].float()
    ref = torch.log_softmax(logits, dim=-1).topk(30)
    top = out.choices[0].logprobs.top_logprobs[0]
    assert len(top) == 30  # greedy: the chosen token is the first of the top 30
    assert {int(k.removeprefix("token_id:")) for k in top} == set(ref.indices.tolist())
    assert sorted(top.values()) == pytest.approx(sorted(ref.values.tolist()), abs=1e-4)
    chat = client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, max_tokens=2, logprobs=True,
                                          top_logprobs=MAX_LOGPROBS)
    assert all(len(t.top_logprobs) == MAX_LOGPROBS for t in chat.choices[0].logprobs.content)
    for field, call in [
        ("logprobs", lambda: client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=1,
                                                       logprobs=MAX_LOGPROBS + 1)),
        ("top_logprobs", lambda: client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, max_tokens=1,
                                                                logprobs=True, top_logprobs=MAX_LOGPROBS + 1)),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == field and "--max-logprobs" in info.value.body["message"]
    server.assert_no_leaks()


# ---- bad_words, allowed_token_ids --------------------------------------------------------------


def _a_word_of(tokenizer, output: list[int]) -> str:
    """A word of the greedy output whose tokens (with or without a leading space) occur in it."""
    pieces = [tokenizer.decode(output[i:i + n]) for n in (1, 2) for i in range(len(output) - n + 1)]
    for word in [*tokenizer.decode(output).split(), *(p.strip() for p in pieces)]:
        if not word or "\ufffd" in word:
            continue
        if any(_contains(output, tokenizer.encode(v, add_special_tokens=False)) for v in (word, " " + word)):
            return word
    raise AssertionError(f"no word of {tokenizer.decode(output)!r} found as its own tokens")


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_words_match_transformers_with_the_word_masked(server: LiveServer, client: openai.OpenAI, tokenizer,
                                                           route: str) -> None:
    prompt = tokenizer(PROMPT).input_ids if route == "completions" else _chat_ids(tokenizer, MESSAGES)
    baseline = _hf_greedy(server.model_path, prompt, NEW)
    word = _a_word_of(tokenizer, baseline)
    banned = [tokenizer.encode(v, add_special_tokens=False) for v in (word, " " + word)]
    expected = _hf_greedy(server.model_path, prompt, NEW, bad_words=banned)
    if route == "completions":
        got = _complete(client, prompt, bad_words=[word]).choices[0].token_ids
    else:
        got = client.chat.completions.create(
            model=TEST_MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True, "bad_words": [word]}).choices[0].token_ids
    assert got == expected != baseline
    assert not any(_contains(got, seq) for seq in banned)
    server.assert_no_leaks()


def test_allowed_token_ids(server: LiveServer, client: openai.OpenAI, tokenizer) -> None:
    allowed = sorted(set(make_prompts(tokenizer.vocab_size, [6], seed=37)[0]))
    prompt = tokenizer(PROMPT).input_ids
    greedy = _complete(client, prompt, allowed_token_ids=allowed).choices[0].token_ids
    assert greedy == _hf_greedy(server.model_path, prompt, NEW, allowed=allowed)
    sampled = client.chat.completions.create(
        model=TEST_MODEL, messages=MESSAGES, max_tokens=NEW, temperature=1.5, seed=5, n=3,
        extra_body={"ignore_eos": True, "return_token_ids": True, "allowed_token_ids": allowed})
    for choice in sampled.choices:
        assert len(choice.token_ids) == NEW and set(choice.token_ids) <= set(allowed)
    for value, param in [([], "allowed_token_ids"), ([10**6], "allowed_token_ids"), ([""], "bad_words")]:
        key = param
        resp = httpx.post(server.v1 + "/completions", timeout=60,
                          json={"model": TEST_MODEL, "prompt": "hi", "max_tokens": 1, key: value})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    server.assert_no_leaks()


# ---- truncate_prompt_tokens --------------------------------------------------------------------


def test_truncate_prompt_tokens(server: LiveServer, client: openai.OpenAI, tokenizer) -> None:
    kept = tokenizer(PROMPT).input_ids[-6:]
    out = _complete(client, PROMPT, truncate_prompt_tokens=6)
    assert out.usage.prompt_tokens == 6 == len(kept)
    assert out.choices[0].token_ids == _hf_greedy(server.model_path, kept, NEW)
    echoed = client.completions.create(model=TEST_MODEL, prompt=PROMPT, max_tokens=1, echo=True,
                                       extra_body={"truncate_prompt_tokens": 6})
    assert echoed.choices[0].text.startswith(tokenizer.decode(kept)) and echoed.usage.prompt_tokens == 6
    chat_kept = _chat_ids(tokenizer, MESSAGES)[-9:]
    chat = client.chat.completions.create(
        model=TEST_MODEL, messages=MESSAGES, max_tokens=NEW, temperature=0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "truncate_prompt_tokens": 9})
    assert chat.usage.prompt_tokens == 9
    assert chat.choices[0].token_ids == _hf_greedy(server.model_path, chat_kept, NEW)
    # A prompt shorter than the limit is kept whole.
    assert _complete(client, PROMPT, truncate_prompt_tokens=500).usage.prompt_tokens == len(tokenizer(PROMPT).input_ids)
    resp = httpx.post(server.v1 + "/completions", timeout=60,
                      json={"model": TEST_MODEL, "prompt": "hi", "max_tokens": 1, "truncate_prompt_tokens": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "truncate_prompt_tokens", resp.text
    server.assert_no_leaks()


# ---- cache_salt --------------------------------------------------------------------------------


def test_cache_salt_isolates_the_prefix_cache(server: LiveServer, client: openai.OpenAI, tokenizer) -> None:
    block_size = server.ctx.engine.call_in_engine_thread(lambda e: e.config.cache.block_size)
    prompt = " ".join(f"salted{i}" for i in range(40))
    hit = (len(tokenizer(prompt).input_ids) - 1) // block_size * block_size
    assert hit > 0

    def cached(**salt: str) -> int:
        out = client.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=2, extra_body=salt)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") == hit
    assert cached(cache_salt="bob") == 0
    assert cached() == 0  # no salt is a salt of its own
    assert cached() == hit and cached(cache_salt="bob") == hit

    messages = [{"role": "user", "content": prompt + " chat"}]

    def chat_cached(salt: str) -> tuple[int, int]:
        out = client.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=2,
                                             extra_body={"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    assert chat_cached("alice")[0] == 0 and chat_cached("bob")[0] == 0
    again, num_prompt = chat_cached("alice")
    assert again == (num_prompt - 1) // block_size * block_size > 0
    resp = httpx.post(server.v1 + "/completions", timeout=60,
                      json={"model": TEST_MODEL, "prompt": "hi", "max_tokens": 1, "cache_salt": ""})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "cache_salt", resp.text
    server.assert_no_leaks()


def test_other_routes_still_refuse_these_fields(server: LiveServer) -> None:
    """Served on completions and chat only: /v1/responses names the field in its 400."""
    for field, value in [("bad_words", ["x"]), ("cache_salt", "s"), ("use_beam_search", True)]:
        resp = httpx.post(server.v1 + "/responses", timeout=60,
                          json={"model": TEST_MODEL, "input": "hi", "max_output_tokens": 2, field: value})
        assert resp.status_code == 400 and field in resp.text, resp.text
    server.assert_no_leaks()
