"""What agent clients send (issue #37.1 and #37.7): the field rule, null as absent, 4xx logged.

Through the official `openai` client (`extra_body=` adds the fields it has no argument for)
against a live server on 127.0.0.1; one default server and one --strict-request-fields.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pagedserve.server.request_fields import REFUSED

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

MSG = [{"role": "user", "content": "hi"}]
# What LiteLLM, LangChain, the Agents SDK and Codex-style clients put in a chat request.
AGENT_FIELDS = {
    "metadata": {"session": "abc"}, "store": False, "user": "u-1", "service_tier": "auto",
    "safety_identifier": "hash", "parallel_tool_calls": True, "prompt_cache_key": "k",
    "prediction": {"type": "content", "content": "hi"},
}
AGENT_MESSAGES = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello", "reasoning_content": "they greet me", "refusal": None},
    {"role": "user", "content": "again"},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}}]
# OpenAI's and vLLM's fields that would change the output and are not implemented: a 400 naming each.
REFUSED_CHAT = [
    ("audio", {"voice": "alloy", "format": "wav"}), ("modalities", ["text", "audio"]),
    ("web_search_options", {}), ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
    ("verbosity", "low"), ("logits_processors", ["x"]), ("echo", True), ("chat_template", "{{ x }}"),
]
# OpenAI's nullable fields, sent as null: the same as leaving them out.
NULLS = ["n", "presence_penalty", "frequency_penalty", "logprobs", "parallel_tool_calls", "stream", "prediction",
         "audio", "web_search_options", "functions", "function_call", "stop", "seed", "top_logprobs",
         "stream_options", "tools", "tool_choice", "response_format", "logit_bias", "user", "modalities"]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)


def _chat(client: openai.OpenAI, **kwargs: object):
    kwargs.setdefault("messages", MSG)
    kwargs.setdefault("temperature", 0.0)
    return client.chat.completions.create(model=TEST_MODEL, max_tokens=4, **kwargs)  # type: ignore[call-overload]


def test_agent_fields_are_accepted(client: openai.OpenAI) -> None:
    """#37.1 (b): fields that describe the request, a tool's strict, replayed reasoning: a 200,
    the same text as without them."""
    plain = _chat(client).choices[0].message.content
    with_fields = _chat(client, messages=AGENT_MESSAGES[:1], extra_body=AGENT_FIELDS)
    assert with_fields.choices[0].message.content == plain
    assert _chat(client, messages=AGENT_MESSAGES).choices[0].finish_reason == "length"
    assert _chat(client, tools=TOOLS, tool_choice="none").choices[0].message.tool_calls is None


@pytest.mark.parametrize(("field", "value"), REFUSED_CHAT, ids=[f for f, _ in REFUSED_CHAT])
def test_unimplemented_output_field_is_400_naming_it(client: openai.OpenAI, field: str, value: object) -> None:
    """#37.1 (a): ignoring it would serve something other than what was asked."""
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, extra_body={field: value})
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == field and "not supported" in error["message"], error


def test_refused_fields_at_their_harmless_value_are_accepted(client: openai.OpenAI) -> None:
    _chat(client, extra_body={"modalities": ["text"], "echo": False, "use_beam_search": False})
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2, suffix="x")


def test_unknown_field_is_accepted_and_logged_once(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    """#37.1 (c): any other field, top level or nested, is a 200 and one INFO line per name."""
    caplog.set_level(logging.INFO, logger="pagedserve.server.request_fields")
    messages = [{"role": "user", "content": "hi", "x_nested_hint": 1}]
    for _ in range(2):
        _chat(client, messages=messages, extra_body={"x_client_hint": {"a": 1}})
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedserve.server.request_fields"]
    assert sum("'x_client_hint'" in line for line in lines) == 1, lines
    assert sum("'messages.x_nested_hint'" in line for line in lines) == 1, lines


@pytest.mark.parametrize("field", NULLS)
def test_null_is_absent(server: LiveServer, field: str) -> None:
    """#37.7: OpenAI's API allows null for each optional field; null means "not given"."""
    body = {"model": TEST_MODEL, "messages": MSG, "max_tokens": 4, "temperature": 0.0}
    plain = httpx.post(server.v1 + "/chat/completions", json=body, timeout=60)
    resp = httpx.post(server.v1 + "/chat/completions", json={**body, field: None}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"] == plain.json()["choices"]


def test_null_on_completions_keeps_vllm_meanings(server: LiveServer) -> None:
    """A field whose type admits null keeps it: `max_tokens: null` is no limit (vLLM), not 16."""
    body = {"model": TEST_MODEL, "prompt": "hi", "temperature": 0.0, "ignore_eos": True, "n": None, "echo": None,
            "logprobs": None, "best_of": None, "stream": None, "presence_penalty": None}
    resp = httpx.post(server.v1 + "/completions", json={**body, "max_tokens": 20}, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 20, resp.text


def test_each_4xx_is_logged_with_message_and_field(client: openai.OpenAI, caplog: pytest.LogCaptureFixture) -> None:
    """#37.7: the log says why a client failed, not only `400`."""
    caplog.set_level(logging.INFO, logger="pagedserve.server.errors")
    with pytest.raises(openai.BadRequestError):
        _chat(client, temperature=-1.0)
    with pytest.raises(openai.BadRequestError):
        _chat(client, extra_body={"suffix": "x"})
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSG, max_tokens=2)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedserve.server.errors" and r.levelno == logging.INFO]
    assert any("-> 400 (param=temperature)" in line and "temperature" in line.split(": ", 1)[1] for line in lines), lines
    assert any("-> 400 (param=suffix)" in line and "not supported" in line for line in lines), lines
    assert any("-> 404 (param=model)" in line and "no-such-model" in line for line in lines), lines


def test_strict_request_fields_refuses_unknown_fields_only() -> None:
    """--strict-request-fields: an unknown field is a 400 naming it; the harmless ones still pass."""
    with running_server([TEST_MODEL, *SERVE_ARGS, "--strict-request-fields"]) as live:
        client = openai.OpenAI(base_url=live.v1, api_key="EMPTY", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="x_client_hint") as info:
            _chat(client, extra_body={"x_client_hint": 1})
        assert isinstance(info.value.body, dict) and info.value.body["param"] == "x_client_hint"
        with pytest.raises(openai.BadRequestError, match="messages.0.x_nested_hint"):
            _chat(client, messages=[{"role": "user", "content": "hi", "x_nested_hint": 1}])
        _chat(client, messages=AGENT_MESSAGES, tools=TOOLS, tool_choice="none", extra_body=AGENT_FIELDS)


def test_compatibility_note_lists_every_refused_field() -> None:
    """The note tells users every field still refused (issue #37, "done when")."""
    note = (Path(__file__).parents[2] / "docs" / "vllm_compatibility.md").read_text()
    section = note.split("## Request fields", 1)[1]
    missing = [field for field in REFUSED if f"`{field}`" not in section]
    assert not missing, missing
