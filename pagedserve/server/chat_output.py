"""A chat choice's text -> reasoning, content and tool calls, whole or as stream deltas.

    model text --ReasoningParser (--reasoning-parser)--> reasoning | content
    content    --ToolMode / ToolStream (tools)---------> content   | tool_calls

Tool calls are read only from the text after the reasoning ends, so a call the model
mulls over while thinking is never taken for one it makes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.reasoning import ReasoningCounter, ReasoningParser
from pagedserve.server.tool_calls import ToolMode, ToolStream
from pagedserve.tool_parsers import DeltaToolCall, ToolCall


@dataclass(slots=True)
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]
    reasoning_tokens: int = 0


@dataclass(slots=True)
class ChoiceDelta:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class OutputParsing:
    """How one request's choices are read (one parser instance per choice).

    prompt: the rendered prompt (a template that opened the reasoning block starts the
    output inside it); chat_template_kwargs: what the template got (enable_thinking)."""

    tools: ToolMode
    reasoning: type[ReasoningParser] | None = None
    prompt: str = ""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)

    def reasoning_parser(self) -> ReasoningParser | None:
        if self.reasoning is None:
            return None
        return self.reasoning(self.prompt, self.chat_template_kwargs)

    def parse(self, pieces: list[str], token_counts: list[int]) -> ParsedChoice:
        """A whole choice, from its delta texts and the tokens of each (for reasoning_tokens)."""
        parser = self.reasoning_parser()
        if parser is None:
            content, calls = self.tools.extract("".join(pieces))
            return ParsedChoice(None, content, calls)
        counter = ReasoningCounter(parser)
        reasoning, text = [], []
        for piece, num_tokens in zip(pieces, token_counts, strict=False):
            out = counter.feed(piece, num_tokens)
            reasoning.append(out.reasoning)
            text.append(out.content)
        tail = parser.finish()
        joined = "".join(text) + tail.content
        content, calls = self.tools.extract(joined) if joined else (None, [])
        return ParsedChoice("".join(reasoning) + tail.reasoning if parser.saw_reasoning else None,
                            content or None, calls, counter.num_tokens)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: each engine delta -> reasoning, content and call pieces."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.tools: ToolStream = parsing.tools.stream()
        parser = parsing.reasoning_parser()
        self.counter = ReasoningCounter(parser) if parser is not None else None

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls

    @property
    def reasoning_tokens(self) -> int:
        return self.counter.num_tokens if self.counter is not None else 0

    def feed(self, text: str, num_tokens: int, finished: bool) -> ChoiceDelta:
        if self.counter is None:
            content, calls = self.tools.feed(text, finished)
            return ChoiceDelta(None, content, calls)
        out = self.counter.feed(text, num_tokens)
        reasoning, content = out.reasoning, out.content
        if finished:
            tail = self.counter.parser.finish()
            reasoning += tail.reasoning
            content += tail.content
        if content or finished:
            shown, calls = self.tools.feed(content, finished)
        else:
            shown, calls = None, []
        return ChoiceDelta(reasoning or None, shown or None, calls)
