"""POST /v1/responses (OpenAI's Responses API) on top of the chat pipeline.

    request ──> chat messages ──> create_chat_completion ──> chat.completion / chunks
                (instructions, stored history, items)            │
    response object / response.* events  <───────────────────────┘

One response = one chat choice: its reasoning (--reasoning-parser) one `reasoning` item
(the text in its content; no summary is generated), its content one `message` item, each
tool call one `function_call` item (call_id = the chat tool call's id). Streamed, every item goes
output_item.added -> (content_part.added -> output_text.delta* -> output_text.done ->
content_part.done | function_call_arguments.delta -> .done) -> output_item.done, between
response.created / response.in_progress and response.completed. A response that hit
max_output_tokens is status "incomplete" with incomplete_details, in response.completed
(as vLLM does; the openai client's stream helper finishes only on that event).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.server.chat_adapter import (
    ChatAnswer,
    chat_request,
    delta_events,
    run_chat,
    stream_response,
)
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import now_s
from pagedserve.server.protocol_responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ResponsesRequest,
)
from pagedserve.server.response_store import ResponseStore, StoredResponse
from pagedserve.server.serving_common import ServerContext

# chat field -> this API's field, for the errors the chat pipeline raises.
RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "reasoning_effort": "reasoning"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


async def create_response(
    ctx: ServerContext, store: ResponseStore, body: ResponsesRequest, raw_request: Request
) -> Response:
    messages = _history(store, body.previous_response_id) + _input_messages(body)
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat = chat_request(_chat_fields(body, system + messages), RENAMES)
    answer = await run_chat(ctx, chat, raw_request, RENAMES)
    model = ctx.resolve_model(body.model)
    response_id = _id("resp")
    if answer.chunks is not None:
        return stream_response(_stream(body, store, messages, response_id, model, answer), answer)
    assert answer.completion is not None
    choice = answer.completion["choices"][0]
    message = choice["message"]
    output = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        output.append(_reasoning_item(_id("rs"), reasoning))
    if message.get("content"):
        output.append(_message_item(_id("msg"), message["content"], "completed"))
    output += [_call_item(_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"], "completed")
               for call in message.get("tool_calls") or []]
    response = _response(body, response_id, model, output, choice["finish_reason"], answer.completion["usage"])
    _store(store, body, messages, response)
    return JSONResponse(response)


def _history(store: ResponseStore, previous_id: str | None) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    stored = store.get(previous_id)
    if stored is None:
        raise APIError(404, f"previous_response_id: no stored response has the id {previous_id!r} (it was never "
                       "stored, or the server has evicted or forgotten it)", "previous_response_id", "not_found")
    return list(stored.messages)


def _input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages: consecutive function calls are one assistant turn."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            # Templates know system, not OpenAI's newer developer role.
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        # reasoning items: not shown to the template
    return messages


def _chat_fields(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "stream": body.stream,
                              "parallel_tool_calls": body.parallel_tool_calls}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    if body.background:
        raise APIError(400, "background: background responses are not implemented by this server", "background")
    effort = body.reasoning.effort if body.reasoning is not None else None
    for name, value in (("max_tokens", body.max_output_tokens), ("temperature", body.temperature),
                        ("top_p", body.top_p), ("reasoning_effort", effort)):
        if value is not None:
            fields[name] = value
    if body.tools:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for t in body.tools]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise APIError(400, "text.format: type json_schema needs a schema", "text")
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict else {})}}
    return {k: v for k, v in fields.items() if v is not None}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    """--reasoning-parser's reasoning as OpenAI's reasoning item (the text in `content`)."""
    content = [{"type": "reasoning_text", "text": text}] if text is not None else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": "completed" if text is not None else "in_progress"}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    prompt, completion = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def _response(
    body: ResponsesRequest, response_id: str, model: str, output: list[dict[str, Any]],
    finish_reason: str | None, chat_usage: dict[str, Any] | None, created_at: int | None = None,
) -> dict[str, Any]:
    """The response object; finish_reason None: still in progress."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    return {
        "id": response_id, "object": "response", "created_at": created_at or now_s(), "status": status,
        "model": model, "output": output, "usage": _usage(chat_usage), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": (body.tool_choice if isinstance(body.tool_choice, str)
                        else body.tool_choice.model_dump() if body.tool_choice is not None else "auto"),
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "store": body.store, "metadata": body.metadata or {}, "user": body.user, "background": False,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
        "truncation": body.truncation, "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
    }


