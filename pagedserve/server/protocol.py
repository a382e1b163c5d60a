"""OpenAI-compatible request and response schemas (plus vLLM's sampling extras).

Request models are as strict as the server, so the OpenAPI document tells the truth:
  - a field the server does not implement is refused (400 naming it), never ignored;
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
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator

from pagedserve.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

# OpenAI allows up to 20 top logprobs; the engine's sampler returns at most that many.
MAX_LOGPROBS = 20
# n and best_of fan out into independent engine requests; keep one HTTP call bounded.
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
    """True if any string inside `value` holds a lone surrogate (not encodable as UTF-8)."""
    if isinstance(value, str):
        if value.isascii():
            return False
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list | tuple):
        # Lists are homogeneous here: a list of token ids holds no text (and may be long).
        if not value or isinstance(value[0], int | float):
            return False
        return any(_find_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_find_surrogate(k) or _find_surrogate(v) for k, v in value.items())
    return False


class StrictRequest(BaseModel):
    """Base of every request body: unknown fields refused, strict types, no NaN, valid text."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        if _find_surrogate(value):
            raise ValueError("text must be valid Unicode (it holds a lone surrogate such as \\ud800)")
        return value


class StreamOptions(StrictRequest):
    include_usage: bool = False


class SamplingRequest(StrictRequest):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
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

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """One engine request's parameters (n=1: the server fans out); raises ValueError.

        `defaults` (the model's generation_config.json) fill the sampling fields the request
        leaves out, before vLLM's own defaults.
        """
        defaults = defaults or {}

        def pick(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return SamplingParams(
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
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=_logit_bias(self.logit_bias),
            output_kind="delta",
        )


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
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1, le=MAX_SAMPLES)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message

    @property
    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content)
        return len(self.content or "")


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # Without either, a chat request may generate up to the context length (vLLM does the same).
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeCompletionRequest(StrictRequest):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(StrictRequest):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True


# vLLM's two shapes of /tokenize: exactly one of prompt and messages.
TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


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


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
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


class ChatMessageOut(BaseModel):
    role: str | None = None
    content: str | None = None


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


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatMessageOut
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
