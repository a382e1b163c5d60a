"""Issue #37.6, the fields vLLM users expect over HTTP: --max-logprobs,
stream_options.continuous_usage_stats and prompt_tokens_details.cached_tokens
(--enable-prompt-tokens-details), through the real openai client against a live server.

Oracles: the client's own types and errors; token counts against the Hugging Face
tokenizer (the prompt) and the chunks' own tokens; cached tokens against the prefix cache's
block arithmetic (a repeated prompt hits every full block but the last token's).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from transformers import AutoTokenizer

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

MESSAGES = [{"role": "user", "content": "Count to ten"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--max-logprobs", "3",
                                 "--enable-prompt-tokens-details"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)



def test_max_logprobs(server: LiveServer, client: openai.OpenAI) -> None:
    out = client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2, logprobs=3)
    # vLLM adds the chosen token to its top logprobs when it is not among them.
    assert all(3 <= len(top) <= 4 for top in out.choices[0].logprobs.top_logprobs)
    calls = [
        ("logprobs", lambda: client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2, logprobs=4)),
        ("prompt_logprobs", lambda: client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2,
                                                              extra_body={"prompt_logprobs": 5})),
        ("top_logprobs", lambda: client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, max_tokens=2,
                                                                logprobs=True, top_logprobs=4)),
    ]
    for field, call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["param"] == field and "--max-logprobs" in info.value.body["message"]
    chat = client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, max_tokens=2, logprobs=True,
                                          top_logprobs=3)
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)
    server.assert_no_leaks()


def _tokens(choice: Any) -> int:
    # vLLM's return_token_ids: each chunk's own token ids, counted independently of usage.
    return len(getattr(choice, "token_ids", None) or [])


def test_continuous_usage_stats_chat(server: LiveServer, client: openai.OpenAI) -> None:
    prompt_tokens = len(AutoTokenizer.from_pretrained(server.model_path).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    stream = client.chat.completions.create(
        model=TEST_MODEL, messages=MESSAGES, max_tokens=7, n=2, temperature=1.0, seed=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"return_token_ids": True})
    seen = [0, 0]
    chunks = list(stream)
    for chunk in chunks[:-1]:
        assert chunk.usage is not None and chunk.usage.prompt_tokens == prompt_tokens
        for choice in chunk.choices:
            seen[choice.index] += _tokens(choice)
            assert chunk.usage.completion_tokens == seen[choice.index]
            assert chunk.usage.total_tokens == prompt_tokens + seen[choice.index]
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 14 == sum(seen)
    server.assert_no_leaks()


def test_continuous_usage_stats_completions(server: LiveServer, client: openai.OpenAI) -> None:
    prompts = ["one two", "three four five six"]
    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    lengths = [len(tokenizer(p).input_ids) for p in prompts]
    stream = client.completions.create(
        model=TEST_MODEL, prompt=prompts, max_tokens=5, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"return_token_ids": True})
    seen = [0, 0]
    chunks = list(stream)
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        seen[choice.index] += _tokens(choice)
        assert chunk.usage.prompt_tokens == lengths[choice.index]
        assert chunk.usage.completion_tokens == seen[choice.index]
    assert chunks[-1].usage.prompt_tokens == sum(lengths) and chunks[-1].usage.completion_tokens == 10
    # Without continuous_usage_stats, only the last chunk has usage.
    plain = list(client.completions.create(model=TEST_MODEL, prompt=prompts[0], max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
    assert all(chunk.usage is None for chunk in plain[:-1]) and plain[-1].usage.completion_tokens == 3
    server.assert_no_leaks()


def test_cached_tokens(server: LiveServer, client: openai.OpenAI) -> None:
    block_size = server.ctx.engine.call_in_engine_thread(lambda e: e.config.cache.block_size)
    prompt = " ".join(f"w{i}" for i in range(60))
    num_prompt = len(AutoTokenizer.from_pretrained(server.model_path)(prompt).input_ids)
    # A repeated prompt finds every full block but the one holding its last token (which
    # must be computed to sample): vLLM's arithmetic.
    hit = (num_prompt - 1) // block_size * block_size
    assert hit > 0
    first = client.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens == num_prompt and first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == hit
    streamed = list(client.completions.create(model=TEST_MODEL, prompt=prompt, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == hit
    messages = [{"role": "user", "content": prompt}]
    chat = [client.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=2) for _ in range(2)]
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    assert chat[1].usage.prompt_tokens_details.cached_tokens == (chat[1].usage.prompt_tokens - 1) // block_size * block_size
    chat_stream = list(client.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=2, stream=True,
                                                      stream_options={"include_usage": True}))
    assert chat_stream[-1].usage.prompt_tokens_details.cached_tokens == chat[1].usage.prompt_tokens_details.cached_tokens
    server.assert_no_leaks()
