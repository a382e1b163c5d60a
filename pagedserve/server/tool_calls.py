"""How a chat request uses its tools, and turning output text into OpenAI tool_calls.

    no tools / "none"      text is content; nothing parsed
    "auto"                 the --tool-call-parser reads calls out of the text (streamed as it comes)
    "required" / named     the output is constrained to the calls' JSON (tool_parsers/tool_choice.py);
                           streamed once complete: name first, then the arguments
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.server.errors import APIError
from pagedserve.tool_parsers import DeltaToolCall, ToolCall, ToolParser, get_tool_parser
from pagedserve.tool_parsers.tool_choice import parse_constrained, tool_choice_constraint


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "none" (also: no tools), "auto", "required" or "named"
    tool_choice: Any = None  # the request's tool_choice, as a plain value
    constraint: StructuredOutputsParams | None = None
    parser: type[ToolParser] | None = None

    @classmethod
    def for_request(cls, ctx: Any, body: Any) -> ToolMode:
        if not body.tools:
            return cls("none")
        tools = [t.model_dump() for t in body.tools]
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        if choice == "none":
            return cls("none")
        if choice == "auto":
            if not ctx.enable_auto_tool_choice or ctx.tool_call_parser is None:
                raise APIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                               "and --tool-call-parser (e.g. hermes); or send tool_choice \"required\" or a named "
                               "function", "tool_choice")
            return cls("auto", "auto", parser=get_tool_parser(ctx.tool_call_parser))
        plain = choice if isinstance(choice, str) else choice.model_dump()
        try:
            constraint = tool_choice_constraint(tools, plain, body.parallel_tool_calls)
        except ValueError as exc:
            raise APIError(400, str(exc), "tool_choice") from None
        return cls("required" if choice == "required" else "named", plain, constraint)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        if self.choice == "none":
            return text, []
        if self.parser is not None:
            found = self.parser().extract(text)
            return found.content, found.tool_calls
        calls = parse_constrained(text, self.tool_choice)
        return (None, calls) if calls else (text, [])

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's streamed deltas: content and tool-call pieces."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.parser = mode.parser() if mode.parser is not None else None
        self.num_calls = 0
        self._text: list[str] = []

    def feed(self, delta_text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        if self.mode.choice == "none":
            return delta_text, []
        if self.parser is not None:
            out = self.parser.feed(delta_text)
            content, calls = out.content, list(out.tool_calls)
            if finished:
                tail = self.parser.finish()
                content += tail.content
                calls += tail.tool_calls
            self.num_calls += sum(1 for c in calls if c.id is not None)
            return content or None, calls
        # Constrained calls: complete JSON only at the end.
        self._text.append(delta_text)
        if not finished:
            return None, []
        text = "".join(self._text)
        parsed = parse_constrained(text, self.mode.tool_choice)
        if not parsed:
            return text, []
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parsed):
            deltas.append(DeltaToolCall(index, id=call.id, name=call.name, arguments=""))
            deltas.append(DeltaToolCall(index, arguments=call.arguments))
        self.num_calls = len(parsed)
        return None, deltas
