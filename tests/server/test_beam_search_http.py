"""use_beam_search over HTTP (issue 37.6) equals transformers' generate(num_beams=n), token for token.

Through the real openai client (vLLM's fields in extra_body): n is the beam width, the
choices are the n best beams, best first, and length_penalty / ignore_eos reach the search.
Fields the search does not apply are 400s naming them.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from hf_reference import hf_beams, make_prompts
from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

MAX_TOKENS = 12
# Seeded prompts whose transformers beams end on EOS (tests/engine/test_beam_search.py's scan).
_EOS_CANDIDATES = {"lengths": [3, 6, 9, 12] * 25, "seed": 33, "indices": [63, 80, 81, 84]}


def hf_beam_tokens(path: str, prompt: list[int], width: int, length_penalty: float, max_tokens: int,
                   ignore_eos: bool) -> list[list[int]]:
    """transformers' beams (generated tokens), best first."""
    return [tokens for tokens, _ in hf_beams(path, prompt, width, length_penalty, max_tokens, ignore_eos)]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--max-model-len", "256"]) as live:
        yield live


def _client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)


@pytest.mark.parametrize(("width", "length_penalty"), [(2, 1.0), (3, 0.5)])
def test_completions_beams_equal_transformers(server: LiveServer, width: int, length_penalty: float) -> None:
    prompts = make_prompts(server.ctx.engine.engine.vocab_size, [5, 17], seed=21)  # type: ignore[attr-defined]
    reply = _client(server).completions.create(
        model=TEST_MODEL, prompt=prompts, n=width, max_tokens=MAX_TOKENS,
        extra_body={"use_beam_search": True, "length_penalty": length_penalty, "ignore_eos": True,
                    "early_stopping": True, "return_token_ids": True})
    assert [c.index for c in reply.choices] == list(range(2 * width))
    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    for k, prompt in enumerate(prompts):
        expected = hf_beam_tokens(server.model_path, prompt, width, length_penalty, MAX_TOKENS, ignore_eos=True)
        ours = reply.choices[k * width:(k + 1) * width]
        assert [c.token_ids for c in ours] == expected  # type: ignore[attr-defined]
        assert [c.text for c in ours] == [tokenizer.decode(t, skip_special_tokens=True) for t in expected]
        assert all(c.finish_reason == "length" for c in ours)
    assert reply.usage is not None and reply.usage.completion_tokens == 2 * width * MAX_TOKENS
    assert reply.usage.prompt_tokens == sum(len(p) for p in prompts)
    server.assert_no_leaks()


def test_completions_beams_that_end_on_eos(server: LiveServer) -> None:
    """Prompts whose transformers beams finish on EOS: finish_reason stop, the same beams."""
    engine = server.ctx.engine.engine  # type: ignore[attr-defined]
    candidates = make_prompts(engine.vocab_size, _EOS_CANDIDATES["lengths"], seed=_EOS_CANDIDATES["seed"])
    prompt = candidates[_EOS_CANDIDATES["indices"][0]]  # type: ignore[index]
    expected = hf_beam_tokens(server.model_path, prompt, 2, 1.0, 40, ignore_eos=False)
    reply = _client(server).completions.create(
        model=TEST_MODEL, prompt=prompt, n=2, max_tokens=40, extra_body={"use_beam_search": True, "return_token_ids": True})
    assert [c.token_ids for c in reply.choices] == expected  # type: ignore[attr-defined]
    eos = engine.eos_token_id
    assert [c.finish_reason for c in reply.choices] == ["stop" if t[-1] == eos else "length" for t in expected]
    server.assert_no_leaks()


def test_chat_beams_equal_transformers(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Tell me about beams."}]
    tokenizer = AutoTokenizer.from_pretrained(server.model_path)
    prompt: list[int] = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)  # type: ignore[assignment]
    reply = _client(server).chat.completions.create(
        model=TEST_MODEL, messages=messages, n=2, max_completion_tokens=MAX_TOKENS,  # type: ignore[arg-type]
        extra_body={"use_beam_search": True, "ignore_eos": True})
    expected = hf_beam_tokens(server.model_path, prompt, 2, 1.0, MAX_TOKENS, ignore_eos=True)
    assert [c.message.content for c in reply.choices] == [tokenizer.decode(t, skip_special_tokens=True)
                                                         for t in expected]
    assert reply.usage is not None and reply.usage.prompt_tokens == len(prompt)
    server.assert_no_leaks()


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/completions", "stream", True), ("/completions", "logprobs", 2), ("/completions", "stop", ["x"]),
    ("/completions", "early_stopping", False), ("/completions", "n", 11), ("/completions", "best_of", 3),
    ("/chat/completions", "presence_penalty", 0.5), ("/chat/completions", "response_format", {"type": "json_object"}),
])
def test_fields_the_search_does_not_apply_are_400s(server: LiveServer, path: str, field: str, value: object) -> None:
    base = {"prompt": "hi"} if path == "/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body = {"model": TEST_MODEL, "max_tokens": 4, "n": 2, "use_beam_search": True, **base, field: value}
    resp = httpx.post(server.v1 + path, json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field, resp.text
    server.assert_no_leaks()


def test_length_penalty_without_beam_search_is_400(server: LiveServer) -> None:
    resp = httpx.post(server.v1 + "/completions", timeout=60,
                      json={"model": TEST_MODEL, "prompt": "hi", "max_tokens": 2, "length_penalty": 0.5})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "length_penalty", resp.text
    server.assert_no_leaks()


def test_a_client_that_leaves_aborts_the_search(server: LiveServer) -> None:
    """The handler notices the disconnect and aborts the beams: their blocks go back to the pool."""
    body = {"model": TEST_MODEL, "prompt": [1, 2], "n": 10, "max_tokens": 250, "ignore_eos": True,
            "use_beam_search": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.v1 + "/completions", json=body, timeout=0.05)
    server.wait_idle(timeout_s=30)
    server.assert_no_leaks()
    searches = server.ctx.engine.call_in_engine_thread(  # type: ignore[attr-defined]
        lambda e: (dict(e.beam_search.groups), dict(e.beam_search.results)))
    assert searches == ({}, {})  # nothing left behind, finished or not
    done = httpx.post(server.v1 + "/completions", json={**body, "max_tokens": 2}, timeout=60)  # still serving
    assert done.status_code == 200 and len(done.json()["choices"]) == 10, done.text
    server.assert_no_leaks()
