"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) on the chat pipeline.

    request ──> chat messages ──> create_chat_completion ──> chat.completion / chunks
                 system            tool_result -> tool         │
                 tool_use -> tool_calls                        │
    message / message_start ... message_stop  <────────────────┘

stop_reason: "length" -> max_tokens; a tool call -> tool_use; a stop string of
stop_sequences -> stop_sequence (named in stop_sequence); else end_turn. Streamed, text is
one content block (text_delta), each tool call one tool_use block (input_json_delta);
--reasoning-parser's reasoning is a thinking block (thinking_delta; its signature empty:
the server signs nothing, and replayed thinking blocks are not shown to the template).

Every error on these routes, the key's 401 and pydantic's 400 included, has Anthropic's
shape {"type": "error", "error": {"type": ..., "message": ...}} (AnthropicRoute); the
message names the field, as the OpenAI routes' `param` does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute

from pagedserve.server.chat_adapter import (
    ChatAnswer,
    chat_request,
    delta_events,
    run_chat,
    stream_response,
)
from pagedserve.server.errors import APIError, _validation_message, known_failure, log_client_error
from pagedserve.server.protocol_messages import (
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from pagedserve.server.serving_chat import render_chat
from pagedserve.server.serving_common import ServerContext

RENAMES = {"max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "stop": "stop_sequences"}

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 499: "api_error",
                500: "api_error", 503: "overloaded_error"}


def anthropic_error(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    if param and not message.startswith(param):
        message = f"{param}: {message}"
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicRoute(APIRoute):
    """A route whose errors (its dependencies' and body validation's too) are in Anthropic's shape."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as exc:
                # errors.py's reading of pydantic's errors: the message and field the OpenAI routes give.
                error = APIError(400, *_validation_message(exc))
            except Exception as exc:  # noqa: BLE001 - an unknown failure stays a 500 below
                found = known_failure(exc)
                if found is None:
                    raise
                error = found
            log_client_error(request, error.body(), error.status)
            headers = dict(error.headers or {})
            return JSONResponse(anthropic_error(error.status, error.message, error.param),
                                status_code=error.status, headers=headers or None)

        return route


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: tool_result blocks become tool messages (before
    the user's text, where Anthropic puts them), tool_use blocks the assistant's tool_calls."""
    messages: list[dict[str, Any]] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    for turn in body.messages:
        if isinstance(turn.content, str):
            messages.append({"role": turn.role, "content": turn.content})
            continue
        text = "".join(b.text for b in turn.content if isinstance(b, TextBlock))
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in turn.content if isinstance(b, ToolUseBlock)]
        messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
                     for b in turn.content if isinstance(b, ToolResultBlock)]
        if turn.role == "assistant" and calls:
            messages.append({"role": "assistant", "content": text or None, "tool_calls": calls})
        elif text or not any(isinstance(b, ToolResultBlock) for b in turn.content):
            messages.append({"role": turn.role, "content": text})
    return messages


def _chat_fields(body: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {"model": body.model, "messages": _chat_messages(body)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema, **({"description": t.description} if t.description else {})}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, 'tool_choice: type "tool" needs the tool\'s name', "tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences,
                      temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
        if body.stream:
            fields["stream_options"] = {"include_usage": True}
    return {k: v for k, v in fields.items() if v is not None}


async def count_tokens(ctx: ServerContext, body: CountTokensRequest) -> JSONResponse:
    """The prompt's token count as /v1/messages would template it."""
    ctx.resolve_model(body.model)
    _, ids = await render_chat(ctx, chat_request(_chat_fields(body), RENAMES))
    return JSONResponse({"input_tokens": len(ids)})


async def create_message(ctx: ServerContext, body: MessagesRequest, raw_request: Request) -> Response:
    chat = chat_request(_chat_fields(body), RENAMES)
    model = ctx.resolve_model(body.model)
    num_prompt_tokens = 0
    if body.stream:
        # message_start carries the prompt's size before anything is generated (clients
        # track their context with it): the template is rendered once more for the count.
        num_prompt_tokens = len((await render_chat(ctx, chat))[1])
    answer = await run_chat(ctx, chat, raw_request, RENAMES)
    message_id = _id("msg")
    if answer.chunks is not None:
        return stream_response(_stream(body, message_id, model, num_prompt_tokens, answer), answer)
    assert answer.completion is not None
    choice = answer.completion["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                 "input": _arguments(call["function"]["arguments"])} for call in message.get("tool_calls") or []]
    stop_reason, stop_sequence = _stop(body, choice["finish_reason"], choice.get("stop_reason"),
                                       bool(message.get("tool_calls")))
    usage = answer.completion["usage"]
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]},
    })


def _arguments(arguments: str) -> dict[str, Any]:
    # tool_use.input is an object; a parser's call whose arguments are not one keeps them under "arguments".
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def _stop(body: MessagesRequest, finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str, str | None]:
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str) and stop_reason in (body.stop_sequences or []):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _event(kind: str, **fields: Any) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, separators=(',', ':'))}\n\n"


class _Blocks:
    """The content blocks of one streamed message: which is open, and their events."""

    def __init__(self) -> None:
        self.count = 0
        # ("thinking", -1), ("text", -1) or ("tool", chat tool-call index)
        self._open: tuple[str, int] | None = None
        self.called = False

    def text(self, delta: str) -> list[str]:
        out = self._start(("text", -1), {"type": "text", "text": ""})
        return [*out, _event("content_block_delta", index=self.count - 1, delta={"type": "text_delta", "text": delta})]

    def reasoning(self, delta: str) -> list[str]:  # a thinking block
        out = self._start(("thinking", -1), {"type": "thinking", "thinking": "", "signature": ""})
        return [*out, _event("content_block_delta", index=self.count - 1,
                             delta={"type": "thinking_delta", "thinking": delta})]

    def call(self, delta: dict[str, Any]) -> list[str]:
        function = delta.get("function") or {}
        self.called = True
        out = self._start(("tool", delta["index"]), {"type": "tool_use", "id": delta.get("id") or _id("toolu"),
                                                     "name": function.get("name") or "", "input": {}})
        if function.get("arguments"):
            out.append(_event("content_block_delta", index=self.count - 1,
                              delta={"type": "input_json_delta", "partial_json": function["arguments"]}))
        return out

    def _start(self, key: tuple[str, int], block: dict[str, Any]) -> list[str]:
        if self._open == key:
            return []
        out = self.close()
        self._open = key
        self.count += 1
        return [*out, _event("content_block_start", index=self.count - 1, content_block=block)]

    def close(self) -> list[str]:
        if self._open is None:
            return []
        self._open = None
        return [_event("content_block_stop", index=self.count - 1)]


async def _stream(
    body: MessagesRequest, message_id: str, model: str, num_prompt_tokens: int, answer: ChatAnswer
) -> AsyncIterator[str]:
    assert answer.chunks is not None
    yield _event("message_start", message={
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": num_prompt_tokens, "output_tokens": 0}})
    blocks = _Blocks()
    finish_reason, stop_reason, usage = None, None, None
    async for chunk in answer.chunks:
        if "error" in chunk:
            error = chunk["error"]
            yield _event("error", error={"type": "api_error", "message": error["message"]})
            return
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            for line in delta_events(choice, blocks):
                yield line
            if choice.get("finish_reason"):
                finish_reason, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    for line in blocks.close():
        yield line
    reason, sequence = _stop(body, finish_reason, stop_reason, blocks.called)
    output_tokens = usage["completion_tokens"] if usage else 0
    yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                 usage={"input_tokens": num_prompt_tokens, "output_tokens": output_tokens})
    yield _event("message_stop")
