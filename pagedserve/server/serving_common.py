"""What the completion and chat handlers share: input processing, submission, collection, SSE.

One HTTP call is one engine request per prompt, with the call's n / best_of in its
SamplingParams: the engine runs the samples on the prompt's shared KV blocks and tags each
output with its sample (`CompletionOutput.index`). Choice index = prompt index * n + sample
index (OpenAI's order: every choice of prompt 0, then of prompt 1).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestGroup
from pagedserve.engine.input_processor import EngineInput, InputProcessor
from pagedserve.lora.request import AdapterNotRegisteredError, LoRARequest
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError, bad_request, known_failure
from pagedserve.server.lora_admin import LoRARegistry
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.protocol import PromptTokensDetails
from pagedserve.server.request_fields import RequestFields
from pagedserve.structured_outputs import GrammarError
from pagedserve.structured_outputs.manager import STARTED_POLL_S, started

SSE_DONE = "data: [DONE]\n\n"
# How often a non-streaming handler checks that its client is still there.
DISCONNECT_POLL_S = 0.2
# What a client that hit --max-queue-len is told to wait before retrying (seconds).
RETRY_AFTER_S = 1

T = TypeVar("T")


@dataclass
class ServerContext:
    """Everything a handler needs; one per app (app.state.ctx)."""

    engine: AsyncLLMEngine
    model_names: list[str]
    model_path: str
    metrics: ServerMetrics
    # None: no auth; else any of these keys (a str is one key).
    api_key: str | list[str] | None = None
    chat_template: str | None = None
    # --chat-template-content-format and --default-chat-template-kwargs (a request's own
    # chat_template_kwargs win key by key).
    chat_template_content_format: str = "auto"
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_queue_len: int | None = None
    loras: LoRARegistry = field(default_factory=LoRARegistry)
    # Tokenization and chat templates run here, off the event loop. One worker: HF fast
    # tokenizers are not meant to be called from several threads at once.
    tokenize_pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenize")
    )
    # The model's generation_config.json sampling fields: what a request that omits them gets.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    # tool_choice "auto": parse the model's text into tool_calls with this parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser: reasoning text out of chat content (pagedserve/reasoning/).
    reasoning_parser: str | None = None
    # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (vLLM's flag).
    enable_prompt_tokens_details: bool = False
    # What an undeclared request field gets (--strict-request-fields: a 400).
    request_fields: RequestFields = field(default_factory=RequestFields)

    def resolve_model(self, model: str | None) -> str:
        """The served name to echo back (the base model's or an adapter's); 404 if unknown."""
        if model is None:
            return self.model_names[0]
        if model not in self.model_names and model not in self.loras.adapters:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")
        return model

    def lora_for(self, model: str) -> LoRARequest | None:
        return self.loras.adapters.get(model)

    @property
    def processor(self) -> InputProcessor:
        """The engine's input processor; handlers call it in the tokenize worker (`off_loop`)."""
        return self.engine.input_processor

    @property
    def tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise APIError(400, "this server has no tokenizer; send prompts as token ids", "prompt")
        return self.engine.tokenizer

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs a tokenizer / template call in the tokenize worker, keeping the event loop free."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize_pool, lambda: fn(*args, **kwargs))

    async def process_off_loop(self, body: BaseModel, fn: Callable[..., T], *args: Any) -> T:
        """`off_loop` for input processing: an invalid input is a 400 naming its field."""
        try:
            return await self.off_loop(fn, *args)
        except ValueError as exc:
            raise bad_request(exc, set(type(body).model_fields)) from None


class ClientDisconnected(APIError):
    def __init__(self) -> None:
        super().__init__(499, "client disconnected")


def make_params(
    body: Any,
    max_tokens: int | None,
    logprobs: int | None,
    defaults: dict[str, Any] | None = None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs, defaults, prompt_logprobs)
    except ValueError as exc:
        raise bad_request(exc, set(type(body).model_fields)) from None


