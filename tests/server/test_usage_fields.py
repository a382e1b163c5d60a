"""Issue #37.6, the fields vLLM users expect over HTTP: --max-logprobs,
stream_options.continuous_usage_stats and prompt_tokens_details.cached_tokens
(--enable-prompt-tokens-details), through the real openai client against a live server.

Oracles: the client's own types and errors; token counts against the Hugging Face
tokenizer (the prompt) and the chunks' own tokens; cached tokens against the prefix cache's
block arithmetic (a repeated prompt hits every full block but the last token's).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

MESSAGES = [{"role": "user", "content": "Count to ten"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--max-logprobs", "3"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)


def _no_leak(server: LiveServer) -> None:
    server.wait_idle()
    server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


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
    _no_leak(server)
