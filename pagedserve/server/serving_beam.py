"""`use_beam_search: true` on /v1/completions and /v1/chat/completions (vLLM's extra, issue #37.6).

The engine runs the search (engine/beam_search.py: beams share KV blocks, transformers'
generate(num_beams=n, early_stopping=True) step for step); this module maps the request
onto it and its result onto choices. As in vLLM: `n` is the beam width and the response
has the n best sequences, best first; `length_penalty` divides each score by
generated_len ** length_penalty; the beams rank the model's own logprobs, so temperature,
top_p, top_k, min_p and seed do not change them. The result comes whole: `stream` is a 400
(vLLM's stream of a beam search also arrives in one piece, at the end).

Fields that would change a sampled output and that the search does not apply (stop
strings, penalties, logprobs, output constraints, tools) are 400s naming them, never
silently dropped.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from pagedserve.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagedserve.server.errors import APIError, bad_request, known_failure
from pagedserve.server.protocol import SamplingRequest, Usage, random_id
from pagedserve.server.serving_common import RETRY_AFTER_S, ClientDisconnected, ServerContext

# How often the handler asks the engine thread whether the search has finished.
RESULT_POLL_S = 0.01
MAX_BEAM_WIDTH = 10  # BeamSearchParams' bound

# field -> its value when it does not ask for anything (absent, default, or empty)
_NOT_APPLIED: dict[str, tuple[Any, ...]] = {
    "stream": (False,), "stop": (None, []), "stop_token_ids": (None, []), "min_tokens": (0,),
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}), "bad_words": (None, []), "allowed_token_ids": (None,), "prompt_logprobs": (None,),
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False,), "response_format": (None,),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,), "include_stop_str_in_output": (False,), "cache_salt": (None,),
    "tools": (None, []),
}


def wants_beam_search(body: SamplingRequest) -> bool:
    """True for a beam-search request; refuses the beam fields on a sampled one (they
    would otherwise be silently ignored)."""
    if body.use_beam_search:
        return True
    if body.length_penalty != 1.0:
        raise APIError(400, "length_penalty applies to beam search only: set use_beam_search: true",
                       "length_penalty")
    return False


def beam_params(body: SamplingRequest, max_tokens: int) -> BeamSearchParams:
    """The engine's parameters for `body`; a 400 naming the first field the search cannot honour."""
    declared = type(body).model_fields
    for name, inert in _NOT_APPLIED.items():
        if name not in declared:
            continue
        value = getattr(body, name)
        if not any(value == ok and type(value) is type(ok) for ok in inert):
            raise APIError(400, f"{name}: not applied by beam search (use_beam_search: true); leave it out", name)
    if getattr(body, "best_of", None) not in (None, body.n):
        raise APIError(400, "best_of: beam search returns its n best beams (n is the beam width); leave best_of out",
                       "best_of")
    if body.early_stopping is False:
        raise APIError(400, "early_stopping: only true is implemented (the search ends once n hypotheses have "
                       "finished, transformers' early_stopping=True)", "early_stopping")
    if body.n > MAX_BEAM_WIDTH:
        raise APIError(400, f"n: the beam width must be <= {MAX_BEAM_WIDTH} with use_beam_search", "n")
    return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                            length_penalty=body.length_penalty)


async def run_beam_search(
    ctx: ServerContext, raw_request: Request, prompt: dict[str, Any], params: BeamSearchParams, lora: Any,
    what: str,
) -> BeamSearchOutput:
    """Queues the search in the engine thread and waits for its result; a client that leaves,
    or any other exit, aborts it (its beams' blocks return to the pool)."""
    engine = ctx.engine
    if not hasattr(engine, "submit_call"):
        raise APIError(400, "use_beam_search is not served with replicas (--data-parallel-size)", "use_beam_search")
    # The engine's search registers its adapter itself and an unload does not end it: the
    # serving path's adapter guarantees (async_engine._add / _unload) would not hold.
    if lora is not None:
        raise APIError(400, "use_beam_search is not served for LoRA adapters; use the base model", "use_beam_search")
    if ctx.max_queue_len is not None and engine.num_waiting >= ctx.max_queue_len:
        raise APIError(503, f"The server is overloaded: {engine.num_waiting} requests are waiting "
                       f"(--max-queue-len {ctx.max_queue_len}). Retry later.", None, "overloaded",
                       headers={"Retry-After": str(RETRY_AFTER_S)})
    request_id = random_id("beam")

    def add(e: Any) -> None:
        e.add_beam_search(request_id, prompt, params, lora_request=lora)

    def take(e: Any) -> BeamSearchOutput | None:
        return e.beam_search.take(request_id)

    try:
        await asyncio.wrap_future(engine.submit_call(add))
    except ValueError as exc:
        raise APIError(400, f"{what}: {exc}", what) from None
    except Exception as exc:  # noqa: BLE001 - the engine stopped, or the adapter went away
        raise (known_failure(exc) or exc) from None
    finished = False
    try:
        while True:
            result = await asyncio.wrap_future(engine.submit_call(take))
            if result is not None:
                finished = True
                return result
            if await raw_request.is_disconnected():
                raise ClientDisconnected()
            await asyncio.sleep(RESULT_POLL_S)
    except Exception as exc:  # noqa: BLE001
        raise (known_failure(exc) or exc) from None
    finally:
        if not finished:
            _abort(engine, request_id)


def _abort(engine: Any, request_id: str) -> None:
    """Ends the search, or drops its result if it finished after the last look."""
    def drop(e: Any) -> None:
        e.abort_request([request_id])
        e.beam_search.results.pop(request_id, None)

    try:
        engine.submit_call(drop)
    except Exception:  # noqa: BLE001 - a stopped engine has nothing left to end
        pass


async def search_all(
    ctx: ServerContext, body: SamplingRequest, raw_request: Request, prompts: list[list[int]],
    max_tokens: int | None, lora: Any, what: str,
) -> list[BeamSearchOutput]:
    """One search per prompt (run side by side in the engine), after the server's
    context-length check; without max_tokens a search may run to the context length."""
    try:
        for ids in prompts:
            ctx.processor.check_context_length(len(ids), max_tokens, what)
    except ValueError as exc:
        raise bad_request(exc, set(type(body).model_fields)) from None
    params = beam_params(body, max_tokens if max_tokens is not None else ctx.processor.max_model_len)
    searches = [run_beam_search(ctx, raw_request, {"prompt_token_ids": ids}, params, lora, what) for ids in prompts]
    return list(await asyncio.gather(*searches))


def generated(sequence: BeamSearchSequence, prompt: list[int]) -> list[int]:
    return sequence.tokens[len(prompt):]


def decode(ctx: ServerContext, body: SamplingRequest, token_ids: list[int]) -> str:
    if ctx.engine.tokenizer is None:
        return ""
    return ctx.tokenizer.decode(token_ids, skip_special_tokens=body.skip_special_tokens)


def beam_usage(prompts: list[list[int]], outputs: list[BeamSearchOutput]) -> Usage:
    """The returned beams' tokens are billed (the pruned ones are the search's own cost, as in vLLM)."""
    prompt_tokens = sum(len(ids) for ids in prompts)
    completion_tokens = sum(len(generated(seq, ids)) for ids, out in zip(prompts, outputs, strict=True)
                            for seq in out.sequences)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)