async def compile_constraint(ctx: ServerContext, params: SamplingParams, param: str | None) -> None:
    """Compiles the request's grammar in a compile worker before it is queued (the engine
    then finds it cached), so a bad or too slow constraint is a 400 naming `param` and no
    grammar is ever compiled inside an engine step."""
    spec = params.structured_outputs
    if spec is None:
        return
    manager = ctx.engine.structured_outputs
    if manager is None:
        raise APIError(400, f"{param}: structured outputs need a tokenizer", param)
    future = manager.compile_async(spec)
    cached = future.done()  # however long it once took, it is ready now
    # Queued behind other clients' compiles is not this request's time: its deadline runs
    # from when a worker takes it.
    queued_until = time.monotonic() + manager.max_queue_wait_s
    while not started(future):
        if time.monotonic() > queued_until:
            raise APIError(503, manager.queue_full_message(param or "constraint"), param, "overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        await asyncio.sleep(STARTED_POLL_S)
    try:
        # shield: a timeout here must not cancel the shared, cached compilation (it finishes
        # into the cache on its worker).
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), max(0.0, manager.time_left(future)))
    except TimeoutError:
        raise APIError(400, manager.timeout_message(param or "constraint"), param) from None
    except GrammarError as exc:
        raise APIError(400, f"{param}: {exc}", param) from None
    if not cached and manager.time_left(future) < 0:
        raise APIError(400, manager.timeout_message(param or "constraint"), param)


async def process(
    ctx: ServerContext,
    body: BaseModel,
    prompts: list[dict[str, Any]],
    params: SamplingParams | PoolingParams,
    max_tokens: int | None,
    what: str,
) -> list[EngineInput]:
    """The engine inputs of the call's tokenized prompts (`prompt_token_ids`, and `prompt`
    if given as text), processed in the tokenize worker. The server also refuses a prompt
    whose max_tokens do not fit (vLLM's server does; its offline LLM caps them)."""
    processor = ctx.processor
    priority = getattr(body, "priority", 0)  # vLLM's extra field (lower runs first)

    def run() -> list[EngineInput]:
        for prompt in prompts:
            processor.check_context_length(len(prompt["prompt_token_ids"]), max_tokens, what)
        return [processor.process(prompt, params, priority) for prompt in prompts]

    return await ctx.process_off_loop(body, run)


