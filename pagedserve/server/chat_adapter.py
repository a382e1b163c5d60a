"""Running another API's request through the chat pipeline (serving_chat.py), unchanged.

/v1/responses and /v1/messages translate their request into a ChatCompletionRequest, let
create_chat_completion template, constrain, generate and parse tool calls exactly as
/v1/chat/completions does, and translate its answer back. Working on the chat route's own
wire format (its JSON body, its SSE chunks) keeps that pipeline the one path for every
feature (tool parsers, reasoning, structured outputs) with no second entry point into it.

Errors the chat pipeline raises name chat fields; `run_chat` renames them to the caller's.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask

from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.serving_chat import create_chat_completion
from pagedserve.server.serving_common import ServerContext


@dataclass
class ChatAnswer:
    """What the chat pipeline answered: a whole chat.completion, or its stream of chunks."""

    completion: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    # The stream's clean-up (aborts the engine request): the caller's StreamingResponse runs it.
    background: BackgroundTask | None = None


def chat_request(fields: dict[str, Any], renames: Mapping[str, str]) -> ChatCompletionRequest:
    """The translated request; a value the chat schema refuses is a 400 naming the caller's field."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(part) for part in error.get("loc", ())]
        param = loc[0] if loc else None
        raise renamed(APIError(400, f"{'.'.join(loc)}: {error.get('msg', 'invalid value')}", param),
                      renames) from None


async def run_chat(
    ctx: ServerContext, body: ChatCompletionRequest, raw_request: Request, renames: Mapping[str, str]
) -> ChatAnswer:
    try:
        answer = await create_chat_completion(ctx, body, raw_request)
    except APIError as exc:
        raise renamed(exc, renames) from None
    if isinstance(answer, StreamingResponse):
        return ChatAnswer(chunks=_chunks(answer.body_iterator), background=answer.background)
    return ChatAnswer(completion=json.loads(bytes(answer.body)))


def renamed(exc: APIError, renames: Mapping[str, str]) -> APIError:
    """`exc` with its chat field (param, and the message's leading name) as the caller's field."""
    old = exc.param
    if old is None or old not in renames:
        return exc
    new = renames[old]
    message = exc.message
    if message.startswith(old):
        message = new + message[len(old):]
    return APIError(exc.status, message, new, exc.code, exc.headers)


async def _chunks(body: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of the chat route's SSE stream ([DONE] dropped); an error chunk is a
    {"error": ...} object, as the chat route sends it."""
    try:
        async for piece in body:
            text = bytes(piece).decode() if isinstance(piece, bytes | memoryview) else piece
            for line in text.split("\n"):
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[len("data: "):])
    finally:
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()


def stream_response(events: AsyncIterator[str], answer: ChatAnswer) -> Response:
    return StreamingResponse(events, media_type="text/event-stream", background=answer.background)


class DeltaSink(Protocol):
    """What a route makes of a chat stream's pieces: its own events (SSE lines) for each."""

    def reasoning(self, delta: str) -> list[str]: ...
    def text(self, delta: str) -> list[str]: ...
    def call(self, delta: dict[str, Any]) -> list[str]: ...


def delta_events(choice: dict[str, Any], sink: DeltaSink) -> Iterator[str]:
    """One chat stream choice's delta as the sink's events: reasoning, then text, then tool calls
    (the order the chat route sends them in)."""
    delta = choice["delta"]
    reasoning = delta.get("reasoning_content") or delta.get("reasoning")
    if reasoning:
        yield from sink.reasoning(reasoning)
    if delta.get("content"):
        yield from sink.text(delta["content"])
    for call in delta.get("tool_calls") or []:
        yield from sink.call(call)