def _store(store: ResponseStore, body: ResponsesRequest, messages: list[dict[str, Any]],
           response: dict[str, Any]) -> None:
    if not body.store:
        return
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    store.put(response["id"], StoredResponse([*messages, turn], response))


class _Events:
    """The response.* events of one stream, numbered, and the output items they build."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []
        # ("reasoning", -1), ("message", -1) or ("call", chat tool-call index)
        self._open: tuple[str, int] | None = None
        self._text: list[str] = []

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"

    def text(self, delta: str) -> list[str]:
        out = [] if self._open == ("message", -1) else self._start(("message", -1), _message_item(
            _id("msg"), "", "in_progress"))
        item = self.items[-1]
        self._text.append(delta)
        return [*out, self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                                 content_index=0, delta=delta, logprobs=[])]

    def reasoning(self, delta: str) -> list[str]:
        out = [] if self._open == ("reasoning", -1) else self._start(("reasoning", -1), _reasoning_item(
            _id("rs"), None))
        item = self.items[-1]
        self._text.append(delta)
        return [*out, self.event("response.reasoning_text.delta", item_id=item["id"],
                                 output_index=len(self.items) - 1, content_index=0, delta=delta)]

    def call(self, delta: dict[str, Any]) -> list[str]:
        out = []
        key = ("call", delta["index"])
        function = delta.get("function") or {}
        if self._open != key:
            out = self._start(key, _call_item(_id("fc"), delta.get("id") or _id("call"), function.get("name") or "",
                                              "", "in_progress"))
        item = self.items[-1]
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=len(self.items) - 1, delta=function["arguments"]))
        return out

    def _start(self, key: tuple[str, int], item: dict[str, Any]) -> list[str]:
        out = self.close()
        self._open = key
        self.items.append(item)
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part=_text_part("")))
        return out

    def close(self) -> list[str]:
        """Ends the open item (if any): its done events, with the item in its final form."""
        if self._open is None:
            return []
        self._open = None
        item, index = self.items[-1], len(self.items) - 1
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            text = "".join(self._text)
            self._text = []
            item["content"] = [_text_part(text)]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=item["content"][0]))
        elif item["type"] == "reasoning":
            text = "".join(self._text)
            self._text = []
            item["content"] = [{"type": "reasoning_text", "text": text}]
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=text))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out


async def _stream(
    body: ResponsesRequest, store: ResponseStore, messages: list[dict[str, Any]], response_id: str, model: str,
    answer: ChatAnswer,
) -> AsyncIterator[str]:
    assert answer.chunks is not None
    events = _Events()
    created = now_s()
    started = _response(body, response_id, model, [], None, None, created)
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    finish_reason, usage = None, None
    async for chunk in answer.chunks:
        if "error" in chunk:
            error = chunk["error"]
            yield events.event("error", code=error.get("code") or error.get("type"), message=error["message"],
                               param=error.get("param"))
            failed = {**started, "status": "failed", "output": events.items,
                      "error": {"code": "server_error", "message": error["message"]}}
            yield events.event("response.failed", response=failed)
            return
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            for line in delta_events(choice, events):
                yield line
            finish_reason = choice.get("finish_reason") or finish_reason
    for line in events.close():
        yield line
    response = _response(body, response_id, model, events.items, finish_reason or "stop", usage, created)
    _store(store, body, messages, response)
    yield events.event("response.completed", response=response)


def retrieve(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """GET /v1/responses/{id}: a stored response; 404 if it is not (or no longer) stored."""
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response has the id {response_id!r}", "response_id", "not_found")
    return stored.response
