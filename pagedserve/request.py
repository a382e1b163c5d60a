"""A request as plain data: token ids, counters, status, sampling params. No tensors."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.pooling_params import PoolingParams
    from pagedserve.structured_outputs.manager import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    Token accounting (the scheduler's only view of progress):

        all_token_ids = prompt_token_ids + output_token_ids
        |<------------- num_tokens ------------->|
        |<--- num_computed_tokens --->|          |
          K/V already in the cache      scheduled next (a prefill chunk, or the
                                        one token sampled last step)

    After a recompute preemption num_computed_tokens drops to 0 and the prompt plus
    the outputs so far are prefilled again; nothing special-cases that.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None
    # Output budget: max_tokens, capped so that prompt + output fits max_model_len.
    max_output_tokens: int = 16
    # Which LoRA adapter to use (0 = base model); part of the prefix-cache key.
    lora_id: int = 0
    # Requests share cached KV blocks only with requests of the same salt.
    cache_salt: str | None = None
    # Lower runs first under the priority scheduling policy (vLLM's semantics); 0 by default.
    priority: int = 0
    # SamplingParams.bad_words as token sequences (each word with and without a leading space).
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # Prompt tokens whose KV came from the prefix cache at (last) admission.
    num_cached_tokens: int = 0
    # For one sample of an n/best_of request: its group's id and its index in the group.
    group_id: str | None = None
    sample_index: int = 0
    # Beam search chooses this request's tokens itself (the engine's BeamGroup).
    is_beam: bool = False
    # Structured outputs: this sequence's grammar matcher (an opaque handle; the model
    # runner asks it for the allowed tokens), None when the output is free.
    grammar: RequestGrammar | None = None
    # An embedding request (LLM.embed, /v1/embeddings): the runner hands back the last prompt
    # token's hidden state; it ends after its prompt.
    pooling: PoolingParams | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    # Per generated token: (token ids of top-k + chosen, their logprobs, ranks), when asked.
    logprobs: list[tuple[list[int], list[float], list[int]]] = field(default_factory=list)
    first_scheduled_time: float | None = None
    # Tokens a proposer guessed follow this request, verified by its next decode step
    # (speculative decoding); taken (and cleared) by the scheduler.
    spec_token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output, without concatenating both."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Sets a finished status if the last token ends the request; True if it did.

        Stop strings need the detokenized text, so the output processor checks those.
        """
        params = self.sampling_params
        at_length = self.num_output_tokens >= self.max_output_tokens
        if self.num_output_tokens >= params.min_tokens:
            last = self.output_token_ids[-1]
            # EOS / stop ids win over length when both happen on the same token, as in vLLM.
            if not params.ignore_eos and last == self.eos_token_id:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if at_length:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
