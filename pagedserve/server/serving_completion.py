"""POST /v1/completions: one engine request per prompt, its n / best_of samples run by the engine.

Engine request k serves prompt k; its sample i is choice k * n + i (OpenAI's order: all
choices of prompt 0, then prompt 1). With best_of > n the engine ranks the samples by
cumulative logprob and reports the best n, re-indexed 0..n-1 (not streamable).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedserve.engine.async_engine import RequestGroup
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprob,
    PromptTokensDetails,
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
    SSE_DONE,
    Collected,
    ServerContext,
    cached_details,
    check_not_failed,
    choice_index,
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

# One HTTP call may run at most this many sequences (prompts x samples).
MAX_ENGINE_REQUESTS = 1024

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


async def create_completion(ctx: ServerContext, body: CompletionRequest, raw_request: Request) -> Response:
    arrival = time.monotonic()
    model = ctx.resolve_model(body.model)
    # Resolved once, now: an unload meanwhile makes the submission a 404, never the base model.
    lora = ctx.lora_for(model)
    _check_fields(body)
    prompts = _truncated(ctx, body, await _prompts(ctx, body, body.prompt))
    num_samples = body.best_of or body.n
    if len(prompts) * num_samples > MAX_ENGINE_REQUESTS:
        raise APIError(400, f"n: prompts x samples must be <= {MAX_ENGINE_REQUESTS}", "n")
    if wants_beam_search(body):
        return await _beam_search(ctx, body, raw_request, model, prompts, lora)
    # echo with max_tokens=0 scores the prompt only: the engine generates one token, dropped.
    max_tokens = 1 if _echo_only(body) else body.max_tokens
    params = make_params(body, max_tokens, body.logprobs, ctx.sampling_defaults, _engine_prompt_logprobs(body))
    constraint = body.output_constraint()
    await compile_constraint(ctx, params, constraint[1] if constraint is not None else None)
    engine_prompts = [{"prompt": text, "prompt_token_ids": ids, **salt(body)} for text, ids in prompts]
    inputs = await process(ctx, body, engine_prompts, params, max_tokens, "prompt")
    group = await submit(ctx, body, inputs, arrival, lora)
    request_id = random_id("cmpl")
    if body.stream:
        return StreamingResponse(
            _stream(ctx, body, model, request_id, prompts, group),
            media_type="text/event-stream",
            # Runs even if the client left before the first chunk was produced.
            background=BackgroundTask(group.abort),
        )
    collected = await collect(group, raw_request, body.n)
    return JSONResponse(_response(ctx, body, model, request_id, prompts, collected).model_dump())


async def _beam_search(
    ctx: ServerContext, body: CompletionRequest, raw_request: Request, model: str, prompts: list[Prompt], lora: object,
) -> Response:
    """use_beam_search (serving_beam.py): prompt k's beams are choices k * n .. k * n + n - 1, best first."""
    ids = [prompt_ids for _, prompt_ids in prompts]
    outputs = await search_all(ctx, body, raw_request, ids, body.max_tokens, lora, "prompt")
    choices = []
    for k, (prompt_ids, output) in enumerate(zip(ids, outputs, strict=True)):
        for i, sequence in enumerate(output.sequences):
            token_ids = generated(sequence, prompt_ids)
            choices.append(CompletionChoice(
                index=k * body.n + i, text=decode(ctx, body, token_ids), finish_reason=sequence.finish_reason,
                prompt_token_ids=prompt_ids if body.return_token_ids else None,
                token_ids=token_ids if body.return_token_ids else None,
            ))
    response = CompletionResponse(id=random_id("cmpl"), model=model, choices=choices, usage=beam_usage(ids, outputs))
    return JSONResponse(response.model_dump())


def _check_fields(body: CompletionRequest) -> None:
    # best_of >= n, and best_of > n not streamed: SamplingParams and the input processor.
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options can only be set when stream is true", "stream_options")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens must be >= 1 (0 only with echo=true, to score the prompt)", "max_tokens")
    if body.stream and body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs are not available when stream is enabled", "prompt_logprobs")


