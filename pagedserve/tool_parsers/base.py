"""Tool-call parsing: model text -> OpenAI tool_calls, whole or as streaming deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)


@dataclass(slots=True)
class ExtractedToolCalls:
    content: str | None  # text outside the calls (None if there is none)
    tool_calls: list[ToolCall]


@dataclass(slots=True)
class DeltaToolCall:
    """One piece of a streamed call, in OpenAI's shape: the first piece of call `index` has
    id, type and the function name (arguments ""); later pieces only argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolParser:
    """Parses one model's tool-call format. One instance per response (it keeps stream state).

    tools: the request's tools (OpenAI's shape), for formats whose values are typed by the
    tool's schema (qwen3_coder)."""

    name = ""
    # How the model is told to call, when the chat template cannot list the tools itself
    # (the server then describes them in a system message: server/tool_calls.py).
    format_hint = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def feed(self, delta_text: str) -> StreamDelta:
        """The next piece of the streamed text -> content to show and call pieces."""
        raise NotImplementedError

    def finish(self) -> StreamDelta:
        """End of stream: whatever was held back."""
        raise NotImplementedError
