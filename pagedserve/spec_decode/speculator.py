"""Who speculates, and with what: the engine-side policy around the proposers.

After each step the engine asks the Speculator to propose for the running requests; the
proposals ride on `Request.spec_token_ids` into the next schedule (the scheduler caps
them by budget and KV slots), and the runner verifies them. The Speculator then sees how
many were accepted and turns speculation off where it does not pay:

- by batch size: at `disable_by_batch_size` running requests or more, nobody proposes
  (verification grows every request's share of the forward, while a large batch already
  amortizes the weight reads that speculation saves);
- by acceptance: a request's moving-average acceptance rate below `min_acceptance_rate`
  pauses it for `backoff_steps` of its steps, doubling at each consecutive failure (a
  request whose text turns copy-heavy later gets probed again).

Requests that never speculate: beams (their group picks tokens), requests still before
their first output token, under min_tokens, with penalties or bad_words (those would have
to count the proposals as outputs in every row). Structured-output requests do speculate:
each proposal row's grammar mask follows the proposals before it, and the matcher rolls
back what is rejected (structured_outputs/manager.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.request import Request, RequestStatus
from pagedserve.spec_decode.config import SpeculativeConfig
from pagedserve.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    from pagedserve.core.sched_output import SchedulerOutput
    from pagedserve.spec_decode.draft_model import DraftModelProposer

_EMA_WEIGHT = 0.5  # weight of the newest run in the moving average
_EMA_START = 0.5
_MAX_BACKOFF = 64


@dataclass(slots=True)
class _Acceptance:
    ema: float = _EMA_START
    paused_steps: int = 0
    backoff: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModelProposer | None = None) -> None:
        self.config = config
        self.draft = draft
        self.ngram = None if draft is not None else NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )
        self._acceptance: dict[str, _Acceptance] = {}
        # The last step's verified proposals (for the per-step stats).
        self.last_num_draft_tokens = 0
        self.last_num_accepted_tokens = 0

    def propose(self, running: list[Request]) -> None:
        """Sets `spec_token_ids` on the running requests that speculate next step."""
        for request in running:
            request.spec_token_ids = []
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return
        chosen: list[Request] = []
        room: list[int] = []
        for request in running:
            k = min(self.config.num_speculative_tokens, request.max_output_tokens - request.num_output_tokens - 1)
            if k >= 1 and self._eligible(request) and self._active(request):
                chosen.append(request)
                room.append(k)
        if not chosen:
            return
        if self.draft is not None:
            proposals = self.draft.propose(chosen, room)
        else:
            assert self.ngram is not None
            proposals = [self.ngram.propose(r.all_token_ids, k) for r, k in zip(chosen, room, strict=True)]
        for request, proposal in zip(chosen, proposals, strict=True):
            request.spec_token_ids = proposal

    @staticmethod
    def _eligible(request: Request) -> bool:
        params = request.sampling_params
        return (
            not request.is_beam
            and request.status == RequestStatus.RUNNING
            and request.num_output_tokens >= max(1, params.min_tokens)
            and request.num_computed_tokens == request.num_tokens - 1
            and not params.needs_penalties
            # A multi-token bad word bans its last token after its prefix: per row, the
            # prefix would have to include the proposals before it.
            and not params.bad_words
        )

    def _active(self, request: Request) -> bool:
        state = self._acceptance.get(request.request_id)
        if state is None or state.paused_steps == 0:
            return True
        state.paused_steps -= 1
        if state.paused_steps == 0:
            state.ema = _EMA_START  # probe again with a fresh average
        return False

    def observe(self, sched_out: SchedulerOutput, extra_token_ids: list[list[int]]) -> None:
        """Learns from the step's verified runs (called after the scheduler's update)."""
        self.last_num_draft_tokens = self.last_num_accepted_tokens = 0
        for item, extra in zip(sched_out.scheduled, extra_token_ids or [[]] * len(sched_out.scheduled), strict=True):
            if not item.spec_token_ids:
                continue
            proposed, accepted = len(item.spec_token_ids), len(extra)
            self.last_num_draft_tokens += proposed
            self.last_num_accepted_tokens += accepted
            state = self._acceptance.setdefault(item.request.request_id, _Acceptance())
            rate = accepted / proposed
            state.ema = (1 - _EMA_WEIGHT) * state.ema + _EMA_WEIGHT * rate
            if rate >= self.config.min_acceptance_rate:
                state.backoff = 0
            elif state.ema < self.config.min_acceptance_rate:
                state.backoff = min(_MAX_BACKOFF, 2 * state.backoff or self.config.backoff_steps)
                state.paused_steps = state.backoff

    def release(self, live: dict[str, Request]) -> None:
        """Forgets requests that are no longer running; frees their draft K/V."""
        for request_id in [r for r in self._acceptance if r not in live]:
            del self._acceptance[request_id]
        if self.draft is not None:
            for request_id in self.draft.tracked_ids():
                request = live.get(request_id)
                if request is None or request.status != RequestStatus.RUNNING:
                    self.draft.release(request_id)
