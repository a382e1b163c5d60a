"""POST /v1/completions: prompts x samples fan out into independent engine requests.

Engine request k of a call serves prompt k // S, sample k % S, where S = best_of or n.
Without best_of, choice index = k (OpenAI's order: all choices of prompt 0, then prompt 1).
With best_of > n, the n samples of each prompt with the highest cumulative logprob are
returned (the engine is asked for logprobs=0 internally to get cumulative_logprob).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedserve.engine.async_engine import RequestGroup
from pagedserve.engine.llm_engine import PromptInput
from pagedserve.outputs import Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
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
    compile_constraint,
    fan_out,
    json_logprob,
    make_params,
    sse,
    sse_error,
    submit,
    token_text,
)

# One HTTP call may fan out into at most this many engine requests (prompts x samples).
MAX_ENGINE_REQUESTS = 1024

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    model = ctx.resolve_model(body.model)
    _check_fields(body)
    prompts = await _prompts(ctx, body.prompt)
    num_samples = body.best_of or body.n
    if len(prompts) * num_samples > MAX_ENGINE_REQUESTS:
        raise APIError(400, f"n: prompts x samples must be <= {MAX_ENGINE_REQUESTS}", "n")
    internal_logprobs = body.logprobs if body.logprobs is not None else (0 if num_samples > body.n else None)
    # echo with max_tokens=0 scores the prompt only: the engine generates one token, dropped.
    max_tokens = 1 if _echo_only(body) else body.max_tokens
    params = make_params(body, max_tokens, internal_logprobs, ctx.sampling_defaults, _engine_prompt_logprobs(body))
    constraint = body.output_constraint()
    await compile_constraint(ctx, params, constraint[1] if constraint is not None else None)
    for _, ids in prompts:
        check_context_length(ctx, len(ids), max_tokens, "prompt")
    requests: list[tuple[PromptInput, SamplingParams]] = [
        (_engine_prompt(text, ids), sample_params)
        for text, ids in prompts
        for sample_params in fan_out(params, num_samples)
    ]
    group = await submit(ctx, body, requests, arrival, ctx.lora_for(model))
    request_id = random_id("cmpl")
    if body.stream:
        return StreamingResponse(
            _stream(ctx, body, model, request_id, prompts, group),
            media_type="text/event-stream",
            # Runs even if the client left before the first chunk was produced.
            background=BackgroundTask(group.abort),
        )
    states = await collect(group, raw_request)
    return JSONResponse(_response(ctx, body, model, request_id, prompts, states).model_dump())


def _check_fields(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of < body.n:
        raise APIError(400, f"best_of must be >= n ({body.n}), got {body.best_of}", "best_of")
    if body.stream and body.best_of is not None and body.best_of > body.n:
        raise APIError(400, "best_of > n cannot be streamed", "best_of")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", "stream_options")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)", "max_tokens")
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available when stream is enabled", "prompt_logprobs")


def _echo_only(body: CompletionRequest) -> bool:
    return body.echo and body.max_tokens == 0


def _engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """echo with logprobs reports the prompt's tokens too, so it needs their logprobs (vLLM)."""
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


async def _prompts(ctx: ServerContext, prompt: str | list[str] | list[int] | list[list[int]]) -> list[Prompt]:
    """Normalizes the four prompt shapes; text is tokenized here (off the event loop), as
    the engine would, after refusing any text too long to fit whatever its tokens."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [(None, list(prompt))]  # type: ignore[arg-type]
    texts = [item for item in prompt if isinstance(item, str)]
    for text in texts:
        ctx.check_prompt_chars(len(text), "prompt")
    encoded = iter(await ctx.off_loop(lambda: [ctx.tokenizer.encode(t) for t in texts]) if texts else [])
    return [(item, next(encoded)) if isinstance(item, str) else (None, list(item)) for item in prompt]


def _engine_prompt(text: str | None, ids: list[int]) -> PromptInput:
    return {"prompt": text, "prompt_token_ids": ids}


def _echo_text(ctx: ServerContext, prompt: Prompt) -> str:
    text, ids = prompt
    if text is not None:
        return text
    return ctx.tokenizer.decode(ids) if ctx.engine.tokenizer is not None else ""


def _logprobs(
    ctx: ServerContext, entries: list[dict[int, Logprob] | None], token_ids: list[int], offset: int, num_top: int
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for `token_ids`. An entry is None for the prompt's first token
    (nothing predicts it); each entry lists its token first, then the top `num_top`."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = _decode_one(ctx, token_id)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            text = token_text(token_id, entry)
            out.tokens.append(text)
            out.token_logprobs.append(json_logprob(entry[token_id].logprob) if token_id in entry else None)
            top = list(entry.items())[: num_top + 1]
            out.top_logprobs.append({token_text(t, entry): json_logprob(lp.logprob) for t, lp in top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _decode_one(ctx: ServerContext, token_id: int) -> str:
    tokenizer = ctx.engine.tokenizer
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def _prompt_logprobs_out(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    if entries is None:
        return None
    return [
        None if entry is None else {
            token_id: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
            for token_id, lp in entry.items()
        }
        for entry in entries
    ]


def _choice_logprobs(
    ctx: ServerContext, body: CompletionRequest, prompt_ids: list[int],
    prompt_entries: list | None, token_ids: list[int], entries: list, offset: int,
) -> CompletionLogprobs | None:
    """With echo, the prompt's tokens come first (prompt_entries None: not in this chunk)."""
    if body.logprobs is None:
        return None
    if body.echo and prompt_entries is not None:
        token_ids, entries = [*prompt_ids, *token_ids], [*prompt_entries, *entries]
        offset = 0
    return _logprobs(ctx, entries, token_ids, offset, body.logprobs)


