"""POST /v1/chat/completions: render the chat template, one engine request of n samples, stream deltas."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedserve.engine.async_engine import RequestGroup
from pagedserve.outputs import CompletionOutput, Logprob
from pagedserve.reasoning import get_reasoning_parser
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat_output import ChoiceStream, OutputParsing
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDeltaOut,
    ChatLogprobs,
    ChatMessageOut,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaToolCallOut,
    FunctionCall,
    TokenLogprob,
    ToolCallOut,
    TopLogprob,
    Usage,
    random_id,
)
from pagedserve.server.serving_beam import (
    beam_usage,
    decode,
    generated,
    search_all,
    wants_beam_search,
)
from pagedserve.server.serving_common import (
    MIN_LOGPROB,
    SSE_DONE,
    Collected,
    ServerContext,
    cached_details,
    check_not_failed,
    collect,
    compile_constraint,
    continuous_usage,
    json_logprob,
    make_params,
    process,
    sse,
    sse_error,
    submit,
    token_text,
)
from pagedserve.server.serving_completion import prompt_logprobs_out, salt
from pagedserve.server.tool_calls import ToolMode, adapt_to_template
from pagedserve.structured_outputs.reasoning import after_reasoning


class TokenizeRequestLike(Protocol):
    messages: Any
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: dict[str, Any] | None


def template_kwargs(ctx: ServerContext, body: Any) -> dict[str, Any]:
    """The template's extra variables: --default-chat-template-kwargs, then the request's
    chat_template_kwargs key by key; reasoning_effort, when sent, reaches the template too
    (templates that read it: gpt-oss's); an explicit chat_template_kwargs entry wins."""
    kwargs = dict(ctx.default_chat_template_kwargs)
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    return {**kwargs, **(getattr(body, "chat_template_kwargs", None) or {})}


async def render_chat(ctx: ServerContext, body: ChatCompletionRequest | TokenizeRequestLike) -> tuple[str, list[int]]:
    """(text, token ids) of the templated conversation (the --chat-template override wins),
    rendered by the input processor in the tokenize worker, which first refuses messages
    too long to fit; a template that cannot render them is a 400 naming the field."""
    given = getattr(body, "tools", None)  # /tokenize's chat shape has no tools
    tools = [t.model_dump(exclude_none=True) for t in given] if given else None
    messages = [m.as_template_input() for m in body.messages or []]
    processor = ctx.processor
    template = ctx.chat_template or getattr(processor.tokenizer, "chat_template", None)
    tool_choice = getattr(body, "tool_choice", None)
    # A template that cannot render tools: described in a system message (tool_calls.py).
    messages, tools = adapt_to_template(template if isinstance(template, str) else None, messages, tools,
                                        tool_choice, ctx.tool_call_parser if ctx.enable_auto_tool_choice else None)
    return await ctx.process_off_loop(body, lambda: processor.render_chat(  # type: ignore[arg-type]
        messages, chat_template=ctx.chat_template, tools=tools, add_generation_prompt=body.add_generation_prompt,
        continue_final_message=body.continue_final_message,
        chat_template_kwargs=template_kwargs(ctx, body),
        chat_template_content_format=ctx.chat_template_content_format,
        require_tools=tool_choice != "none",
    ))


async def create_chat_completion(ctx: ServerContext, body: ChatCompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    model = ctx.resolve_model(body.model)
    # Resolved once, now: an unload meanwhile makes the submission a 404, never the base model.
    lora = ctx.lora_for(model)
    _check_fields(body)
    tools = ToolMode.for_request(ctx, body)
    prompt_text, prompt_ids = await render_chat(ctx, body)
    # truncate_prompt_tokens: usage and the context-length check count the kept tokens.
    prompt_ids = ctx.processor.truncate_prompt(prompt_ids, body.truncate_prompt_tokens)
    if wants_beam_search(body):
        return await _beam_search(ctx, body, raw_request, model, prompt_ids, lora)
    parsing = OutputParsing(tools, get_reasoning_parser(ctx.reasoning_parser) if ctx.reasoning_parser else None,
                            prompt_text, template_kwargs(ctx, body))
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = make_params(body, max_tokens, logprobs, ctx.sampling_defaults, body.prompt_logprobs)
    constraint = body.output_constraint()
    param = constraint[1] if constraint is not None else None
    if tools.constraint is not None:
        if params.structured_outputs is not None:
            raise APIError(400, f"tool_choice {tools.choice!r} constrains the output itself; drop {param}",
                           "tool_choice")
        params = dataclasses.replace(params, structured_outputs=tools.constraint)
        param = "tools"
    params = _constrain_after_reasoning(ctx, params, parsing)
    await compile_constraint(ctx, params, param)
    prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids, **salt(body)}
    inputs = await process(ctx, body, [prompt], params, max_tokens, "messages")
    group = await submit(ctx, body, inputs, arrival, lora)
    request_id = random_id("chatcmpl")
    if body.stream:
        return StreamingResponse(
            _stream(body, model, request_id, len(prompt_ids), group, parsing, ctx.enable_prompt_tokens_details),
            media_type="text/event-stream",
            background=BackgroundTask(group.abort),
        )
    collected = await collect(group, raw_request, body.n)
    response = _response(body, model, request_id, prompt_ids, collected, parsing)
    response.usage.prompt_tokens_details = cached_details(ctx.enable_prompt_tokens_details,
                                                          collected.choices[0].num_cached_tokens)
    if body.prompt_logprobs is not None:
        response.prompt_logprobs = prompt_logprobs_out(collected.choices[0].prompt_logprobs)
    return JSONResponse(response.model_dump())


async def _beam_search(
    ctx: ServerContext, body: ChatCompletionRequest, raw_request: Request, model: str, prompt_ids: list[int],
    lora: object,
) -> Response:
    """use_beam_search (serving_beam.py): the n best beams as choices, best first; the text is
    the message's content (tools are refused with beam search, reasoning is not split off)."""
    max_tokens = body.max_completion_tokens or body.max_tokens
    (output,) = await search_all(ctx, body, raw_request, [prompt_ids], max_tokens, lora, "messages")
    choices = []
    for i, sequence in enumerate(output.sequences):
        token_ids = generated(sequence, prompt_ids)
        choices.append(ChatChoice(
            index=i, message=ChatMessageOut(role="assistant", content=decode(ctx, body, token_ids)),
            finish_reason=sequence.finish_reason, token_ids=token_ids if body.return_token_ids else None,
        ))
    response = ChatCompletionResponse(
        id=random_id("chatcmpl"), model=model, choices=choices, usage=beam_usage([prompt_ids], [output]),
        prompt_token_ids=prompt_ids if body.return_token_ids else None,
    )
    return JSONResponse(response.model_dump())


def _constrain_after_reasoning(ctx: ServerContext, params: SamplingParams, parsing: OutputParsing) -> SamplingParams:
    """With --reasoning-parser, a constraint (response_format, structured_outputs, a forced
    tool call) applies after the reasoning: the grammar lets the reasoning block through
    first (llguidance only; under xgrammar it applies from the first token)."""
    parser = parsing.reasoning_parser()
    spec = params.structured_outputs
    if parser is None or spec is None or not parser.enabled:
        return params
    # Replicas (a ReplicaSetEngine) compile in each replica: no local manager to ask.
    manager = getattr(ctx.engine, "structured_outputs", None)
    if manager is None or manager.backend_name != "llguidance":
        return params
    return dataclasses.replace(params, structured_outputs=after_reasoning(spec, parser.start, parser.end,
                                                                          parser.opened))


def _check_fields(body: ChatCompletionRequest) -> None:
    if body.tool_choice is not None and body.tool_choice != "none" and not body.tools:
        raise APIError(400, f"tool_choice {body.tool_choice!r} needs tools", "tool_choice")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", "stream_options")
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available when stream is enabled", "prompt_logprobs")


def _logprobs(entries: list[dict[int, Logprob]], token_ids: list[int], top: int, as_ids: bool = False) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        text = token_text(token_id, entry, as_ids)
        chosen = entry.get(token_id)
        ranked = sorted(
            (item for item in entry.items() if item[1].rank is not None and item[1].rank <= top),
            key=lambda item: item[1].rank or 0,
        )
        content.append(TokenLogprob(
            token=text,
            logprob=json_logprob(chosen.logprob) if chosen is not None else MIN_LOGPROB,
            bytes=list(text.encode()),
            top_logprobs=[_top(token_text(t, entry, as_ids), lp) for t, lp in ranked[:top]],
        ))
    return ChatLogprobs(content=content)


def _top(text: str, logprob: Logprob) -> TopLogprob:
    return TopLogprob(token=text, logprob=json_logprob(logprob.logprob), bytes=list(text.encode()))


def _usage(num_prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> Usage:
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=num_prompt_tokens + completion_tokens,
        completion_tokens_details=(CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
                                   if reasoning_tokens is not None else None),
    )


def _response(
    body: ChatCompletionRequest, model: str, request_id: str, prompt_ids: list[int], collected: Collected,
    parsing: OutputParsing,
) -> ChatCompletionResponse:
    choices = []
    reasoning_tokens = 0
    for index, state in enumerate(collected.choices):
        parsed = parsing.parse(state.text, state.token_counts)
        calls = parsed.tool_calls
        reasoning_tokens += parsed.reasoning_tokens
        reasoning = parsed.reasoning if body.include_reasoning else None
        finish_reason = state.finish_reason
        if calls and finish_reason == "stop" and parsing.tools.choice != "named":
            finish_reason = "tool_calls"
        choices.append(ChatChoice(
            index=index,
            message=ChatMessageOut(role="assistant", content=parsed.content, reasoning_content=reasoning,
                                   reasoning=reasoning, tool_calls=[
                ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
            ] if calls else None),
            logprobs=_logprobs(state.logprobs, state.token_ids, body.top_logprobs or 0,
                                         body.return_tokens_as_token_ids) if body.logprobs else None,
            finish_reason=finish_reason,
            stop_reason=state.stop_reason,
            token_ids=state.token_ids if body.return_token_ids else None,
        ))
    usage = _usage(len(prompt_ids), collected.num_generated_tokens,
                   reasoning_tokens if parsing.reasoning is not None else None)
    return ChatCompletionResponse(
        id=request_id, model=model, choices=choices, usage=usage,
        prompt_token_ids=prompt_ids if body.return_token_ids else None,
    )


def _chunk_choice(
    body: ChatCompletionRequest, index: int, completion: CompletionOutput, stream: ChoiceStream
) -> ChatChunkChoice:
    logprobs = None
    if body.logprobs:
        logprobs = _logprobs(completion.logprobs or [], completion.token_ids, body.top_logprobs or 0,
                             body.return_tokens_as_token_ids)
    delta = stream.feed(completion.text, len(completion.token_ids), completion.finish_reason is not None)
    calls = delta.tool_calls
    reasoning = delta.reasoning if body.include_reasoning else None
    finish_reason = completion.finish_reason
    if stream.num_calls and finish_reason == "stop" and stream.tools.mode.choice != "named":
        finish_reason = "tool_calls"
    return ChatChunkChoice(
        index=index,
        delta=ChatDeltaOut(content=delta.content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=[
            DeltaToolCallOut(index=c.index, id=c.id, type="function" if c.id is not None else None,
                             function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls
        ] or None),
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=completion.stop_reason,
        token_ids=completion.token_ids if body.return_token_ids else None,
    )


async def _stream(
    body: ChatCompletionRequest, model: str, request_id: str, num_prompt_tokens: int, group: RequestGroup,
    parsing: OutputParsing, prompt_tokens_details: bool = False,
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Any = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    # continuous_usage_stats: each chunk's usage is its choice's so far, as vLLM's.
    continuous = continuous_usage(body)
    choice_tokens = [0] * body.n
    cached = 0
    completion_tokens = 0
    streams = [parsing.stream() for _ in range(body.n)]
    try:
        # OpenAI's first chunk of each choice carries only the role.
        yield chunk([ChatChunkChoice(index=i, delta=ChatDeltaOut(role="assistant", content=""))
                     for i in range(body.n)], _usage(num_prompt_tokens, 0) if continuous else None)
        async with group:  # a client that disconnects cancels us here: its requests are aborted
            async for _, output in group:
                cached = output.num_cached_tokens
                # One engine request; each delta output is one sample's, its index the choice's.
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    index = completion.index
                    choice_tokens[index] += len(completion.token_ids)
                    yield chunk([_chunk_choice(body, index, completion, streams[index])],
                                _usage(num_prompt_tokens, choice_tokens[index]) if continuous else None)
                    check_not_failed(completion)
        if body.stream_options is not None and body.stream_options.include_usage:
            reasoning_tokens = sum(s.reasoning_tokens for s in streams) if parsing.reasoning is not None else None
            usage = _usage(num_prompt_tokens, completion_tokens, reasoning_tokens)
            usage.prompt_tokens_details = cached_details(prompt_tokens_details, cached)
            yield chunk([], usage)
    except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 is already sent
        yield sse_error(exc)
    yield SSE_DONE
