"""Pythonic tool calls (vLLM's pythonic: Llama 3.2 / Llama 4, Gemma 3 templates that ask for
them): the whole reply is a Python list of calls with literal keyword arguments.

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]
    <|python_start|>[...]<|python_end|>        (Llama 4 may wrap it)

Arguments are converted to JSON (`True` -> true, `None` -> null); a call is streamed once
its closing parenthesis arrives. A reply that is not such a list is content, whole.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from pagedserve.tool_parsers.incremental import IncrementalToolParser, ParsedCalls

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolParser(IncrementalToolParser):
    name = "pythonic"
    format_hint = ("To call functions, reply with only a Python list of calls with keyword arguments: "
                   "[func_name1(param1=value1, param2=value2), func_name2(param=value)]")

    def parse(self, text: str, final: bool) -> ParsedCalls:
        body = text.strip()
        if body.startswith(PYTHON_START):
            body = body[len(PYTHON_START):].lstrip()
        body = body.removesuffix(PYTHON_END).rstrip()
        if not body.startswith("["):
            if not final and (PYTHON_START.startswith(body) or body == PYTHON_START):
                return "", []
            return text, []
        spans, closed = _call_spans(body)
        calls: list[tuple[str, str]] = []
        for start, end in spans:
            call = _call(body[start:end])
            if call is None:
                return (text, []) if final else ("", calls)
            calls.append(call)
        if final and (not closed or not calls or body[closed:].strip()):
            return text, []
        return "", calls


def _call_spans(body: str) -> tuple[list[tuple[int, int]], int]:
    """Spans of the complete top-level calls in a list's text, and the offset after its `]`
    (0 while it is open)."""
    spans: list[tuple[int, int]] = []
    depth, quote, start, i = 0, "", 1, 1
    while i < len(body):
        char = body[i]
        if quote:
            if char == "\\":
                i += 1
            elif body.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif char in "\"'":
            quote = char * 3 if body.startswith(char * 3, i) else char
            i += len(quote) - 1
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                return spans, i + 1  # the list's own ]
            depth -= 1
            if depth == 0 and char == ")":
                spans.append((start, i + 1))
        elif char == "," and depth == 0:
            start = i + 1
        i += 1
    return spans, 0


def _call(text: str) -> tuple[str, str] | None:
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        return None
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = _dotted(node.func)
    if name is None:
        return None
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return None
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except ValueError:
            return None
    try:
        return name, json.dumps(arguments, ensure_ascii=False)
    except TypeError:  # a set, bytes, ...: not JSON
        return None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base is not None else None
    return None
