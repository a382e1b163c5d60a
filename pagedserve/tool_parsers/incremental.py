"""Streaming by re-reading: a parser states what the text so far says, the base sends the difference.

    parse(text so far, final) -> (content, [(name, arguments so far), ...])

Contract: from one call to the next, `content` and each call's arguments only grow (each
is a prefix of what the final parse gives) and calls are only appended; a call appears
once its name is known. The base turns the growth into OpenAI deltas: the first piece of
call i carries its id and name, later pieces argument text. `extract` is the final parse,
so streamed pieces always concatenate to the whole response's calls.

Re-reading costs O(length) per delta, O(n^2) per response: tool-call outputs are short
(hundreds of tokens), and one rule for both paths beats a hand-written state machine per
format.
"""

from __future__ import annotations

from typing import Any

from pagedserve.tool_parsers.base import (
    DeltaToolCall,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolParser,
    tool_call_id,
)

ParsedCalls = tuple[str, list[tuple[str, str]]]


class IncrementalToolParser(ToolParser):
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self._text = ""
        self._content_sent = 0
        self._args_sent: list[int] = []  # per call: argument characters sent

    def parse(self, text: str, final: bool) -> ParsedCalls:
        raise NotImplementedError

    def new_id(self) -> str:
        return tool_call_id()

    def extract(self, text: str) -> ExtractedToolCalls:
        content, calls = self.parse(text, final=True)
        return ExtractedToolCalls(content=content.strip() or None,
                                  tool_calls=[ToolCall(name=n, arguments=a, id=self.new_id()) for n, a in calls])

    def feed(self, delta_text: str) -> StreamDelta:
        self._text += delta_text
        return self._difference(*self.parse(self._text, final=False))

    def finish(self) -> StreamDelta:
        return self._difference(*self.parse(self._text, final=True))

    def _difference(self, content: str, calls: list[tuple[str, str]]) -> StreamDelta:
        out = StreamDelta(content=content[self._content_sent:])
        self._content_sent = max(self._content_sent, len(content))
        for index, (name, arguments) in enumerate(calls):
            if index == len(self._args_sent):
                out.tool_calls.append(DeltaToolCall(index, id=self.new_id(), name=name, arguments=""))
                self._args_sent.append(0)
            piece = arguments[self._args_sent[index]:]
            if piece:
                out.tool_calls.append(DeltaToolCall(index, arguments=piece))
                self._args_sent[index] = len(arguments)
        return out
