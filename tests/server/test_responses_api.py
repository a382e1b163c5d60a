"""/v1/responses (issue #37.4) through the real openai client's `responses.create` and
`responses.stream` against a live server.

Oracles: the openai client parses every response and event into its own types (its
stream helper checks the event order and item identities); the prompt the server built
from instructions, items and stored history is checked by its token count against the
Hugging Face tokenizer's own rendering of the chat it must equal; outputs under a JSON
schema or a forced tool call are checked with jsonschema.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from server_fixtures import (
    SERVE_ARGS,
    TEST_MODEL,
    TOOL_ARGS,
    LiveServer,
    hf_prompt_tokens,
    running_server,
)

WEATHER = {
    "type": "function", "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False},
}
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"type": "string", "maxLength": 5}},
          "required": ["id", "tag"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, *TOOL_ARGS, "--max-stored-responses", "2"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)


@pytest.fixture(scope="module")
def hf_tokenizer(server: LiveServer) -> Any:
    return AutoTokenizer.from_pretrained(server.model_path)




def test_string_input_with_instructions(server: LiveServer, client: openai.OpenAI, hf_tokenizer: Any) -> None:
    resp = client.responses.create(model=TEST_MODEL, input="Say hi", instructions="Be brief.", max_output_tokens=5,
                                   temperature=0.0, store=False)
    assert resp.object == "response" and resp.model == TEST_MODEL
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in resp.output] == ["message"] and resp.output_text
    expected = hf_prompt_tokens(hf_tokenizer, [{"role": "system", "content": "Be brief."},
                                                {"role": "user", "content": "Say hi"}])
    assert resp.usage.input_tokens == expected
    assert resp.usage.output_tokens == 5 and resp.usage.total_tokens == expected + 5
    # Greedy: the same text as the chat route gives for the same conversation.
    chat = client.chat.completions.create(model=TEST_MODEL, max_tokens=5, temperature=0.0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert resp.output_text == chat.choices[0].message.content
    server.assert_no_leaks()


def test_item_list_input_and_function_call_output(server: LiveServer, client: openai.OpenAI,
                                                  hf_tokenizer: Any) -> None:
    items: list[Any] = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C, sunny"},
    ]
    # No tools: how a template shows them is the chat route's business (tested there).
    resp = client.responses.create(model=TEST_MODEL, input=items, max_output_tokens=3, temperature=0.0, store=False)
    expected_messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    ]
    assert resp.usage.input_tokens == hf_prompt_tokens(hf_tokenizer, expected_messages)
    server.assert_no_leaks()


def test_forced_function_call(server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=TEST_MODEL, input="Weather in Paris?", tools=[WEATHER],
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                   temperature=1.0, store=False)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    server.assert_no_leaks()


def test_text_format_json_schema(server: LiveServer, client: openai.OpenAI) -> None:
    resp = client.responses.create(model=TEST_MODEL, input="An id and a tag", max_output_tokens=60, temperature=1.0,
                                   store=False, text={"format": {"type": "json_schema", "name": "t", "schema": SCHEMA,
                                                                 "strict": True}})
    jsonschema.validate(json.loads(resp.output_text), SCHEMA)
    assert resp.text.format.type == "json_schema"
    server.assert_no_leaks()


class Tagged(BaseModel):
    id: int = Field(ge=0, le=99)
    tag: str = Field(max_length=5)


def test_parse_with_text_format_model(server: LiveServer, client: openai.OpenAI) -> None:
    """The client's own structured-output helpers: text_format from a pydantic model, whole and streamed."""
    whole = client.responses.parse(model=TEST_MODEL, input="An id and a tag", text_format=Tagged,
                                   max_output_tokens=60, temperature=1.0, store=False)
    assert isinstance(whole.output_parsed, Tagged)
    with client.responses.stream(model=TEST_MODEL, input="An id and a tag", text_format=Tagged,
                                 max_output_tokens=60, temperature=1.0, store=False) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Tagged)
    server.assert_no_leaks()