async def submit(
    ctx: ServerContext,
    body: BaseModel,
    inputs: list[EngineInput],
    arrival: float,
    lora_request: LoRARequest | None = None,
) -> RequestGroup:
    """Adds the processed requests to the engine as one group; its refusals become 400s."""
    engine = ctx.engine
    if ctx.max_queue_len is not None and engine.num_waiting >= ctx.max_queue_len:
        raise APIError(
            503, f"The server is overloaded: {engine.num_waiting} requests are waiting "
            f"(--max-queue-len {ctx.max_queue_len}). Retry later.", None, "overloaded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    try:
        return await engine.add_requests([(item, None) for item in inputs], arrival_time=arrival,
                                         lora_request=lora_request)
    except ValueError as exc:
        raise bad_request(exc, set(type(body).model_fields)) from None
    except (EngineDeadError, AdapterNotRegisteredError) as exc:
        raise known_failure(exc) from None  # type: ignore[misc]


@dataclass
class ChoiceState:
    """One choice (a sample of a prompt), accumulated from its delta outputs (or from the
    one final output of a best_of > n request)."""

    prompt_token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    token_counts: list[int] = field(default_factory=list)  # tokens of each piece of `text`
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # of its prompt, found in the prefix cache

    def add(self, output: RequestOutput, completion: CompletionOutput) -> None:
        self.prompt_token_ids = output.prompt_token_ids
        self.num_cached_tokens = output.num_cached_tokens
        self.text.append(completion.text)
        self.token_counts.append(len(completion.token_ids))
        self.token_ids.extend(completion.token_ids)
        self.logprobs.extend(completion.logprobs or ())
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason

    @property
    def full_text(self) -> str:
        return "".join(self.text)


def choice_index(request_index: int, completion: CompletionOutput, n: int) -> int:
    """The OpenAI choice index of one sample: every choice of prompt 0, then of prompt 1."""
    return request_index * n + completion.index


@dataclass
class Collected:
    """A non-streamed call's choices, and what it generated (best_of's dropped samples too)."""

    choices: list[ChoiceState]
    num_generated_tokens: int


async def collect(group: RequestGroup, raw_request: Request, n: int) -> Collected:
    """Waits for every request of the group, aborting them all if the client goes away."""
    states = [ChoiceState() for _ in range(len(group.request_ids) * n)]
    generated = [0]

    async def consume() -> None:
        async for index, output in group:
            for completion in output.outputs:
                states[choice_index(index, completion, n)].add(output, completion)
                generated[0] += len(completion.token_ids)
            if output.num_generated_tokens is not None:  # best_of: the samples not returned too
                generated[0] += output.num_generated_tokens - sum(len(c.token_ids) for c in output.outputs)

    async with group:  # aborts the unfinished requests however we leave
        await watch_client(raw_request, consume())
    for state in states:
        if state.finish_reason == "error":
            raise request_failed(state.stop_reason)
    _share_prompt_logprobs(states, n)
    return Collected(states, generated[0])


async def watch_client(raw_request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Awaits `work` (consuming a group), checking every DISCONNECT_POLL_S that the client is
    still there; ClientDisconnected if it left (the caller's `async with group` then aborts).
    Every non-streamed handler waits through here, so no abandoned call keeps the engine busy."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await raw_request.is_disconnected():
                raise ClientDisconnected()
    finally:
        task.cancel()


def _share_prompt_logprobs(states: list[ChoiceState], n: int) -> None:
    """Only the sample that prefilled computed its prompt's logprobs; they are every sample's."""
    for start in range(0, len(states), n):
        found = next((s.prompt_logprobs for s in states[start : start + n] if s.prompt_logprobs is not None), None)
        for state in states[start : start + n]:
            state.prompt_logprobs = found


def request_failed(reason: object) -> APIError:
    """The 500 of a request the engine ended with finish_reason "error" (the engine lives on)."""
    return APIError(500, f"the request failed in the engine: {reason}", None, "request_failed")


def check_not_failed(completion: CompletionOutput) -> None:
    """In a stream: a sample that ended with "error" ends the stream with an error chunk."""
    if completion.finish_reason == "error":
        raise request_failed(completion.stop_reason)


def cached_details(enabled: bool, num_cached_tokens: int) -> PromptTokensDetails | None:
    """usage.prompt_tokens_details when --enable-prompt-tokens-details is on, else None."""
    return PromptTokensDetails(cached_tokens=num_cached_tokens) if enabled else None


def continuous_usage(body: Any) -> bool:
    """stream_options.continuous_usage_stats (with include_usage): usage in every chunk."""
    options = body.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


def sse(chunk: BaseModel | dict[str, Any]) -> str:
    data = chunk.model_dump_json() if isinstance(chunk, BaseModel) else _dumps(chunk)
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the stream started: an error chunk (the [DONE] follows)."""
    known = known_failure(exc)
    if known is not None:
        return sse(known.body())
    return sse(APIError(500, f"internal error: {exc!r}").body())


def _dumps(obj: dict[str, Any]) -> str:
    return json.dumps(obj, separators=(",", ":"))


# A token the grammar forbade has logprob -inf, which JSON cannot carry; vLLM reports -9999.
MIN_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def token_text(token_id: int, entry: dict[int, Logprob], as_id: bool = False) -> str:
    """A logprob's token as text; `as_id` (vLLM's return_tokens_as_token_ids): "token_id:N",
    which stays unambiguous where a token is not valid UTF-8 on its own."""
    if as_id:
        return f"token_id:{token_id}"
    logprob = entry.get(token_id)
    decoded = logprob.decoded_token if logprob is not None else None
    return decoded if decoded is not None else f"token_id:{token_id}"
