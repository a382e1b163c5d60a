"""POST /v1/chat/completions: render the chat template, fan out n samples, stream deltas."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedserve.engine.async_engine import RequestGroup
from pagedserve.outputs import CompletionOutput, Logprob
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatMessageOut,
    TokenLogprob,
    TopLogprob,
    Usage,
    random_id,
)
from pagedserve.server.serving_common import (
    SSE_DONE,
    ChoiceState,
    ServerContext,
    check_context_length,
    check_not_failed,
    collect,
    fan_out,
    make_params,
    sse,
    sse_error,
    submit,
    token_text,
)


async def render_chat(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    """Token ids of the templated conversation (the --chat-template override wins), rendered
    and tokenized off the event loop, after refusing messages too long to fit."""
    ctx.check_prompt_chars(sum(m.num_chars for m in messages), "messages")
    return await ctx.off_loop(_render, ctx, messages, add_generation_prompt)


def _render(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    tokenizer = ctx.tokenizer
    template = ctx.chat_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; start the server with "
                       "--chat-template", "messages")
    try:
        text = tokenizer.apply_chat_template(
            [m.as_template_input() for m in messages],
            chat_template=template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
        raise APIError(400, f"messages: the chat template failed: {exc}", "messages") from None
    # The template already placed any BOS token; do not add a second one (as LLM.chat).
    return tokenizer.encode(text, add_special_tokens=False)


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    model = ctx.resolve_model(body.model)
    _check_fields(body)
    prompt_ids = await render_chat(ctx, body.messages, body.add_generation_prompt)
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = make_params(body, max_tokens, logprobs, ctx.sampling_defaults)
    check_context_length(ctx, len(prompt_ids), max_tokens, "messages")
    prompt = {"prompt_token_ids": prompt_ids}
    group = await submit(ctx, body, [(prompt, p) for p in fan_out(params, body.n)], arrival, ctx.lora_for(model))
    request_id = random_id("chatcmpl")
    if body.stream:
        return StreamingResponse(
            _stream(body, model, request_id, len(prompt_ids), group),
            media_type="text/event-stream",
            background=BackgroundTask(group.abort),
        )
    states = await collect(group, raw_request)
    return JSONResponse(_response(body, model, request_id, prompt_ids, states).model_dump())


def _check_fields(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", "stream_options")


def _logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(token_id, entry)
        chosen = entry.get(token_id)
        ranked = sorted(
            (item for item in entry.items() if item[1].rank is not None and item[1].rank <= top),
            key=lambda item: item[1].rank or 0,
        )
        content.append(TokenLogprob(
            token=text,
            logprob=chosen.logprob if chosen is not None else float("-inf"),
            bytes=list(text.encode()),
            top_logprobs=[_top(token_text(t, entry), lp) for t, lp in ranked[:top]],
        ))
    return ChatLogprobs(content=content)


def _top(text: str, logprob: Logprob) -> TopLogprob:
    return TopLogprob(token=text, logprob=logprob.logprob, bytes=list(text.encode()))


def _usage(num_prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt_tokens + completion_tokens,
    )


def _response(
    body: ChatCompletionRequest, model: str, request_id: str, prompt_ids: list[int], states: list[ChoiceState]
) -> ChatCompletionResponse:
    choices = [
        ChatChoice(
            index=index,
            message=ChatMessageOut(role="assistant", content=state.full_text),
            logprobs=_logprobs(state.logprobs, state.token_ids, body.top_logprobs or 0) if body.logprobs else None,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            token_ids=state.token_ids if body.return_token_ids else None,
        )
        for index, state in enumerate(states)
    ]
    usage = _usage(len(prompt_ids), sum(len(s.token_ids) for s in states))
    return ChatCompletionResponse(
        id=request_id, model=model, choices=choices, usage=usage,
        prompt_token_ids=prompt_ids if body.return_token_ids else None,
    )


def _chunk_choice(body: ChatCompletionRequest, index: int, completion: CompletionOutput) -> ChatChunkChoice:
    logprobs = None
    if body.logprobs:
        logprobs = _logprobs(completion.logprobs or [], completion.token_ids, body.top_logprobs or 0)
    return ChatChunkChoice(
        index=index,
        delta=ChatMessageOut(content=completion.text),
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        token_ids=completion.token_ids if body.return_token_ids else None,
    )


async def _stream(
    body: ChatCompletionRequest, model: str, request_id: str, num_prompt_tokens: int, group: RequestGroup
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Any = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    completion_tokens = 0
    try:
        # OpenAI's first chunk of each choice carries only the role.
        yield chunk([ChatChunkChoice(index=i, delta=ChatMessageOut(role="assistant", content=""))
                     for i in range(body.n)])
        async with group:  # a client that disconnects cancels us here: its requests are aborted
            async for index, output in group:
                completion = output.outputs[0]
                completion_tokens += len(completion.token_ids)
                yield chunk([_chunk_choice(body, index, completion)])
                check_not_failed(output)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield chunk([], _usage(num_prompt_tokens, completion_tokens))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 is already sent
        yield sse_error(exc)
    yield SSE_DONE
