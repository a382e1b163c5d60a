"""OpenAI-compatible request and response schemas (plus vLLM's sampling extras).

Request models are as strict as the server, so the OpenAPI document tells the truth:
  - an undeclared field is set aside (`unknown_fields`) for request_fields.py's rule: a
    field that would change the output and is not implemented is a 400 naming it, one
    that only describes the request is accepted, any other is logged (issue #37.1);
  - an explicit JSON null is an absent field (OpenAI's API allows null for every optional
    field); a field whose type admits None keeps its None (`max_tokens: null` on
    /v1/completions means no limit, as in vLLM), and the document says null is allowed;
  - types are strict (no "1" for 1, no 0.0 for an integer, no true for a token id),
    NaN / Infinity are refused, text may not hold lone surrogates (it could not be
    tokenized or echoed back as UTF-8);
  - the single-field ranges SamplingParams checks are in the schema too (same bounds, so
    both name the same field); what depends on several fields or on the model (best_of
    >= n, min_tokens <= max_tokens, token ids < vocabulary size, the context length) is
    checked by SamplingParams and the handlers, and documented as a 400 response.
"""

from __future__ import annotations

import time
import types
import uuid
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    StringConstraints,
    Tag,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedserve.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams

# vLLM's default --max-logprobs (OpenAI's own cap on top_logprobs). The schema sets no upper
# bound: the server's --max-logprobs does (api_server.check_max_logprobs), then the vocabulary.
MAX_LOGPROBS = 20
# n and best_of are sequences the engine runs at once for one prompt; keep one call bounded.
MAX_SAMPLES = 128
# Each stop string is searched for after every token; keep that bounded.
MAX_STOP_STRINGS = 1024

TokenId = Annotated[int, Field(ge=0)]
NonEmptyText = Annotated[str, StringConstraints(min_length=1)]
# logit_bias keys are token ids written as JSON object keys (decimal strings).
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,10}$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def _find_surrogate(value: Any) -> bool:
    """True if any string inside `value` holds a lone surrogate (not encodable as UTF-8).

    Iterative: a JSON schema may nest deeper than Python's recursion limit.
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, list | tuple):
            # Lists are homogeneous here: a list of token ids holds no text (and may be long).
            if item and not isinstance(item[0], int | float):
                stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return False


def _admits_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        return any(_admits_none(arg) for arg in get_args(annotation))
    return False


def _nullable_in_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The document admits null for each optional field whose type does not (null is absent)."""
    absent = getattr(cls, "_null_is_absent", None)
    if absent is None:
        return
    for name, prop in schema.get("properties", {}).items():
        if name in absent():
            meta = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
            schema["properties"][name] = {"anyOf": [prop, {"type": "null"}], **meta}


