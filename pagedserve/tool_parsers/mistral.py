"""Mistral tool calls (vLLM's mistral): content, then [TOOL_CALLS] and the calls, in either
of Mistral's two layouts:

    [TOOL_CALLS][{"name": "f", "arguments": {...}}, {"name": "g", ...}]   tokenizers v2 / v3 (7B v0.3)
    [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}                     tokenizers v11+ (Small 3.2, ...)

Call ids are 9 letters and digits: Mistral's templates refuse any other id when the
client sends the call back.
"""

from __future__ import annotations

import random
import string

from pagedserve.tool_parsers.incremental import IncrementalToolParser, ParsedCalls
from pagedserve.tool_parsers.json_calls import held_back, partial_arguments, partial_call

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ALPHABET = string.ascii_letters + string.digits


class MistralToolParser(IncrementalToolParser):
    name = "mistral"
    format_hint = ('To call functions, reply with [TOOL_CALLS] and a JSON list: [TOOL_CALLS][{"name": '
                   '<function-name>, "arguments": <args-json-object>}]')

    def new_id(self) -> str:
        return "".join(random.choices(_ALPHABET, k=9))

    def parse(self, text: str, final: bool) -> ParsedCalls:
        start = text.find(TOOL_CALLS)
        if start < 0:
            keep = 0 if final else held_back(text, TOOL_CALLS)
            return text[: len(text) - keep], []
        content = text[:start]
        rest = text[start + len(TOOL_CALLS):]
        body = rest.lstrip()
        if body.startswith("["):
            calls, ok = _json_list(body, final)
        elif not body:
            calls, ok = [], not final
        else:
            calls, ok = _v11_calls(rest, final)
        if final and not ok:
            return text, []
        return content, calls


def _json_list(body: str, final: bool) -> tuple[list[tuple[str, str]], bool]:
    calls: list[tuple[str, str]] = []
    pos = 1
    while True:
        while pos < len(body) and body[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(body):
            return calls, False
        if body[pos] == "]":
            return calls, bool(calls)
        if body[pos] != "{":
            return calls, False
        name, arguments, end = partial_call(body, pos)
        if name is None or end is None:
            if name is not None and not final:
                calls.append((name, arguments))
            return calls, False
        calls.append((name, arguments))
        pos = end


def _v11_calls(rest: str, final: bool) -> tuple[list[tuple[str, str]], bool]:
    calls: list[tuple[str, str]] = []
    for segment in rest.split(TOOL_CALLS):
        head, found, tail = segment.partition(ARGS)
        if not found:
            return calls, False  # the name is still arriving
        name = head.strip()
        offset = len(tail) - len(tail.lstrip())
        arguments, end = partial_arguments(tail, offset)
        calls.append((name, arguments))
        if end is None:
            return calls, False
    return calls, True