def _best(states: list[ChoiceState], num_samples: int, n: int) -> list[ChoiceState]:
    if num_samples == n:
        return states
    chosen = []
    for start in range(0, len(states), num_samples):
        samples = states[start : start + num_samples]
        chosen += sorted(samples, key=lambda s: s.cumulative_logprob, reverse=True)[:n]
    return chosen


def _response(
    ctx: ServerContext, body: CompletionRequest, model: str, request_id: str,
    prompts: list[Prompt], states: list[ChoiceState],
) -> CompletionResponse:
    num_samples = body.best_of or body.n
    choices = []
    for index, state in enumerate(_best(states, num_samples, body.n)):
        prompt = prompts[index // body.n]
        prefix = _echo_text(ctx, prompt) if body.echo else ""
        if _echo_only(body):
            state.text, state.token_ids, state.logprobs = [], [], []
        choices.append(CompletionChoice(
            index=index,
            text=prefix + state.full_text,
            logprobs=_choice_logprobs(ctx, body, prompt[1], state.prompt_logprobs, state.token_ids,
                                      state.logprobs, len(prefix)),
            prompt_logprobs=_prompt_logprobs_out(state.prompt_logprobs) if body.prompt_logprobs is not None else None,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            prompt_token_ids=prompt[1] if body.return_token_ids else None,
            token_ids=state.token_ids if body.return_token_ids else None,
        ))
    # Every sample is generated, so every sample counts (best_of is billed like that too);
    # echo with max_tokens=0 returns no generated token and bills none.
    completion_tokens = sum(len(s.token_ids) for s in states)
    return CompletionResponse(
        id=request_id, model=model, choices=choices, usage=_usage(prompts, completion_tokens)
    )


def _usage(prompts: list[Prompt], completion_tokens: int) -> Usage:
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


class _StreamState:
    """Per-choice progress of one streamed call."""

    def __init__(self, num_choices: int) -> None:
        self.started = [False] * num_choices
        self.offsets = [0] * num_choices  # text_offset of the next token, per choice
        self.completion_tokens = 0


def _stream_choice(
    ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt],
    state: _StreamState, index: int, output: RequestOutput,
) -> CompletionChoice:
    completion = output.outputs[0]
    text, token_ids, entries = completion.text, completion.token_ids, completion.logprobs or []
    if _echo_only(body):
        text, token_ids, entries = "", [], []
    state.completion_tokens += len(token_ids)
    prompt = prompts[index // body.n]
    first = not state.started[index]
    state.started[index] = True
    prefix = _echo_text(ctx, prompt) if first and body.echo else ""
    logprobs = _choice_logprobs(ctx, body, prompt[1], output.prompt_logprobs if first else None,
                                token_ids, entries, state.offsets[index] + len(prefix))
    state.offsets[index] += len(prefix)
    if logprobs is not None:
        state.offsets[index] = logprobs.text_offset[-1] + len(logprobs.tokens[-1]) if logprobs.tokens else state.offsets[index]
    return CompletionChoice(
        index=index,
        text=prefix + text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        prompt_token_ids=prompt[1] if body.return_token_ids and first else None,
        token_ids=token_ids if body.return_token_ids else None,
    )


async def _stream(
    ctx: ServerContext, body: CompletionRequest, model: str, request_id: str,
    prompts: list[Prompt], group: RequestGroup,
) -> AsyncIterator[str]:
    state = _StreamState(len(group.request_ids))
    try:
        async with group:  # a client that disconnects cancels us here: its requests are aborted
            async for index, output in group:
                choice = _stream_choice(ctx, body, prompts, state, index, output)
                yield sse(CompletionResponse(id=request_id, model=model, choices=[choice]))
                check_not_failed(output)
        if body.stream_options is not None and body.stream_options.include_usage:
            usage = _usage(prompts, state.completion_tokens)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 is already sent
        yield sse_error(exc)
    yield SSE_DONE
