"""Reasoning parsers: a reasoning model's text -> (reasoning, content), whole or streamed.

A reasoning model writes its thinking first, between markers, then the answer:

    [<think>] reasoning ... </think> [whitespace] content ...
    ^ may be in the prompt instead (the template opened the block), or absent

One state machine serves both paths: `extract` is `feed(whole text)` + `finish`, so a
stream's pieces always concatenate to the non-streamed message. Pieces that might be the
start of a marker are held back until the next delta decides.

    state START      at the beginning: an optional start marker (after whitespace) decides
    state REASONING  text goes to reasoning until the end marker
    state CONTENT    text goes to content (leading whitespace after the end marker dropped)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class _State(enum.Enum):
    START = "start"
    REASONING = "reasoning"
    CONTENT = "content"


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could start `marker` (kept for the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One response's parser (it keeps stream state).

    Args:
        prompt: the rendered prompt; one that ends with the start marker (the template
            opened the block, as DeepSeek-R1's and Qwen3-Thinking's do) starts in reasoning.
        chat_template_kwargs: the request's template variables (qwen3 reads enable_thinking).
    """

    name = ""
    start = "<think>"
    end = "</think>"
    # The output starts inside the reasoning even without a start marker (DeepSeek-R1).
    always_opened = False

    def __init__(self, prompt: str = "", chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.opened = self.always_opened or prompt.rstrip().endswith(self.start)
        self.enabled = self.thinking_enabled(chat_template_kwargs or {})
        self._state = _State.START if self.enabled else _State.CONTENT
        self._buffer = ""
        self._after_end = False  # whitespace right after the end marker is dropped
        self.saw_reasoning = False

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any]) -> bool:
        """False when the request turned thinking off: the whole output is content."""
        return True

    @property
    def in_reasoning(self) -> bool:
        """The next text would be reasoning (or the output has not decided yet and starts in it)."""
        return self._state is _State.REASONING or (self._state is _State.START and self.opened)

    @property
    def undecided(self) -> bool:
        """Still at the start, waiting to see whether a start marker comes."""
        return self._state is _State.START

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        out = self.feed(text)
        tail = self.finish()
        reasoning = out.reasoning + tail.reasoning
        content = out.content + tail.content
        return (reasoning if self.saw_reasoning else None), (content or None)

    def feed(self, delta: str) -> ReasoningDelta:
        """The next piece of the streamed text -> reasoning and content to send."""
        self._buffer += delta
        out = ReasoningDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ReasoningDelta:
        """End of the output: whatever was held back."""
        out = ReasoningDelta()
        if self.in_reasoning:
            self.saw_reasoning = True
            out.reasoning = self._buffer
        elif not self._after_end:
            out.content = self._buffer
        self._buffer = ""
        return out

    def _step(self, out: ReasoningDelta) -> bool:
        """Consumes what the buffer decides; True to look again (the state changed)."""
        buffer = self._buffer
        if self._state is _State.START:
            stripped = buffer.lstrip()
            if stripped.startswith(self.start):
                self._buffer = stripped[len(self.start):]
                self._enter_reasoning()
                return True
            if self.start.startswith(stripped):
                return False  # could still be the start marker
            if self.opened:
                self._enter_reasoning()
            else:
                self._state = _State.CONTENT
            return True
        if self._state is _State.REASONING:
            index = buffer.find(self.end)
            if index >= 0:
                out.reasoning += buffer[:index]
                self._buffer = buffer[index + len(self.end):]
                self._state, self._after_end = _State.CONTENT, True
                return True
            keep = held_back(buffer, self.end)
            out.reasoning += buffer[: len(buffer) - keep]
            self._buffer = buffer[len(buffer) - keep:]
            return False
        if self._after_end:
            buffer = buffer.lstrip()
            if not buffer:
                self._buffer = ""
                return False
            self._after_end = False
        out.content += buffer
        self._buffer = ""
        return False

    def _enter_reasoning(self) -> None:
        self._state = _State.REASONING
        self.saw_reasoning = True


class ReasoningCounter:
    """Counts a choice's reasoning tokens from its (text piece, token count) deltas: a piece
    counts when it began or ended inside the reasoning, or carried some of it. Pieces still
    deciding (a start marker arriving token by token) count once the marker proves real."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.num_tokens = 0
        self._undecided = 0  # tokens of pieces seen while the parser was still at the start

    def feed(self, delta: str, num_tokens: int) -> ReasoningDelta:
        before = self.parser.in_reasoning
        out = self.parser.feed(delta)
        if self.parser.undecided:
            self._undecided += num_tokens
        elif before or self.parser.in_reasoning or out.reasoning or self.parser.saw_reasoning and self._undecided:
            self.num_tokens += num_tokens + self._undecided
            self._undecided = 0
        else:
            self._undecided = 0
        return out
