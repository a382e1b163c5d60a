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


# ---- every parser: recorded outputs of its family ------------------------------------------

WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"}}}}}]

# (parser, recorded model output, expected content, expected [(name, arguments as a value)])
RECORDED = [
    # SmolLM2's layout: a list inside one block; its "no call" is an empty list.
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]</tool_call>',
     None, [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("hermes", "I don't need a tool. <tool_call>[]</tool_call>", "I don't need a tool.", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "</tool"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>', None, [("f", {"a": "</tool"}), ("g", {})]),
    # Qwen2.5-Coder-0.5B-Instruct's own replies (transformers, greedy, its template): untagged
    # calls, bare or fenced; an undeclared name or other code stays content.
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [("get_weather", {"city": "Paris"})]),
    ("hermes", '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Tokyo"\n  }\n}\n```',
     None, [("get_weather", {"city": "Tokyo"})]),
    ("hermes", '{"name": "get_time", "arguments": {}}', '{"name": "get_time", "arguments": {}}', []),
    ("hermes", "```python\nprint({1})\n```", "```python\nprint({1})\n```", []),
    # Llama 3.1 / 3.2 JSON, with and without <|python_tag|>, parallel calls split by ";".
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco, CA", '
                    '"metric": false}}', None, [("get_weather", {"city": "San Francisco, CA", "metric": False})]),
    ("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [1, {"z": "}"}]}}',
     None, [("a", {"x": 1}), ("b", {"y": [1, {"z": "}"}]})]),
    ("llama3_json", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    # Mistral: 7B-v0.3's list, and the v11 tokenizers' name[ARGS]{...} per call.
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
                '{"name": "get_weather", "arguments": {"city": "Lyon"}}]',
     None, [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Lyon"})]),
    ("mistral", 'Let me look. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": "CET"}',
     "Let me look.", [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("mistral", "Bonjour ! [TOOL_CALL is not the marker", "Bonjour ! [TOOL_CALL is not the marker", []),
    # Pythonic (Llama 3.2 / 4, Gemma 3): Python literals become JSON.
    ("pythonic", '[get_weather(city="San Francisco", metric=True, opts={"a": (1, None)}), get_time(zone=\'C,E)T\')]',
     None, [("get_weather", {"city": "San Francisco", "metric": True, "opts": {"a": [1, None]}}),
            ("get_time", {"zone": "C,E)T"})]),
    ("pythonic", '<|python_start|>[search(query="llama \\"4\\"", k=3)]<|python_end|>', None,
     [("search", {"query": 'llama "4"', "k": 3})]),
    ("pythonic", "I cannot call [anything] here.", "I cannot call [anything] here.", []),
    # Qwen3-Coder XML: values typed by the tool's schema.
    ("qwen3_coder", "I'll check both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n12 Main\nSt\n"
                    "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n"
                    "<parameter=opts>\n{\"x\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                    "<function=get_time>\n<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
     "I'll check both.", [("get_weather", {"city": "12 Main\nSt", "days": 3, "metric": False, "opts": {"x": [1, 2]}}),
                          ("get_time", {"zone": "CET"})]),
    ("qwen3_coder", "Plain answer with <b>tags</b>.", "Plain answer with <b>tags</b>.", []),
]


def _stream_any(name: str, text: str, bounds: list[int]) -> tuple[str, list[tuple[str, str]], list[str]]:
    parser = get_tool_parser(name)(WEATHER_TOOLS)
    content, names, args, ids = "", {}, {}, []
    for a, b in zip(bounds, bounds[1:], strict=False):
        deltas = [parser.feed(text[a:b])]
        if b == len(text):
            deltas.append(parser.finish())
        for d in deltas:
            content += d.content
            for call in d.tool_calls:
                if call.id is not None:
                    assert call.index == len(names) and call.name and call.arguments == ""  # OpenAI's first piece
                    names[call.index] = call.name
                    ids.append(call.id)
                else:
                    assert call.index in names and call.name is None
                args[call.index] = args.get(call.index, "") + (call.arguments or "")
    return content, [(names[i], args[i]) for i in sorted(names)], ids


@pytest.mark.parametrize(("name", "text", "content", "calls"), RECORDED, ids=[f"{c[0]}-{i}" for i, c in enumerate(RECORDED)])
def test_recorded_outputs(name: str, text: str, content: str | None, calls: list) -> None:  # type: ignore[type-arg]
    whole = get_tool_parser(name)(WEATHER_TOOLS).extract(text)
    assert whole.content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == calls
    streamed_content, streamed, ids = _stream_any(name, text, list(range(len(text) + 1)))
    assert streamed == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (streamed_content.strip() or None) == content
    assert len(set(ids)) == len(ids)
    if name == "mistral":  # Mistral's templates take only 9-character alphanumeric ids back
        assert all(len(i) == 9 and i.isalnum() for i in ids + [c.id for c in whole.tool_calls])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(RECORDED), st.lists(st.integers(0, 400), max_size=12))
def test_recorded_any_split(case: tuple, cuts: list[int]) -> None:  # type: ignore[type-arg]
    name, text, content, _ = case
    whole = get_tool_parser(name)(WEATHER_TOOLS).extract(text)
    bounds = sorted({0, len(text), *[c % (len(text) + 1) for c in cuts]})
    streamed_content, calls, _ = _stream_any(name, text, bounds)
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert (streamed_content.strip() or None) == content


def test_registry() -> None:
    from pagedserve.tool_parsers import TOOL_PARSERS

    assert sorted(TOOL_PARSERS) == ["hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
    assert all(parser.format_hint for parser in TOOL_PARSERS.values())


def test_strict_tool_is_closed_everywhere() -> None:
    """A tool's "strict": true (OpenAI's strict mode): every object of its forced call is
    closed, even one that says additionalProperties: true; without strict it is kept."""
    from pagedserve.tool_parsers.tool_choice import tool_choice_constraint

    params = {"type": "object", "properties": {"o": {"type": "object", "properties": {"k": {"type": "string"}},
                                                     "additionalProperties": True}}, "additionalProperties": True}
    for strict in (True, False):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params, "strict": strict}}]
        named = tool_choice_constraint(tools, {"type": "function", "function": {"name": "f"}})
        assert named is not None and isinstance(named.json, dict)
        assert named.json["additionalProperties"] is not strict
        assert named.json["properties"]["o"]["additionalProperties"] is not strict
        required = tool_choice_constraint(tools, "required")
        assert required is not None and isinstance(required.json, dict)
        assert required.json["items"]["properties"]["parameters"]["additionalProperties"] is not strict
