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

from collections.abc import Callable
from dataclasses import dataclass


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
