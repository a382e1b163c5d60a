"""n / best_of over HTTP are the engine's: one engine request whose samples share the prompt's
KV blocks (issue #15.1), choices indexed as OpenAI does, streamed or not.

The server runs without prefix caching, so forking is the only way samples can share blocks:
8 independent requests (the old fan-out) would hold 8 copies of a 1,000-token prompt.
"""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

PROMPT_LEN = 1000
N = 8


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--no-enable-prefix-caching"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)


def _prompt() -> list[int]:
    rng = random.Random(15)
    return [rng.randrange(3, 1000) for _ in range(PROMPT_LEN)]


class _PeakBlocks:
    """A step hook (run in the engine thread): the most KV blocks in use after any step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.peak = 0
        self.lock = threading.Lock()

    def __call__(self, _timings) -> None:
        used = self.engine.get_stats().scheduler.kv_blocks_used
        with self.lock:
            self.peak = max(self.peak, used)


def test_n8_uses_the_prompt_blocks_once(server: LiveServer, client: openai.OpenAI) -> None:
    async_engine = server.ctx.engine
    block_size = async_engine.call_in_engine_thread(lambda e: e.config.cache.block_size)
    hook = _PeakBlocks(async_engine.engine)
    async_engine.call_in_engine_thread(lambda e: e.add_step_hook(hook))
    try:
        out = client.completions.create(
            model=TEST_MODEL, prompt=_prompt(), n=N, max_tokens=8, temperature=1.0, seed=5,
            extra_body={"ignore_eos": True},
        )
    finally:
        async_engine.call_in_engine_thread(lambda e: e.remove_step_hook(hook))
    assert [c.index for c in out.choices] == list(range(N))
    assert len({c.text for c in out.choices}) > 1
    assert out.usage.prompt_tokens == PROMPT_LEN  # the prompt counts once, as in vLLM
    assert out.usage.completion_tokens == N * 8
    # The full prompt blocks are held once; each sample owns only its copy of the partial
    # last block (8 outputs fit in it). Eight separate requests would need 8 * 63.
    prompt_blocks = math.ceil(PROMPT_LEN / block_size)
    assert PROMPT_LEN % block_size and PROMPT_LEN % block_size + 8 <= block_size  # the layout assumed
    assert hook.peak == PROMPT_LEN // block_size + N, hook.peak
    assert hook.peak < 2 * prompt_blocks
    server.wait_idle()


def test_n8_streamed_chunks_carry_their_choice_index(server: LiveServer, client: openai.OpenAI) -> None:
    kwargs = dict(model=TEST_MODEL, prompt=_prompt()[:40], n=N, max_tokens=6, temperature=1.0, seed=9,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    texts = [""] * N
    finished = [None] * N
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert texts == [c.text for c in full.choices]  # seeded: the same samples, streamed or not
    assert finished == ["length"] * N
    assert usage == full.usage and usage.prompt_tokens == 40


def test_chat_n_streamed_and_not(server: LiveServer, client: openai.OpenAI) -> None:
    kwargs = dict(model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=5,
                  temperature=1.0, seed=4, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = ["", "", ""]
    roles = set()
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.role:
                roles.add(choice.index)
    assert roles == {0, 1, 2}
    assert texts == [c.message.content for c in full.choices]
    assert full.usage.completion_tokens == 15


def test_best_of_streamed_is_400(server: LiveServer) -> None:
    resp = httpx.post(server.v1 + "/completions", json={
        "model": TEST_MODEL, "prompt": "hi", "n": 1, "best_of": 2, "stream": True, "temperature": 1.0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "best_of"