class StrictRequest(BaseModel):
    """Base of every request body: strict types, no NaN, valid text; null is absent and
    undeclared fields are kept aside for the field rule (request_fields.py)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False, json_schema_extra=_nullable_in_schema)

    # The undeclared fields of this object as sent (not nested objects': each holds its own).
    _unknown: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def unknown_fields(self) -> dict[str, Any]:
        return self._unknown

    @classmethod
    def _null_is_absent(cls) -> set[str]:
        """Names (as sent: aliases) of the optional fields whose type does not admit None."""
        return {f.alias or name for name, f in cls.model_fields.items()
                if not f.is_required() and not _admits_none(f.annotation)}

    @model_validator(mode="wrap")
    @classmethod
    def _set_aside(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        if not isinstance(data, dict):
            return handler(data)
        known = {name for name in cls.model_fields} | {f.alias for f in cls.model_fields.values() if f.alias}
        absent = cls._null_is_absent()
        unknown = {k: v for k, v in data.items() if k not in known and v is not None}
        given = {k: v for k, v in data.items() if k in known and not (v is None and k in absent)}
        model = handler(given)
        model._unknown = unknown
        return model

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        if _find_surrogate(value):
            raise ValueError("text must be valid Unicode (it holds a lone surrogate such as \\ud800)")
        return value


class StreamOptions(StrictRequest):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class JSONSchemaFormat(StrictRequest):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormat(StrictRequest):
    """OpenAI's response_format: text, json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsIn(StrictRequest):
    """vLLM's structured_outputs field; exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


# The request fields that carry an output constraint, in the order they are looked at.
CONSTRAINT_FIELDS = ("structured_outputs", "response_format", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")


class SamplingRequest(StrictRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    # vLLM's: lower runs first under --scheduling-policy priority (must be 0 otherwise).
    priority: int = 0
    # vLLM's: logprobs name tokens as "token_id:N" instead of their text.
    return_tokens_as_token_ids: bool = False
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[TokenIdKey, Bias] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    # Structured outputs (OpenAI's response_format, vLLM's structured_outputs and guided_*)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's extras that shape the output or the prompt (issue #37.6)
    prompt_logprobs: int | None = Field(None, ge=0)  # each prompt token's logprob and its top k
    bad_words: list[NonEmptyText] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    # Keep only the prompt's last k tokens (-1: as many as leave room to generate).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # Prefix-cache isolation: requests share cached blocks only when their salts are equal.
    cache_salt: NonEmptyText | None = None
    # vLLM's beam search (server/serving_beam.py): n is the beam width; scores are
    # sum(logprob) / generated_len ** length_penalty; only early_stopping=true is implemented.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | None = None

    def output_constraint(self) -> tuple[StructuredOutputsParams, str] | None:
        """(constraint, the field it came from), or None; ValueError naming the field."""
        given = [name for name in CONSTRAINT_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type == "text":
            given.remove("response_format")
        if not given:
            return None
        if len(given) > 1:
            raise ValueError(f"{given[0]}: set only one of {', '.join(given)}")
        name = given[0]
        try:
            return _constraint(self, name), name
        except ValueError as exc:
            message = str(exc).replace("structured_outputs", name, 1) if name != "structured_outputs" else str(exc)
            raise ValueError(message if message.startswith(name) else f"{name}: {message}") from None

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        defaults: dict[str, Any] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """One engine request's parameters (n / best_of included: the engine samples them,
        sharing the prompt's KV blocks); raises ValueError.

        `defaults` (the model's generation_config.json) fill the sampling fields the request
        leaves out, before vLLM's own defaults. Outputs come as deltas (one per sample and
        step), except for best_of > n unstreamed: the engine ranks the samples at the end
        and reports the best n once.
        """
        defaults = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        constraint = self.output_constraint()
        best_of: int | None = getattr(self, "best_of", None)  # /v1/completions only
        ranked = best_of is not None and best_of > self.n and not self.stream
        return SamplingParams(
            n=self.n,
            best_of=best_of,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            output_kind="final_only" if ranked else "delta",
            structured_outputs=constraint[0] if constraint is not None else None,
        )


def _constraint(body: SamplingRequest, name: str) -> StructuredOutputsParams:
    if name == "structured_outputs":
        so = body.structured_outputs
        assert so is not None
        return StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                       json_object=so.json_object, disable_any_whitespace=so.disable_any_whitespace)
    if name == "response_format":
        fmt = body.response_format
        assert fmt is not None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return StructuredOutputsParams(json=fmt.json_schema.schema_)
    kind = name.removeprefix("guided_")
    return StructuredOutputsParams(**{kind: getattr(body, name)})


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    return {int(token_id): value for token_id, value in bias.items()}


class CompletionRequest(SamplingRequest):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # 0 only with echo: score the prompt without generating (lm-evaluation-harness, vLLM).
    max_tokens: int | None = Field(16, ge=0)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class FunctionCall(StrictRequest):
    name: str
    arguments: str


class ToolCallOut(StrictRequest):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    # The agent loop: an assistant turn's calls, and a tool result's call id.
    tool_calls: list[ToolCallOut] | None = None
    tool_call_id: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The message as a chat template takes it (chat_utils puts the content in the
        template's format: a string, or the list of text parts)."""
        content: Any = self.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        message: dict[str, Any] = {"role": self.role, "content": content if content is not None else ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @property
    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content)
        return len(self.content or "")


class FunctionDefinition(StrictRequest):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(StrictRequest):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(StrictRequest):
    name: str


class NamedToolChoice(StrictRequest):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # Without either, a chat request may generate up to the context length (vLLM does the same).
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Reaches the chat template as a variable (gpt-oss-style templates read it).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM: false leaves the reasoning out of the response (--reasoning-parser still splits it off).
    include_reasoning: bool = True


class TokenizeCompletionRequest(StrictRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(StrictRequest):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def _tokenize_shape(data: Any) -> str:
    # Chosen by the key present, not by which shape fits best: an undeclared field no longer
    # counts against a shape (it is set aside), so "fits best" would pick the wrong message.
    if isinstance(data, dict) and "messages" in data:
        return "TokenizeChatRequest"
    return "TokenizeCompletionRequest"


# vLLM's two shapes of /tokenize: exactly one of prompt and messages (the other one is then
# an undeclared field, refused by request_fields.py).
TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("TokenizeCompletionRequest")]
    | Annotated[TokenizeChatRequest, Tag("TokenizeChatRequest")],
    Discriminator(_tokenize_shape),
]


class DetokenizeRequest(StrictRequest):
    model: str | None = None
    tokens: list[TokenId]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error envelope, the body of every non-2xx answer."""

    error: ErrorInfo


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


# ---- responses ---------------------------------------------------------------------------


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # --enable-prompt-tokens-details: the prompt tokens whose KV came from the prefix cache.
    prompt_tokens_details: PromptTokensDetails | None = None
    # Chat with --reasoning-parser: how many completion tokens were reasoning.
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's per-token record in `prompt_logprobs` (keyed by token id)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class _OmitNone(BaseModel):
    """Serialized without its None fields: OpenAI sends a call's later stream pieces as
    {"index": 0, "function": {"arguments": "..."}}, and clients that merge the pieces (the
    openai package's stream helper) would take an explicit null type or name as a new value."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(_OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCallOut(_OmitNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessageOut(BaseModel):
    role: str | None = None
    content: str | None = None
    # --reasoning-parser: the reasoning, under vLLM's older name and its newer one.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatDeltaOut(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    # vLLM's: with prompt_logprobs, each prompt token's record (None for the first).
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDeltaOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


# ---- /v1/embeddings -------------------------------------------------------------------------


class EmbeddingRequest(StrictRequest):
    """OpenAI's embeddings request; `truncate_prompt_tokens` and `normalize` are vLLM's."""

    model: str | None = None
    input: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    normalize: bool | None = None


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # base64 of little-endian float32 when asked


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
