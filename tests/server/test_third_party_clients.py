"""Agent frameworks' own request shapes and response parsing against a live server (issue 37.7).

LangChain's ChatOpenAI (bind_tools, with_structured_output by function calling and by JSON
schema), litellm's `hosted_vllm/` provider (whole, streamed, tools), an OpenAI Agents SDK
Agent with one function tool run to completion, and instructor in TOOLS mode: each client
builds its requests and parses our responses itself, so a field it sends that we refuse,
or a response shape it cannot read, fails here. The reference is the client library.

The server is the random test model with its ChatML template (which renders no tools) and
the hermes parser: a named or required tool_choice forces a schema-valid call through the
grammar, which is what these clients ask for when they want a tool call or an object.

The clients come from the `clients` extra (pyproject.toml; `PAGEDSERVE_CLIENTS=1
scripts/setup.sh` installs it, instructor with --no-deps): without it the module is skipped. Nothing reaches the network: litellm reads its bundled
model-cost map and the Agents SDK's tracing is off.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from importlib.util import find_spec
from typing import Annotated, Any

import pytest

# Before litellm is imported: its model-cost map from the package, not from GitHub; no telemetry.
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ["LITELLM_TELEMETRY"] = "False"
os.environ["OPENAI_AGENTS_DISABLE_TRACING"] = "1"

_SKIP = ("the third-party clients (the `clients` extra) are not installed: PAGEDSERVE_CLIENTS=1 scripts/setup.sh "
         "installs them")
# Looked up, not imported: importing them all costs ~20 s, paid by their own tests only.
_MISSING = [name for name in ("langchain_openai", "litellm", "agents", "instructor") if find_spec(name) is None]
if _MISSING:
    pytest.skip(f"{_SKIP} (missing: {', '.join(_MISSING)})", allow_module_level=True)

import openai  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server  # noqa: E402

# A bounded argument: the random model fills an unbounded string up to max_tokens.
City = Annotated[str, Field(max_length=12)]


class Weather(BaseModel):
    """Current weather in a city."""

    city: City


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as live:
        yield live


def _chat_model(server: LiveServer, temperature: float | None = None) -> Any:  # a langchain_openai.ChatOpenAI
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=TEST_MODEL, base_url=server.v1, api_key="EMPTY", max_retries=0,  # type: ignore[arg-type,call-arg]
                      max_tokens=100, temperature=temperature)


def test_langchain_bind_tools(server: LiveServer) -> None:
    llm = _chat_model(server).bind_tools([Weather], tool_choice="Weather")
    message = llm.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "Weather" and call["id"]
    Weather.model_validate(call["args"])
    plain = _chat_model(server, temperature=0.0).invoke("Say hi")
    assert isinstance(plain.content, str) and plain.response_metadata["finish_reason"] in ("stop", "length")
    server.assert_no_leaks()


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(server: LiveServer, method: str) -> None:
    structured = _chat_model(server).with_structured_output(Weather, method=method)  # type: ignore[arg-type]
    weather = structured.invoke("What is the weather in Paris?")
    assert isinstance(weather, Weather) and len(weather.city) <= 12
    server.assert_no_leaks()


def test_litellm_hosted_vllm(server: LiveServer) -> None:
    import litellm

    litellm.telemetry = False
    common = dict(model=f"hosted_vllm/{TEST_MODEL}", api_base=server.v1, api_key="EMPTY", max_tokens=8,
                  temperature=0.0, messages=[{"role": "user", "content": "Say hi"}])
    whole = litellm.completion(**common)
    assert isinstance(whole.choices[0].message.content, str)
    assert whole.usage.completion_tokens == 8 and whole.usage.prompt_tokens > 0
    chunks = list(litellm.completion(stream=True, **common))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content  # greedy: the same text, assembled from deltas
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                             "parameters": Weather.model_json_schema()}}
    called = litellm.completion(**{**common, "max_tokens": 100}, tools=[tool],
                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)
    server.assert_no_leaks()


def test_openai_agents_function_tool(server: LiveServer) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def weather_tool(city: City) -> str:
        """Current weather in a city."""
        calls.append(city)
        return f"21 C in {city}"

    client = openai.AsyncOpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0)
    # required: the random model calls the tool on the first turn; the SDK then resets
    # tool_choice (reset_tool_choice) so the second turn answers in text and the run ends.
    agent = Agent(name="weather", instructions="Answer with the weather.", tools=[weather_tool],
                  model=OpenAIChatCompletionsModel(model=TEST_MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0.0))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(calls) == 1 and isinstance(result.final_output, str)
    server.assert_no_leaks()


def test_instructor_tools_mode(server: LiveServer) -> None:
    import instructor

    client = instructor.from_openai(openai.OpenAI(base_url=server.v1, api_key="EMPTY", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    weather = client.chat.completions.create(
        model=TEST_MODEL, response_model=Weather, max_retries=0, max_tokens=100,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    assert isinstance(weather, Weather) and len(weather.city) <= 12
    raw = weather._raw_response  # type: ignore[attr-defined]
    assert json.loads(raw.choices[0].message.tool_calls[0].function.arguments) == weather.model_dump()
    server.assert_no_leaks()
