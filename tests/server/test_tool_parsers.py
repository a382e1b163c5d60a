"""The hermes tool-call parser: whole text and streamed deltas give the same calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.tool_parsers import get_tool_parser
from pagedserve.tool_parsers.tool_choice import parse_constrained, required_schema

TEXTS = [
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>',
    'no calls here, just text with < and <tool and } braces',
    '<tool_call>{"arguments": {"k": 1}, "name": "args_first"}</tool_call> after',
    '<tool_call>\n{"name": "nested", "arguments": {"a": {"b": {"c": "}}"}}, "d": " x "}}\n</tool_call>',
]


def _stream(text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    parser = get_tool_parser("hermes")()
    content, names, args, ids = "", {}, {}, []
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    for a, b in zip(bounds, bounds[1:], strict=False):
        deltas = [parser.feed(text[a:b])]
        if b == len(text):
            deltas.append(parser.finish())
        for d in deltas:
            content += d.content
            for call in d.tool_calls:
                if call.id is not None:
                    assert call.index not in names and call.name  # the header comes once, name first
                    names[call.index] = call.name
                    ids.append(call.id)
                else:
                    assert call.index in names  # arguments only after the header
                args[call.index] = args.get(call.index, "") + (call.arguments or "")
    return content, [(names[i], args[i]) for i in sorted(names)], ids


@pytest.mark.parametrize("text", TEXTS)
def test_char_by_char_stream_equals_whole(text: str) -> None:
    whole = get_tool_parser("hermes")().extract(text)
    content, calls, ids = _stream(text, list(range(len(text))))
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (content.strip() or None) == whole.content
    assert len(set(ids)) == len(ids)
    for call in whole.tool_calls:
        json.loads(call.arguments)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
def test_any_split_stream_equals_whole(text: str, cuts: list[int]) -> None:
    whole = get_tool_parser("hermes")().extract(text)
    _, calls, _ = _stream(text, cuts)
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]


def test_extract_examples() -> None:
    found = get_tool_parser("hermes")().extract(TEXTS[0])
    assert found.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    # Cut by max_tokens: no call in the whole text (the stream has already sent the name and
    # the arguments so far, as vLLM's parser does; its finish_reason "length" tells the client).
    cut = '<tool_call>{"name": "cut", "arguments": {"q": "unfinished'
    assert get_tool_parser("hermes")().extract(cut).tool_calls == []
    assert _stream(cut, list(range(len(cut))))[1] == [("cut", '{"q": "unfinished')]
    with pytest.raises(ValueError, match="tool-call-parser"):
        get_tool_parser("nope")


def test_required_schema_and_parse() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    schema = required_schema(tools, parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = parse_constrained('[{"name": "g", "parameters": {"a": 1}}]', "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {"a": 1})]
    assert parse_constrained('[{"name": "g", "param', "required") == []
