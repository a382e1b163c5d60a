"""Request schema of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API).

    messages[].content   a string, or blocks: text, tool_use (assistant), tool_result (user),
                         thinking / redacted_thinking (replayed by agent loops; not shown to
                         the template)
    system               a string or text blocks
    tools                {name, description, input_schema}; tool_choice auto / any / tool / none
    stop_sequences, temperature, top_p, top_k, max_tokens

Images and documents are not served: such a block is a 400 naming `messages`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag

from pagedserve.server.protocol import MAX_STOP_STRINGS, NonEmptyText, StrictRequest


class TextBlock(StrictRequest):
    type: Literal["text"]
    text: str
    # Prompt caching hints and citations describe the request; the prefix cache is automatic.
    cache_control: dict[str, Any] | None = None
    citations: list[Any] | None = None


class ToolUseBlock(StrictRequest):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(StrictRequest):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(StrictRequest):
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


def _block_kind(data: Any) -> str:
    kind = data.get("type") if isinstance(data, dict) else getattr(data, "type", None)
    if kind in ("tool_use", "tool_result"):
        return str(kind)
    return "thinking" if kind in ("thinking", "redacted_thinking") else "text"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")],
    Discriminator(_block_kind),
]


class AnthropicMessage(StrictRequest):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(StrictRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(StrictRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class CountTokensRequest(StrictRequest):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    stream: bool = False
    metadata: dict[str, Any] | None = None


class CountTokensResponse(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error envelope, the body of every non-2xx answer of /v1/messages."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
