"""Hermes / Qwen2.5 / SmolLM format: <tool_call>{"name": ..., "arguments": {...}}</tool_call>.

Arguments are passed on as the model wrote them (the exact JSON text of the "arguments"
value), so streamed pieces concatenate to exactly the non-streamed `arguments`.
"""

from __future__ import annotations

import json
import re

from pagedserve.tool_parsers.base import (
    DeltaToolCall,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolParser,
    tool_call_id,
)

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def _parse_call(body: str) -> ToolCall | None:
    """A call from the text between the tags; None if it is not a call."""
    try:
        obj, _ = _DECODER.raw_decode(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    raw = _raw_arguments(body)
    if raw is None:
        raw = json.dumps(obj.get("arguments", obj.get("parameters", {})), ensure_ascii=False)
    return ToolCall(name=obj["name"], arguments=raw)


def _raw_arguments(body: str) -> str | None:
    match = _ARGS.search(body)
    if match is None:
        return None
    try:
        _, end = _DECODER.raw_decode(body, match.end())
    except ValueError:
        return None
    return body[match.end():end]


def _held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could start `marker` (kept for the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self) -> None:
        self._buffer = ""  # text not yet emitted as content, or the open call's body
        self._in_call = False
        self._index = -1
        self._header_sent = False
        self._args_sent = 0  # characters of the open call's arguments already streamed

    def extract(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        content: list[str] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                content.append(text[pos:])
                break
            content.append(text[pos:start])
            end = text.find(END, start)
            body = text[start + len(START): end if end >= 0 else len(text)]
            call = _parse_call(body)
            if call is None:  # not a call after all: it stays in the content
                content.append(text[start: end + len(END) if end >= 0 else len(text)])
            else:
                calls.append(call)
            if end < 0:
                break
            pos = end + len(END)
        joined = "".join(content).strip()
        return ExtractedToolCalls(content=joined or None, tool_calls=calls)

    def feed(self, delta_text: str) -> StreamDelta:
        self._buffer += delta_text
        out = StreamDelta()
        while True:
            if not self._in_call:
                start = self._buffer.find(START)
                if start < 0:
                    keep = _held_back(self._buffer, START)
                    out.content += self._buffer[: len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.content += self._buffer[:start]
                self._buffer = self._buffer[start + len(START):]
                self._in_call, self._index, self._header_sent, self._args_sent = True, self._index + 1, False, 0
            end = self._buffer.find(END)
            body = self._buffer if end < 0 else self._buffer[:end]
            self._stream_call(body, complete=end >= 0, out=out)
            if end < 0:
                return out
            self._buffer = self._buffer[end + len(END):]
            self._in_call = False

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self._in_call:
            self._stream_call(self._buffer, complete=True, out=out)
        else:
            out.content = self._buffer
        self._buffer = ""
        self._in_call = False
        return out

    def _stream_call(self, body: str, complete: bool, out: StreamDelta) -> None:
        if not self._header_sent:
            name = _NAME.search(body)
            args = _ARGS.search(body)
            # The name must be known (and, mid-stream, come before the arguments) to open the call.
            if name is None or (args is not None and args.start() < name.start() and not complete):
                return
            out.tool_calls.append(DeltaToolCall(self._index, id=tool_call_id(), name=json.loads(f'"{name.group(1)}"'),
                                                arguments=""))
            self._header_sent = True
        if complete:
            raw = _raw_arguments(body)
            if raw is None:
                call = _parse_call(body)
                raw = call.arguments if call is not None else "{}"
            piece = raw[self._args_sent:]
        else:
            match = _ARGS.search(body)
            if match is None:
                return
            partial = body[match.end():]
            # Hold back the end: closing braces / whitespace may belong to the outer object,
            # and a partial "</tool_call>" is not argument text.
            partial = partial[: len(partial) - _held_back(partial, END)].rstrip("} \n\t\r")
            piece = partial[self._args_sent:]
        if piece:
            out.tool_calls.append(DeltaToolCall(self._index, arguments=piece))
            self._args_sent += len(piece)
