"""Hermes / Qwen2.5 / SmolLM format: calls inside <tool_call></tool_call> tags, one object
or (SmolLM2's layout) a JSON list of them:

    Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>
    <tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>

Arguments are passed on as the model wrote them (the exact JSON text of the "arguments"
value), so streamed pieces concatenate to exactly the non-streamed `arguments`. A block
that holds no call stays in the content; an empty list (SmolLM2's "no call") is dropped.

Calls written without the tags are taken too, as llama.cpp's Hermes-2-Pro / Qwen2.5 parser
takes them: Qwen2.5-Coder-0.5B-Instruct (the `make serve` default), asked through its own
template, answers a tool question with the bare object, often in a ```json fence (so does
transformers on the same file). Only when the whole reply is such calls, each naming one of
the request's tools with its arguments: anything else stays content. While streaming, a
reply that may be one (it opens with "{", "[", "```json" or a bare "```") is held back until it ends.
"""

from __future__ import annotations

import re
from typing import Any

from pagedserve.tool_parsers.incremental import IncrementalToolParser, ParsedCalls
from pagedserve.tool_parsers.json_calls import DECODER, held_back, partial_call

START, END = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"\A```(?:json)?[ \t]*\n(.*?)\n?```\Z", re.S)


class HermesToolParser(IncrementalToolParser):
    name = "hermes"
    format_hint = ("For each function call, return a json object with function name and arguments within "
                   '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
                   "<args-json-object>}\n</tool_call>")

    def parse(self, text: str, final: bool) -> ParsedCalls:
        if self.tools and START not in text:
            if not final and _may_be_bare(text.lstrip()):
                return "", []  # decided once the reply ends
            if final and (bare := _bare_calls(text, self.tools)):
                return "", bare
        content: list[str] = []
        calls: list[tuple[str, str]] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail[: len(tail) - (0 if final else held_back(tail, START))])
                break
            content.append(text[pos:start])
            end = text.find(END, start)
            closed = end >= 0
            block = text[: end] if closed else text
            found, ok = _block_calls(block, start + len(START), complete=closed or final)
            if closed or final:
                if ok:
                    calls.extend(found)
                else:  # not a call after all: it stays in the content
                    content.append(text[start: end + len(END) if closed else len(text)])
            else:
                calls.extend(found)  # an open block: the calls so far
            if not closed:
                break
            pos = end + len(END)
        return "".join(content), calls


def _block_calls(text: str, pos: int, complete: bool) -> tuple[list[tuple[str, str]], bool]:
    """The calls in a block's text from `pos` (one object or a list of them), and whether
    the block, complete, is a valid call block."""
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    if pos >= len(text):
        return [], False
    if text[pos] != "[":
        name, arguments, end = partial_call(text, pos)
        if name is None:
            return [], False
        return [(name, arguments)], end is not None and not text[end:].strip()
    calls: list[tuple[str, str]] = []
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text):
            return calls, False
        if text[pos] == "]":
            return calls, not text[pos + 1:].strip()
        if text[pos] != "{":
            return calls, False
        name, arguments, end = partial_call(text, pos)
        if name is None or end is None:
            if name is not None and not complete:
                calls.append((name, arguments))
            return calls, False
        calls.append((name, arguments))
        pos = end


def _may_be_bare(head: str) -> bool:
    """Whether a reply opening with `head` (stripped on the left) may still be bare calls."""
    return head[:1] in ("", "{", "[") or any(f.startswith(head[:len(f)]) for f in ("```json", "```\n"))


def _bare_calls(text: str, tools: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The calls of a reply that is nothing but untagged call objects (one, several, or a list;
    maybe in a ```json fence), each naming a declared tool; [] for any other reply."""
    body = text.strip()
    fenced = _FENCE.match(body)
    body = fenced.group(1).strip() if fenced else body
    names = {t.get("function", {}).get("name") for t in tools}
    calls: list[tuple[str, str]] = []
    pos = 0
    while pos < len(body):
        if body[pos] in " \t\r\n,":
            pos += 1
            continue
        try:
            value, _ = DECODER.raw_decode(body, pos)
        except ValueError:
            return []
        objects = value if isinstance(value, list) else [value]
        if not objects or not all(isinstance(o, dict) and o.get("name") in names
                                  and isinstance(o.get("arguments", o.get("parameters")), dict) for o in objects):
            return []
        if body[pos] == "[":  # a list ends the reply
            found, ok = _block_calls(body, pos, complete=True)
            return calls + found if ok else []
        name, arguments, end = partial_call(body, pos)
        assert name is not None and end is not None  # decoded above
        calls.append((name, arguments))
        pos = end
    return calls