def test_stream_events_and_final_response(server: LiveServer, client: openai.OpenAI) -> None:
    with client.responses.stream(model=TEST_MODEL, input="Say hi", max_output_tokens=8, temperature=0.0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for kind in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert kind in kinds
    whole = client.responses.create(model=TEST_MODEL, input="Say hi", max_output_tokens=8, temperature=0.0,
                                    store=False)
    assert final.output_text == whole.output_text and final.usage.output_tokens == 8
    assert final.usage.input_tokens == whole.usage.input_tokens
    # The streamed response was stored: retrievable, and a follow-up can continue it.
    assert client.responses.retrieve(final.id).output_text == final.output_text
    server.assert_no_leaks()


def test_stream_function_call_events(server: LiveServer, client: openai.OpenAI) -> None:
    with client.responses.stream(model=TEST_MODEL, input="Weather?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=200, temperature=1.0,
                                 store=False) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
    server.assert_no_leaks()


def test_previous_response_id_continues_the_conversation(server: LiveServer, client: openai.OpenAI,
                                                         hf_tokenizer: Any) -> None:
    first = client.responses.create(model=TEST_MODEL, input="Hello", max_output_tokens=4, temperature=0.0,
                                    instructions="not carried over")
    second = client.responses.create(model=TEST_MODEL, input="And again", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0.0)
    assert second.previous_response_id == first.id
    expected = hf_prompt_tokens(hf_tokenizer, [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And again"}])
    assert second.usage.input_tokens == expected
    server.assert_no_leaks()


def test_store_is_bounded_oldest_first_and_unknown_id_is_404(server: LiveServer, client: openai.OpenAI) -> None:
    ids = [client.responses.create(model=TEST_MODEL, input=f"n{i}", max_output_tokens=1).id for i in range(3)]
    # --max-stored-responses 2: the first is gone, the last two remain.
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=TEST_MODEL, input="x", previous_response_id=ids[0], max_output_tokens=1)
    assert info.value.body["param"] == "previous_response_id"
    for kept in ids[1:]:
        assert client.responses.retrieve(kept).id == kept
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    unstored = client.responses.create(model=TEST_MODEL, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    server.assert_no_leaks()


@pytest.mark.parametrize(("patch", "param"), [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"temperature": -1}, "temperature"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_input_is_400_naming_the_field(server: LiveServer, patch: dict, param: str) -> None:
    body = {"model": TEST_MODEL, "input": "hi", "max_output_tokens": 2, **patch}
    resp = httpx.post(server.v1 + "/responses", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text
    server.assert_no_leaks()


def test_reasoning_item(server: LiveServer, client: openai.OpenAI) -> None:
    """--reasoning-parser deepseek_r1: an output with no </think> is all reasoning, so the
    random model's greedy text (the plain server's content) is the reasoning item's text."""
    plain = client.responses.create(model=TEST_MODEL, input="Think", max_output_tokens=6, temperature=0.0,
                                    store=False).output_text
    with running_server([TEST_MODEL, *SERVE_ARGS, "--reasoning-parser", "deepseek_r1"]) as live:
        thinking = openai.OpenAI(base_url=live.v1, api_key="EMPTY", max_retries=0)
        kwargs: dict[str, Any] = {"model": TEST_MODEL, "input": "Think", "max_output_tokens": 6,
                                  "temperature": 0.0, "reasoning": {"effort": "low"}}
        whole = thinking.responses.create(**kwargs)
        with thinking.responses.stream(**kwargs) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        for resp in (whole, final):
            assert [item.type for item in resp.output] == ["reasoning"]
            assert resp.output[0].content[0].text == plain
            assert resp.usage.output_tokens_details.reasoning_tokens == 6
        assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
        live.assert_no_leaks()


@pytest.mark.parametrize("stream", [True, False])
def test_client_leaving_aborts_the_request(server: LiveServer, stream: bool) -> None:
    """A client that leaves mid-generation (streamed or not) aborts its engine request."""
    before = server.abort_count()
    body = {"model": TEST_MODEL, "max_output_tokens": 1900, "stream": stream, "temperature": 0.0,
            "input": "Write a long story", "store": False}
    with httpx.Client(timeout=httpx.Timeout(30, read=None if stream else 0.5)) as http:
        if stream:
            with http.stream("POST", server.v1 + "/responses", json=body) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if "response.output_text.delta" in line)
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(server.v1 + "/responses", json=body)
    deadline = time.monotonic() + 5
    while server.abort_count() <= before:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.02)
    server.assert_no_leaks()
