"""/v1/messages and /v1/messages/count_tokens (issue #37.5) through the real anthropic client,
streamed and whole, against a live server.

Oracles: the anthropic client parses every message and stream event into its own types
(its stream helper accumulates text and tool input from the deltas); the prompt built from
system, text, tool_use and tool_result blocks is checked by its token count against the
Hugging Face tokenizer's rendering of the chat it must equal; forced tool calls are
checked with jsonschema; errors by the client's own exception classes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer

from server_fixtures import (
    SERVE_ARGS,
    TEST_MODEL,
    TOOL_ARGS,
    LiveServer,
    hf_prompt_tokens,
    running_server,
)

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER_SCHEMA}
KEY = "sk-ant-test"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, *TOOL_ARGS]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(server: LiveServer) -> Any:
    return AutoTokenizer.from_pretrained(server.model_path)



def _sampling(**fields: Any) -> dict[str, Any]:
    # This anthropic client (2.x) no longer declares temperature / top_p / top_k: sent as the
    # API's body fields through extra_body.
    return {"extra_body": fields}



def _greedy_chat(server: LiveServer, messages: list[dict[str, Any]], max_tokens: int) -> str:
    body = {"model": TEST_MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]["content"]


def test_text_message_whole(server: LiveServer, client: anthropic.Anthropic, hf_tokenizer: Any) -> None:
    msg = client.messages.create(model=TEST_MODEL, max_tokens=6, system="Be brief.", **_sampling(temperature=0.0),
                                 messages=[{"role": "user", "content": "Say hi"}])
    assert msg.type == "message" and msg.role == "assistant" and msg.model == TEST_MODEL
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert [block.type for block in msg.content] == ["text"]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert msg.usage.input_tokens == hf_prompt_tokens(hf_tokenizer, chat) and msg.usage.output_tokens == 6
    assert msg.content[0].text == _greedy_chat(server, chat, 6)
    # top_k=1 samples the most likely token: the greedy text at any temperature.
    top1 = client.messages.create(model=TEST_MODEL, max_tokens=6, system="Be brief.",
                                  **_sampling(temperature=1.0, top_k=1, top_p=0.9), messages=[{"role": "user", "content": "Say hi"}])
    assert top1.content[0].text == msg.content[0].text
    server.assert_no_leaks()


def test_tool_use_and_tool_result_blocks(server: LiveServer, client: anthropic.Anthropic, hf_tokenizer: Any) -> None:
    messages: list[Any] = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "22 C"}]},
            {"type": "text", "text": "Thanks"}]},
    ]
    kwargs: dict[str, Any] = {"model": TEST_MODEL, "system": [{"type": "text", "text": "Use tools."}],
                              "messages": messages}
    msg = client.messages.create(max_tokens=3, **_sampling(temperature=0.0), **kwargs)
    chat = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "toolu_1", "type": "function",
                                                                          "function": {"name": "get_weather",
                                                                                       "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "22 C"},
        {"role": "user", "content": "Thanks"},
    ]
    # No tools: how a template shows them is the chat route's business (tested there).
    expected = hf_prompt_tokens(hf_tokenizer, chat)
    assert msg.usage.input_tokens == expected
    assert client.messages.count_tokens(**kwargs).input_tokens == expected
    server.assert_no_leaks()


@pytest.mark.parametrize("tool_choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use(server: LiveServer, client: anthropic.Anthropic, tool_choice: dict) -> None:
    msg = client.messages.create(model=TEST_MODEL, max_tokens=200, tools=[WEATHER], **_sampling(temperature=1.0),
                                 tool_choice={**tool_choice, "disable_parallel_tool_use": True},
                                 messages=[{"role": "user", "content": "Weather in Paris?"}])
    assert msg.stop_reason == "tool_use"
    calls = [block for block in msg.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    jsonschema.validate(calls[0].input, WEATHER_SCHEMA)
    server.assert_no_leaks()


def test_stop_sequences(server: LiveServer, client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": TEST_MODEL, "max_tokens": 20, **_sampling(temperature=0.0),
                              "messages": [{"role": "user", "content": "Count"}]}
    text = client.messages.create(**kwargs).content[0].text
    stop = text[6:9]
    assert stop.strip() and len(text) > 9
    msg = client.messages.create(stop_sequences=["never-there", stop], **kwargs)
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[: text.index(stop)]
    with client.messages.stream(stop_sequences=["never-there", stop], **kwargs) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    assert final.content[0].text == msg.content[0].text
    server.assert_no_leaks()


def test_stream_text(server: LiveServer, client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": TEST_MODEL, "max_tokens": 8, **_sampling(temperature=0.0), "system": "Be brief.",
                              "messages": [{"role": "user", "content": "Say hi"}]}
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    whole = client.messages.create(**kwargs)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    for kind in ("content_block_start", "content_block_delta", "content_block_stop", "message_delta"):
        assert kind in kinds
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens == whole.usage.input_tokens
    server.assert_no_leaks()


def test_stream_tool_use(server: LiveServer, client: anthropic.Anthropic) -> None:
    with client.messages.stream(model=TEST_MODEL, max_tokens=200, tools=[WEATHER], **_sampling(temperature=1.0),
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather?"}]) as stream:
        deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas
    assert final.stop_reason == "tool_use"
    calls = [block for block in final.content if block.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(calls[0].input, WEATHER_SCHEMA)
    server.assert_no_leaks()


@pytest.mark.parametrize(("patch", "field"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 20000}, "max_tokens"),  # past the context (the client refuses 100k unstreamed)
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice"),
    ({"stop_sequences": [""]}, "stop_sequences"),
])
def test_bad_input_is_a_400_in_anthropic_shape(server: LiveServer, client: anthropic.Anthropic, patch: dict,
                                               field: str) -> None:
    body = {"model": TEST_MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(**body)
    error = info.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert error["error"]["message"].startswith(field), error
    server.assert_no_leaks()


def test_unknown_model_is_404_in_anthropic_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(model="claude-nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=[{"role": "user", "content": "hi"}])


def test_x_api_key_with_api_key() -> None:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--api-key", KEY]) as live:
        good = anthropic.Anthropic(base_url=live.base_url, api_key=KEY, max_retries=0)
        msg = good.messages.create(model=TEST_MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert msg.usage.output_tokens == 2
        assert good.messages.count_tokens(model=TEST_MODEL,
                                          messages=[{"role": "user", "content": "hi"}]).input_tokens > 0
        bad = anthropic.Anthropic(base_url=live.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(model=TEST_MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert info.value.body["error"]["type"] == "authentication_error"
        resp = httpx.post(live.v1 + "/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert resp.status_code == 401 and json.loads(resp.text)["type"] == "error"
        live.assert_no_leaks()


def test_thinking_block(server: LiveServer, client: anthropic.Anthropic) -> None:
    """--reasoning-parser deepseek_r1: an output with no </think> is all reasoning, so the
    random model's greedy text (the plain server's) is the thinking block's text."""
    kwargs: dict[str, Any] = {"model": TEST_MODEL, "max_tokens": 6, "messages": [{"role": "user", "content": "Think"}],
                              **_sampling(temperature=0.0)}
    plain = client.messages.create(**kwargs).content[0].text
    with running_server([TEST_MODEL, *SERVE_ARGS, "--reasoning-parser", "deepseek_r1"]) as live:
        thinking = anthropic.Anthropic(base_url=live.base_url, api_key="EMPTY", max_retries=0)
        whole = thinking.messages.create(**kwargs)
        with thinking.messages.stream(**kwargs) as stream:
            deltas = [event.delta.type for event in stream if event.type == "content_block_delta"]
            final = stream.get_final_message()
        for msg in (whole, final):
            assert [block.type for block in msg.content] == ["thinking"]
            assert msg.content[0].thinking == plain and msg.stop_reason == "max_tokens"
        assert set(deltas) == {"thinking_delta"}
        live.assert_no_leaks()


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_aborts_the_request(server: LiveServer, stream: bool) -> None:
    """A client that leaves mid-generation (streamed or not) aborts its engine request."""
    before = server.abort_count()
    body = {"model": TEST_MODEL, "max_tokens": 1900, "stream": stream, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Write a long story"}]}
    with httpx.Client(timeout=httpx.Timeout(30, read=None if stream else 0.5)) as http:
        if stream:
            with http.stream("POST", server.v1 + "/messages", json=body) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if "content_block_delta" in line)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.v1 + "/messages", json=body)
    deadline = time.monotonic() + 5
    while server.abort_count() <= before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    server.assert_no_leaks()