def _truncated(ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt]) -> list[Prompt]:
    """truncate_prompt_tokens, cut here so that usage, echo and the context-length check see
    the kept tokens only (vLLM's); a cut prompt's text is no longer what runs, so echo
    decodes the kept ids instead."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompts
    kept_prompts: list[Prompt] = []
    for text, ids in prompts:
        kept = ctx.processor.truncate_prompt(ids, keep)
        kept_prompts.append((text if len(kept) == len(ids) else None, kept))
    return kept_prompts


def salt(body: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """The engine prompt's cache_salt entry: requests share prefix-cache blocks only when
    their salts are equal (the salt seeds the block hash chain)."""
    return {"cache_salt": body.cache_salt} if body.cache_salt is not None else {}


def _echo_only(body: CompletionRequest) -> bool:
    return body.echo and body.max_tokens == 0


def _engine_prompt_logprobs(body: CompletionRequest) -> int | None:
    """echo with logprobs reports the prompt's tokens too, so it needs their logprobs (vLLM)."""
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


async def _prompts(
    ctx: ServerContext, body: CompletionRequest, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[Prompt]:
    """Normalizes the four prompt shapes; text is tokenized by the input processor in the
    tokenize worker (off the event loop), which first refuses any text too long to fit."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        return [(None, list(prompt))]  # type: ignore[arg-type]
    items = list(prompt)
    processor = ctx.processor
    return await ctx.process_off_loop(body, lambda: [processor.tokenize(item) for item in items])  # type: ignore[arg-type]


def _echo_text(ctx: ServerContext, prompt: Prompt) -> str:
    text, ids = prompt
    if text is not None:
        return text
    return ctx.tokenizer.decode(ids) if ctx.engine.tokenizer is not None else ""


def _logprobs(
    ctx: ServerContext, entries: list[dict[int, Logprob] | None], token_ids: list[int], offset: int, num_top: int,
    as_ids: bool = False,
) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for `token_ids`. An entry is None for the prompt's first token
    (nothing predicts it); each entry lists its token first, then the top `num_top`."""
    out = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        if entry is None:
            text = f"token_id:{token_id}" if as_ids else _decode_one(ctx, token_id)
            out.tokens.append(text)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            text = token_text(token_id, entry, as_ids)
            out.tokens.append(text)
            out.token_logprobs.append(json_logprob(entry[token_id].logprob) if token_id in entry else None)
            top = list(entry.items())[: num_top + 1]
            out.top_logprobs.append({token_text(t, entry, as_ids): json_logprob(lp.logprob) for t, lp in top})
        out.text_offset.append(offset)
        offset += len(text)
    return out


def _decode_one(ctx: ServerContext, token_id: int) -> str:
    tokenizer = ctx.engine.tokenizer
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def prompt_logprobs_out(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's `prompt_logprobs` (completions' choices, chat's response): per prompt token,
    None for the first (nothing predicts it), else its token and the top k by token id."""
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
    return _logprobs(ctx, entries, token_ids, offset, body.logprobs, body.return_tokens_as_token_ids)


def _response(
    ctx: ServerContext, body: CompletionRequest, model: str, request_id: str,
    prompts: list[Prompt], collected: Collected,
) -> CompletionResponse:
    choices = []
    for index, state in enumerate(collected.choices):
        prompt = prompts[index // body.n]
        prefix = _echo_text(ctx, prompt) if body.echo else ""
        if _echo_only(body):
            state.text, state.token_ids, state.logprobs = [], [], []
        choices.append(CompletionChoice(
            index=index,
            text=prefix + state.full_text,
            logprobs=_choice_logprobs(ctx, body, prompt[1], state.prompt_logprobs, state.token_ids,
                                      state.logprobs, len(prefix)),
            prompt_logprobs=prompt_logprobs_out(state.prompt_logprobs) if body.prompt_logprobs is not None else None,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
            prompt_token_ids=prompt[1] if body.return_token_ids else None,
            token_ids=state.token_ids if body.return_token_ids else None,
        ))
    # Every sample is generated, so every sample counts (best_of's dropped ones too, as
    # OpenAI bills them); echo with max_tokens=0 returns no generated token and bills none.
    completion_tokens = 0 if _echo_only(body) else collected.num_generated_tokens
    # Each prompt is one engine request: its samples share (and report) its cache hits.
    cached = sum(state.num_cached_tokens for state in collected.choices[::body.n])
    details = cached_details(ctx.enable_prompt_tokens_details, cached)
    return CompletionResponse(
        id=request_id, model=model, choices=choices, usage=_usage(prompts, completion_tokens, details)
    )


def _usage(prompts: list[Prompt], completion_tokens: int, details: PromptTokensDetails | None = None) -> Usage:
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=details,
    )


class _StreamState:
    """Per-choice progress of one streamed call."""

    def __init__(self, num_prompts: int, n: int) -> None:
        self.started = [False] * (num_prompts * n)
        self.offsets = [0] * (num_prompts * n)  # text_offset of the next token, per choice
        # Per prompt: only its prefilling sample's first output carries them.
        self.prompt_logprobs: list[list | None] = [None] * num_prompts
        self.completion_tokens = 0
        self.choice_tokens = [0] * (num_prompts * n)  # generated so far, per choice
        self.cached = [0] * num_prompts  # prompt tokens found in the prefix cache, per prompt


def _stream_choice(
    ctx: ServerContext, body: CompletionRequest, prompts: list[Prompt],
    state: _StreamState, request_index: int, output: RequestOutput, completion: CompletionOutput,
) -> CompletionChoice:
    text, token_ids, entries = completion.text, completion.token_ids, completion.logprobs or []
    if _echo_only(body):
        text, token_ids, entries = "", [], []
    state.completion_tokens += len(token_ids)
    index = choice_index(request_index, completion, body.n)
    state.choice_tokens[index] += len(token_ids)
    state.cached[request_index] = output.num_cached_tokens
    prompt = prompts[request_index]
    if output.prompt_logprobs is not None:
        state.prompt_logprobs[request_index] = output.prompt_logprobs
    first = not state.started[index]
    state.started[index] = True
    prefix = _echo_text(ctx, prompt) if first and body.echo else ""
    logprobs = _choice_logprobs(ctx, body, prompt[1], state.prompt_logprobs[request_index] if first else None,
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


def _choice_usage(
    body: CompletionRequest, prompts: list[Prompt], state: _StreamState, request_index: int, index: int
) -> Usage | None:
    """continuous_usage_stats: a chunk's usage is its choice's so far (its prompt, its tokens),
    as vLLM's; the cache hits are in the last usage only, as on chat."""
    if not continuous_usage(body):
        return None
    return _usage([prompts[request_index]], state.choice_tokens[index])


async def _stream(
    ctx: ServerContext, body: CompletionRequest, model: str, request_id: str,
    prompts: list[Prompt], group: RequestGroup,
) -> AsyncIterator[str]:
    state = _StreamState(len(prompts), body.n)
    try:
        async with group:  # a client that disconnects cancels us here: its requests are aborted
            async for request_index, output in group:
                # A delta output carries one sample's new tokens; its choice says which.
                for completion in output.outputs:
                    choice = _stream_choice(ctx, body, prompts, state, request_index, output, completion)
                    yield sse(CompletionResponse(id=request_id, model=model, choices=[choice],
                                                 usage=_choice_usage(body, prompts, state, request_index, choice.index)))
                    check_not_failed(completion)
        if body.stream_options is not None and body.stream_options.include_usage:
            details = cached_details(ctx.enable_prompt_tokens_details, sum(state.cached))
            usage = _usage(prompts, state.completion_tokens, details)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
    except Exception as exc:  # noqa: BLE001 - reported in-band: the 200 is already sent
        yield sse_error(exc)
    yield SSE_DONE
