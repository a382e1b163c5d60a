"""Request schema of POST /v1/responses (OpenAI's Responses API), the part this server serves.

    input        a string (one user message) or a list of items:
                   message               {role, content: str | [input_text / output_text parts]}
                   function_call         the assistant's earlier call {call_id, name, arguments}
                   function_call_output  its result {call_id, output}
                   reasoning             replayed reasoning: accepted, not shown to the template
    instructions a system message before the input (not carried to a follow-up response)
    tools        function tools only (flat: {type, name, description, parameters, strict})
    text.format  text | json_object | json_schema {name, schema, strict}

The items are translated to chat messages (serving_responses.py); strict typing, null as
absent and the field rule are StrictRequest's, as on every other route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from pagedserve.server.protocol import StrictRequest


class InputText(StrictRequest):
    # output_text: an assistant message replayed from an earlier response.
    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(StrictRequest):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(StrictRequest):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictRequest):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(StrictRequest):
    """A reasoning item an agent loop replays: its text is not given back to the template
    (OpenAI's models do not see earlier turns' reasoning either)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list)
    content: list[Any] | None = None
    encrypted_content: str | None = None


def _item_kind(data: Any) -> str:
    # An item without a type is a message (EasyInputMessage); an unknown type fails as a message.
    kind = data.get("type", "message") if isinstance(data, dict) else getattr(data, "type", "message")
    return kind if kind in ("function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(StrictRequest):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictRequest):
    type: Literal["function"]
    name: str


class TextFormat(StrictRequest):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictRequest):
    format: TextFormat | None = None


class ReasoningConfig(StrictRequest):
    # Reaches the chat template as reasoning_effort (templates of reasoning models read it).
    effort: str | None = None
    # Summaries are not generated: the reasoning item carries the reasoning text itself.
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(StrictRequest):
    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    # Kept in the server's bounded in-memory store (response_store.py) for previous_response_id.
    store: bool = True
    stream: bool = False
    reasoning: ReasoningConfig | None = None
    # Not implemented (a 400 when true): the client would poll for a response never queued.
    background: bool = False
    # "auto" would drop old items to fit; here an input too long is a 400 either way.
    truncation: Literal["auto", "disabled"] = "disabled"
    # What to add to the output (e.g. reasoning.encrypted_content): nothing extra is produced.
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
