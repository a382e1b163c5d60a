"""Turns requests' new tokens into RequestOutputs: detokenization, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.engine.detokenizer import IncrementalDetokenizer, TokenTextCache
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.worker.prompt_logprobs import PromptLogprobs


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    # Characters of `text` already handed out (delta mode) — held back while a stop
    # string might be starting at the end.
    num_emitted_chars: int = 0
    num_emitted_tokens: int = 0
    logprobs: list[dict[int, Logprob]] | None = None
    # vLLM's shape: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    pooled: list[float] | None = None
    metrics: RequestMetrics | None = None
    extra: dict = field(default_factory=dict)
    lora_request: Any = None  # the request's LoRARequest, echoed in its outputs


class OutputProcessor:
    def __init__(self, tokenizer: Any | None) -> None:
        self._states: dict[str, _RequestState] = {}
        self.set_tokenizer(tokenizer)

    def set_tokenizer(self, tokenizer: Any | None) -> None:
        """Text for requests added from now on; those running keep their detokenizers."""
        self.tokenizer = tokenizer
        self._token_text = TokenTextCache(tokenizer) if tokenizer is not None else None

    def add_request(self, request: Request, lora_request: Any = None) -> None:
        params = request.sampling_params
        detok = None
        if self.tokenizer is not None and params.detokenize:
            detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        self._states[request.request_id] = _RequestState(
            detokenizer=detok,
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            metrics=RequestMetrics(arrival_time=request.arrival_time),
            lora_request=lora_request,
        )

    def set_pooled(self, request: Request, vector: list[float]) -> None:
        state = self._states.get(request.request_id)
        if state is not None:
            state.pooled = vector

    def add_prompt_logprobs(self, request: Request, chunk: PromptLogprobs) -> None:
        """Records a prefill chunk's prompt logprobs. Positions already recorded (a chunk
        computed again after a recompute preemption) are skipped."""
        state = self._states.get(request.request_id)
        if state is None or state.prompt_logprobs is None:
            return
        first, ids, values, ranks = chunk
        for position, row in enumerate(zip(ids, values, ranks, strict=True), start=first):
            # Position p predicts prompt token p + 1, the list's entry p + 1.
            if position + 1 == len(state.prompt_logprobs):
                state.prompt_logprobs.append(self._logprob_entry(*row))

    def process_token(
        self,
        request: Request,
        logprobs: tuple[list[int], list[float], list[int]] | None,
        now: float,
        index: int = -1,
    ) -> bool:
        """Records the request's output token at `index` (default the newest; a speculative
        run gives several per step, processed in order). Returns True if a stop string ended it."""
        state = self._states[request.request_id]
        token_id = request.output_token_ids[index]
        is_last = index in (-1, request.num_output_tokens - 1)
        if state.metrics is not None:
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
            state.metrics.last_token_time = now
        if logprobs is not None:
            ids, values, ranks = logprobs
            request.cumulative_logprob += values[0]
            if state.logprobs is not None:
                state.logprobs.append(self._logprob_entry(ids, values, ranks))
        if state.detokenizer is None:
            return False
        # A stop token id that ends the request is not part of the text (vLLM's behaviour).
        ended_here = is_last and request.status.finished
        if ended_here and request.stop_reason == token_id:
            return False
        if ended_here and token_id == request.eos_token_id and not request.sampling_params.ignore_eos:
            return False
        state.text += state.detokenizer.add(token_id)
        return self._check_stop_strings(request, state)

    def _logprob_entry(self, ids: list[int], values: list[float], ranks: list[int]) -> dict[int, Logprob]:
        decode = self._token_text
        entry: dict[int, Logprob] = {}
        for token_id, value, rank in zip(ids, values, ranks, strict=True):
            if token_id not in entry:
                entry[token_id] = Logprob(value, rank, decode(token_id) if decode else None)
        return entry

    def _check_stop_strings(self, request: Request, state: _RequestState) -> bool:
        params = request.sampling_params
        stops = params.stop_strings
        if not stops or request.num_output_tokens < params.min_tokens:
            return False
        # Only the tail can hold a new match: the last delta plus a stop string's length.
        window_start = max(0, len(state.text) - max(len(s) for s in stops) - 16)
        best = None
        for stop in stops:
            index = state.text.find(stop, window_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return False
        index, stop = best
        state.text = state.text[: index + len(stop) if params.include_stop_str_in_output else index]
        request.stop_reason = stop
        return True

    def make_output(self, request: Request, finished: bool) -> RequestOutput:
        state = self._states[request.request_id]
        params = request.sampling_params
        delta = params.output_kind == "delta"
        text_end = len(state.text)
        if not finished and params.stop_strings and not params.include_stop_str_in_output:
            # Hold back what could be the start of a stop string.
            text_end = max(state.num_emitted_chars, text_end - max(len(s) for s in params.stop_strings) + 1)
        token_ids = request.output_token_ids
        logprobs = state.logprobs
        text = state.text[:text_end]
        if delta:
            text = state.text[state.num_emitted_chars : text_end]
            token_ids = token_ids[state.num_emitted_tokens :]
            logprobs = logprobs[state.num_emitted_tokens :] if logprobs is not None else None
            state.num_emitted_chars = text_end
            state.num_emitted_tokens = request.num_output_tokens
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None and delta:
            # Streaming: once, with the first output (the prompt is complete by then).
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = True
        status = request.status
        if finished and not status.finished:
            status = RequestStatus.FINISHED_STOPPED
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=request.cumulative_logprob if state.logprobs is not None else None,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=status.finish_reason if finished else None,
            stop_reason=request.stop_reason if finished else None,
        )
        if finished and state.metrics is not None:
            state.metrics.num_preemptions = request.num_preemptions
            state.metrics.first_scheduled_time = request.first_scheduled_time
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=state.metrics,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            lora_request=state.lora_request,
            pooled=state.pooled,
        )

    def finish(self, request_id: str, now: float) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.metrics is not None:
            state.metrics.finished_time = now

    def has(self, request_id: str) -> bool:
        return request_id in self._states
