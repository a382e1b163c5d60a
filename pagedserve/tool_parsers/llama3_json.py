"""Llama 3.1 / 3.2 / 3.3 JSON tool calls (vLLM's llama3_json): the whole reply is the calls.

    [<|python_tag|>]{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

A reply that does not start with `{` or <|python_tag|> (after whitespace) is content;
one that starts so but is not a list of calls is content too, whole.
"""

from __future__ import annotations

from pagedserve.tool_parsers.incremental import IncrementalToolParser, ParsedCalls
from pagedserve.tool_parsers.json_calls import partial_call

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(IncrementalToolParser):
    name = "llama3_json"
    format_hint = ('To call functions, reply with only JSON objects, separated by "; ": '
                   '{"name": <function-name>, "parameters": <args-json-object>}')

    def parse(self, text: str, final: bool) -> ParsedCalls:
        stripped = text.lstrip()
        if stripped.startswith(PYTHON_TAG):
            pos = len(text) - len(stripped) + len(PYTHON_TAG)
        elif stripped.startswith("{"):
            pos = len(text) - len(stripped)
        elif not final and PYTHON_TAG.startswith(stripped):
            return "", []  # nothing yet, or a tag arriving
        else:
            return text, []
        calls: list[tuple[str, str]] = []
        while True:
            while pos < len(text) and text[pos] in " \t\r\n;":
                pos += 1
            if pos >= len(text):
                return "", calls
            if text[pos] != "{":
                return (text, []) if final else ("", calls)
            name, arguments, end = partial_call(text, pos)
            if name is None or end is None:
                if final:
                    return text, []
                if name is not None:
                    calls.append((name, arguments))
                return "", calls
            calls.append((name, arguments))
            pos = end
