"""Per-step wall-clock timings of `LLMEngine.step()`, handed to step hooks.

The step's batch: `num_seqs` requests, `num_tokens` tokens through the model,
`context_tokens` K/V rows the attention reads (each request's whole context, once),
`attended_keys` (query, key) pairs it scores, summed over requests, and `logits_rows` rows
the LM head runs on (one per sampling request, fork and proposal; none for a prompt chunk
that does not end its prompt).

One step, in order (each field in seconds):

    schedule_s   Scheduler.schedule()
    prepare_s    the runner's input tensors and attention metadata
    forward_s    the model forward over the flat batch and the LM head on the sampled rows
    sample_s     sampling metadata, the sampler, the one host sync and its Python lists
    update_s     Scheduler.update_from_output (+ beam search decisions)
    output_s     detokenizing, stop strings and RequestOutputs
    total_s      the whole step (the parts plus the glue between them)

`overhead_s` = total_s - forward_s: everything the engine spends outside the model (the
quantity issue 18 bounds at 10% of a batch-1 step). On CPU every op is synchronous, so a
timer around a part measures that part; on a GPU, forward_s would include only the
launches and sample_s the wait for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class StepTimings:
    num_seqs: int
    num_tokens: int
    context_tokens: int
    attended_keys: int
    logits_rows: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    update_s: float
    output_s: float
    total_s: float

    @property
    def overhead_s(self) -> float:
        """Seconds outside the model forward (schedule, inputs, sampling, outputs, glue)."""
        return self.total_s - self.forward_s


StepHook = Callable[[StepTimings], None]


def attention_work(chunks: list[tuple[int, int]]) -> tuple[int, int]:
    """(context_tokens, attended_keys) of a step whose requests run (computed, new) tokens:
    new queries at positions computed .. computed + new - 1, each attending causally."""
    context = keys = 0
    for computed, new in chunks:
        context += computed + new
        keys += new * computed + new * (new + 1) // 2
    return context, keys


class StepTimer:
    """Marks one step's phases and hands its `StepTimings` to the hooks (no work without hooks)."""

    __slots__ = ("_hooks", "_start", "_scheduled", "_ran", "_updated")

    def __init__(self, hooks: list[StepHook]) -> None:
        self._hooks = hooks
        self._start = self._scheduled = self._ran = self._updated = time.perf_counter()

    def mark_scheduled(self) -> None:
        self._scheduled = time.perf_counter()

    def mark_ran(self) -> None:
        self._ran = time.perf_counter()

    def mark_updated(self) -> None:
        self._updated = time.perf_counter()

    def finish(self, sched_out: Any, runner_out: Any) -> None:
        """After a step that ran the model: calls every hook with its timings."""
        if not self._hooks or not sched_out.scheduled:
            return
        end = time.perf_counter()
        context, keys = attention_work([(item.num_computed_tokens, item.num_new_tokens) for item in sched_out.scheduled])
        timings = StepTimings(
            num_seqs=len(sched_out.scheduled), num_tokens=sched_out.num_batched_tokens,
            context_tokens=context, attended_keys=keys,
            logits_rows=sum(item.num_logits_rows for item in sched_out.scheduled if item.sample),
            schedule_s=self._scheduled - self._start, prepare_s=runner_out.prepare_s,
            forward_s=runner_out.forward_s, sample_s=runner_out.sample_s,
            update_s=self._updated - self._ran, output_s=end - self._updated, total_s=end - self._start,
        )
        for hook in self._hooks:
            hook(timings)


@dataclass(slots=True)
class StepCounters:
    """The engine's running totals (vLLM's *_total metrics), kept out of the step itself."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    last_step_tokens: int = 0

    def record_step(self, sched_out: Any) -> None:
        """After the scheduler took the step's tokens."""
        self.steps += 1
        self.last_step_tokens = sched_out.num_batched_tokens
        # A prompt counts once, when its request gets its first token (not again after a
        # recompute preemption), as vLLM's prompt_tokens_total does.
        for item in sched_out.scheduled:
            if item.sample and item.request.num_output_tokens == 1:
                self.prompt_tokens += item.request.num_prompt_tokens
