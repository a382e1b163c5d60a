"""What the scheduler tells the model runner to do in one step: integers and lists only."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.protocols import AdapterPlacement
from pagedserve.request import Request


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes K/V for tokens [num_computed_tokens, num_computed_tokens + num_new_tokens)
    and samples a token only if that range reaches the end of the request (`sample`).

    With speculative decoding the range ends in `spec_token_ids`, proposed tokens that
    are not part of the request yet (num_new_tokens counts them):

        position:  num_computed_tokens    +1 ..           +len(spec_token_ids)
        token:     last sampled token     spec_token_ids
        logits:    one row per position, each checks the next proposal; the last is the bonus
    """

    request: Request
    num_computed_tokens: int
    num_new_tokens: int
    block_table: list[int]
    sample: bool
    # Sibling samples (n/best_of) that draw their first token from this request's logits
    # row this step, then fork its blocks. Empty except on a group's first sampling step.
    fork_requests: list[Request] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_logits_rows(self) -> int:
        """Logits rows this request samples from when `sample`: its own, one per fork, and
        one per proposed token (verification)."""
        return 1 + len(self.fork_requests) + len(self.spec_token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    # Block copies to apply before the forward pass, in this order: swap-out
    # (device, host) pairs, swap-in (host, device) pairs, copy-on-write (src, dst) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Requests preempted this step (their blocks are already free).
    preempted_ids: list[str] = field(default_factory=list)
    # Requests that finished since the last step, so the runner can drop per-request state.
    finished_ids: list[str] = field(default_factory=list)
    # LoRA: where the adapter of each scheduled request lives (lora_id -> its KV blocks),
    # from the scheduler's `AdapterResidency`; empty when LoRA is off or unused this step.
    lora_adapters: dict[int, AdapterPlacement] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
