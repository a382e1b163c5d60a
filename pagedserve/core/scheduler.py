"""Iteration-level scheduler: continuous batching with chunked prefill and preemption.

Each step hands out one token budget (max_num_batched_tokens):
  1. running requests first, oldest first: a decode costs 1 token, an unfinished
     prefill takes the next chunk that fits the budget;
  2. then waiting requests, FCFS, while the budget, max_num_seqs and KV blocks allow.
Parallel samples (n/best_of) share their prompt: only the first sample is scheduled;
when it samples its first token, the runner draws each sibling's first token from the
same logits row and the siblings fork its blocks (reference counts, no copy; the shared
partial block is copied on the first write). Until then the siblings wait in
`pending_forks`, counted against max_num_seqs.

When a running request cannot get a block, the most recently arrived running request
is preempted, by one of two means (`PreemptionPolicy`):
  recompute  its blocks are freed and it returns to the head of the waiting queue, to
             prefill prompt + outputs again;
  swap       its blocks are copied to the host swap pool and freed; it waits in `swapped`
             and is copied back when blocks free up, before any waiting request is admitted.
"auto" swaps when copying is cheaper than recomputing (and always for a request with
siblings, whose shared state recompute would lose), falling back to recompute when the
swap pool is full. No request is admitted in a step that preempted, so preempted requests
are never overtaken.

With `policy="priority"` (vLLM's --scheduling-policy priority) every queue is ordered by
(priority, arrival) instead of arrival: lower values are admitted first and preempted last,
first come first served within a priority.

Speculative decoding: a decoding request may carry proposed tokens (`spec_token_ids`,
set by the engine's Speculator after the previous step). They ride along with its
decode token, count against the token budget and get KV slots like any token; if the
slots are not free the request decodes without them rather than preempting anyone.
After the step the rejected proposals' slots are rolled back (`KVCacheManager.rollback`).

Models with sliding-window layers (core/hybrid_kv_manager.py): `allocate_slots` counts the
true need, windowed blocks given back before the step included, so admission and
preemption need nothing else here; such a manager never offers swap.

The scheduler counts tokens and block ids; it never touches tensors.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.config import PREEMPTION_MODES, SCHEDULING_POLICIES, SchedulerConfig
from pagedserve.core.protocols import AdapterResidency, KVManager, Residency
from pagedserve.core.sched_output import ScheduledRequest, SchedulerOutput
from pagedserve.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool = True
    policy: str = SchedulerConfig.scheduling_policy  # one of SCHEDULING_POLICIES

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {self.policy!r}")


@dataclass(frozen=True, slots=True)
class PreemptionPolicy:
    mode: str = SchedulerConfig.preemption_mode  # one of PREEMPTION_MODES
    # The cost model behind "auto", in seconds: recomputing one token's K/V, and copying
    # one block to the host and back.
    recompute_s_per_token: float = 1e-3
    swap_s_per_block: float = 1e-5

    def __post_init__(self) -> None:
        if self.mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}; got {self.mode!r}")


@dataclass(slots=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions_total: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_usage: float  # requests' KV blocks / all blocks (adapter pages excluded)
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_swapped: int = 0
    num_swapped_out_blocks_total: int = 0
    num_swapped_in_blocks_total: int = 0
    # Speculative decoding, vLLM's counters: verified proposal runs, their tokens, accepted ones.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    lora_blocks_used: int = 0  # blocks holding resident LoRA adapters (not in kv_blocks_used)


def _arrival_order(request: Request) -> tuple[float, int]:
    return (request.arrival_time, request.sample_index)


def _priority_order(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.sample_index)


class Scheduler:
    """Args:
        limits: the step's token budget and sequence cap, chunking, queue order.
        kv_manager: the KV slots (core/protocols.py `KVManager`: paged or a contiguous baseline).
        preemption: how to preempt under memory pressure (default: recompute).
        lora: where LoRA adapters live (`AdapterResidency`); None when LoRA is off.
    """

    def __init__(
        self,
        limits: SchedulerLimits,
        kv_manager: KVManager,
        preemption: PreemptionPolicy | None = None,
        lora: AdapterResidency | None = None,
    ) -> None:
        self.limits = limits
        # The order of every queue; the preemption victim is the last running request.
        self._order = _priority_order if limits.policy == "priority" else _arrival_order
        self.kv = kv_manager
        self.preemption = preemption or PreemptionPolicy()
        self.lora = lora
        # Requests that failed in the scheduler (e.g. their adapter did not load), for the engine to report.
        self.failed: list[Request] = []
        self.waiting: deque[Request] = deque()
        # Swapped-out requests, oldest arrival first.
        self.swapped: list[Request] = []
        self.num_swapped_out_blocks_total = 0
        self.num_swapped_in_blocks_total = 0
        # Kept sorted by arrival time, so the preemption victim is always the last one.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        # First sample's id -> its siblings waiting to fork its blocks.
        self.pending_forks: dict[str, list[Request]] = {}
        self.num_preemptions_total = 0
        # Prefix cache, in tokens: looked up at admission / found cached.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self._finished_ids: list[str] = []

    # ---- request lifecycle -------------------------------------------------------------

    def add_request(self, request: Request, siblings: list[Request] | None = None) -> None:
        """Queues a request; `siblings` are the other samples of its group, forked later."""
        group = [request, *(siblings or [])]
        for member in group:
            if member.request_id in self.requests:
                raise ValueError(f"request_id {member.request_id!r} is already in use")
        for member in group:
            self.requests[member.request_id] = member
        if siblings:
            self.pending_forks[request.request_id] = list(siblings)
        if self.limits.policy == "priority":
            self.waiting.insert(bisect.bisect_right(self.waiting, self._order(request), key=self._order), request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Ends requests wherever they are (abort, stop string); their blocks free at once."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.status.finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self._leave_running(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            else:
                self._drop_pending_fork(request)
            request.status = status
            self._retire(request)

    def _drop_pending_fork(self, request: Request) -> None:
        for parent_id, siblings in self.pending_forks.items():
            if request in siblings:
                siblings.remove(request)
                if not siblings:
                    del self.pending_forks[parent_id]
                return

    def _enter_running(self, request: Request) -> None:
        """The one way into `running` (kept in arrival order); pins the request's adapter."""
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._order)
        if self.lora is not None and request.lora_id:
            self.lora.acquire(request.lora_id)

    def _leave_running(self, request: Request) -> None:
        """The one way out of `running`; unpins the adapter (idle adapters become evictable)."""
        self.running.remove(request)
        if self.lora is not None and request.lora_id:
            self.lora.release(request.lora_id)

    def _retire(self, request: Request) -> None:
        self.kv.free(request.request_id)
        self.kv.free_swapped(request.request_id)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
        # Siblings that never forked cannot start without this request's prompt.
        for sibling in self.pending_forks.pop(request.request_id, []):
            sibling.status = request.status
            self._retire(sibling)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def take_failed(self) -> list[Request]:
        """Requests that failed in the scheduler since the last call (their adapter did not
        load), already finished with FINISHED_ERROR, for the engine to report."""
        failed, self.failed = self.failed, []
        return failed

    # ---- scheduling --------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted_ids:
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:
                self._schedule_waiting(out, budget)
        if self.lora is not None:
            # Requests for one adapter side by side: the runner's LoRA segments are runs of
            # neighbouring tokens with one adapter, and a longer segment reuses each weight it
            # reads over more rows. Stable, so arrival order holds within an adapter; the
            # batch's order has no other meaning (attention and sampling go by request).
            out.scheduled.sort(key=lambda item: item.request.lora_id)
            # Where each scheduled adapter is, for the runner's segment tables. Every one is
            # pinned by its running requests, so it cannot move before the step runs.
            lora_ids = {item.request.lora_id for item in out.scheduled if item.request.lora_id}
            out.lora_adapters = {lora_id: self.lora.resident(lora_id) for lora_id in sorted(lora_ids)}
        out.blocks_to_copy = self.kv.take_pending_copies()
        out.finished_ids, self._finished_ids = self._finished_ids, []
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new == 0:
                # A beam waiting for its group's decision: nothing to compute yet.
                index += 1
                continue
            spec = self._take_spec_tokens(request, num_new, budget)
            if not spec and not self._allocate_or_preempt(request, num_new, out):
                break  # `request` itself was the last one and got preempted.
            self._add_scheduled(out, request, num_new, spec)
            budget -= num_new + len(spec)
            index += 1
        return budget

    def _take_spec_tokens(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's proposals that fit this step, with their KV slots allocated; [] if none.

        Only a decode (one token to compute) carries proposals; they are capped by the
        token budget and by the output budget (the tokens after the run's last one could
        not be used). Proposals never preempt: without free slots they are dropped.
        """
        spec, request.spec_token_ids = request.spec_token_ids, []
        if not spec or num_new != 1 or request.request_id in self.pending_forks:
            return []
        room = min(budget - 1, request.max_output_tokens - request.num_output_tokens - 1)
        spec = spec[: max(0, room)]
        if spec and self.kv.allocate_slots(
            request.request_id, request.num_computed_tokens, num_new + len(spec), request=request
        ):
            return spec
        return []

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new, request=request):
            if self.lora is not None and self.lora.evict_idle():
                continue  # an idle adapter's blocks may be enough
            victim = self.running[-1]
            self._leave_running(victim)
            self._preempt(victim, out)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        if self._should_swap(request):
            pairs = self.kv.swap_out(request.request_id)
            out.blocks_to_swap_out.extend(pairs)
            self.num_swapped_out_blocks_total += len(pairs)
            request.status = RequestStatus.SWAPPED
            bisect.insort(self.swapped, request, key=self._order)
            return
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        if self.limits.policy == "priority":
            # Ahead of every later arrival of its priority, as appendleft is under FCFS.
            self.waiting.insert(bisect.bisect_left(self.waiting, self._order(request), key=self._order), request)
        else:
            self.waiting.appendleft(request)

    def _should_swap(self, request: Request) -> bool:
        policy = self.preemption
        if policy.mode == "recompute" or not self.kv.can_swap_out(request.request_id):
            return False
        if policy.mode == "swap" or request.group_id is not None:
            return True
        num_blocks = len(self.kv.get_block_table(request.request_id))
        return num_blocks * policy.swap_s_per_block < request.num_computed_tokens * policy.recompute_s_per_token

    def _num_active_seqs(self) -> int:
        """Running sequences plus the unforked siblings of running requests."""
        return len(self.running) + sum(
            len(siblings) for parent_id, siblings in self.pending_forks.items()
            if self.requests[parent_id].status == RequestStatus.RUNNING
        )

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        num_seqs = self._num_active_seqs()
        while self.swapped and budget > 0 and num_seqs < self.limits.max_num_seqs:
            request = self.swapped[0]
            if request.lora_id and not self._adapter_state(request):
                break  # its adapter was evicted meanwhile and is not back yet
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv.can_swap_in(request.request_id, request.num_computed_tokens + num_new):
                break
            pairs = self.kv.swap_in(request.request_id)
            out.blocks_to_swap_in.extend(pairs)
            self.num_swapped_in_blocks_total += len(pairs)
            allocated = self.kv.allocate_slots(request.request_id, request.num_computed_tokens, num_new, request=request)
            assert allocated, "checked above"
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self._enter_running(request)
            self._add_scheduled(out, request, num_new)
            budget -= num_new
            num_seqs += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        limits = self.limits
        num_seqs = self._num_active_seqs()
        index = 0
        while index < len(self.waiting) and budget > 0:
            request = self.waiting[index]
            group_size = 1 + len(self.pending_forks.get(request.request_id, ()))
            if num_seqs + group_size > limits.max_num_seqs and num_seqs > 0:
                break
            if request.lora_id:
                state = self._adapter_state(request)
                if state is None:
                    continue  # failed and left the queue
                if not state:
                    index += 1  # adapter still loading: later requests may go first
                    continue
            # A waiting request holds no blocks: everything it reuses comes from the cache.
            cached_blocks = self.kv.find_cached_prefix(request)
            num_cached = len(cached_blocks) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            if num_new > budget and not limits.enable_chunked_prefill:
                break
            num_new = min(num_new, budget)
            if not self._allocate_evicting_adapters(request, num_cached, num_new, cached_blocks):
                break
            request.num_computed_tokens = request.num_cached_tokens = num_cached
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
            del self.waiting[index]
            self._enter_running(request)
            self._add_scheduled(out, request, num_new)
            budget -= num_new
            num_seqs += group_size

    def _adapter_state(self, request: Request) -> bool | None:
        """True: adapter resident; False: still loading; None: it failed, request finished."""
        assert self.lora is not None
        state = self.lora.prepare(request.lora_id)
        if state is Residency.FAILED:
            request.stop_reason = str(self.lora.error(request.lora_id))
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            self.failed.append(request)
            return None
        return state is Residency.READY

    def _allocate_evicting_adapters(
        self, request: Request, num_cached: int, num_new: int, cached_blocks: list[int]
    ) -> bool:
        # The request's own adapter is pinned meanwhile, so eviction cannot take it.
        if self.lora is not None and request.lora_id:
            self.lora.acquire(request.lora_id)
        try:
            while not self.kv.allocate_slots(request.request_id, num_cached, num_new, cached_blocks, request=request):
                if self.lora is None or not self.lora.evict_idle():
                    return False
            return True
        finally:
            if self.lora is not None and request.lora_id:
                self.lora.release(request.lora_id)

    def _add_scheduled(
        self, out: SchedulerOutput, request: Request, num_new: int, spec: list[int] | None = None
    ) -> None:
        start = request.num_computed_tokens
        sample = start + num_new == request.num_tokens
        # Up to the request's own tokens only: a block holding proposals is never published.
        self.kv.cache_full_blocks(request, start + num_new)
        spec = spec or []
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                num_computed_tokens=start,
                num_new_tokens=num_new + len(spec),
                block_table=self.kv.get_block_table(request.request_id),
                sample=sample,
                fork_requests=list(self.pending_forks.get(request.request_id, ())) if sample else [],
                spec_token_ids=spec,
            )
        )
        out.num_batched_tokens += num_new + len(spec)

    # ---- results -----------------------------------------------------------------------

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: list[int | None],
        fork_tokens: list[list[int]] | None = None,
        extra_tokens: list[list[int]] | None = None,
    ) -> list[Request]:
        """Advances counters, appends sampled tokens, forks siblings, retires finished requests.

        Args:
            out: the step's schedule.
            sampled: one entry per scheduled request: the new token id, or None if it
                did not sample this step (a prefill chunk that is not the last).
            fork_tokens: per scheduled request, the first tokens of its `fork_requests`.
            extra_tokens: per scheduled request, the tokens after `sampled` that its
                verified proposals gave (speculative decoding; the accepted proposals
                except the first, then the correction or bonus token). None: none did.
        Returns:
            The requests that received tokens this step (finished ones included), once each.
        """
        updated: list[Request] = []
        for index, (item, token_id) in enumerate(zip(out.scheduled, sampled, strict=True)):
            request = item.request
            if request.status.finished:
                continue  # aborted between schedule() and now.
            request.num_computed_tokens += item.num_new_tokens
            if token_id is None:
                continue
            if item.fork_requests and fork_tokens is not None:
                self._fork_siblings(request, item.fork_requests, fork_tokens[index], updated)
            extra = extra_tokens[index] if extra_tokens is not None else []
            if item.spec_token_ids:
                # Here the number of accepted proposals per request is known; state that
                # follows the tokens (e.g. a structured-output matcher) advances by
                # exactly the tokens appended below.
                self._settle_proposals(request, len(item.spec_token_ids), len(extra))
            self._append_tokens(request, [token_id, *extra], updated)
        return updated

    def _settle_proposals(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Counts the run and rolls back the rejected proposals' K/V slots."""
        request.num_computed_tokens -= num_proposed - num_accepted
        self.kv.rollback(request.request_id, request.num_computed_tokens)
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_proposed
        self.spec_num_accepted_tokens += num_accepted

    def _append_token(self, request: Request, token_id: int, updated: list[Request]) -> None:
        self._append_tokens(request, [token_id], updated)

    def _append_tokens(self, request: Request, token_ids: list[int], updated: list[Request]) -> None:
        """Appends tokens in order until one ends the request (EOS, stop id, length); the
        rest of an accepted run after it is dropped."""
        updated.append(request)
        for token_id in token_ids:
            request.append_output_token(token_id)
            if request.check_stop():
                self._leave_running(request)
                self._retire(request)
                return

    def fork_request(self, parent: Request, child: Request, token_id: int) -> None:
        """Starts `child` (a copy of `parent`'s tokens) on parent's blocks, then appends `token_id`.

        Used by beam search after a step: the child shares every block of the parent;
        the partial last block is copied on its first write.
        """
        if child.request_id in self.requests:
            raise ValueError(f"request_id {child.request_id!r} is already in use")
        self.requests[child.request_id] = child
        self.kv.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self._enter_running(child)
        child.append_output_token(token_id)

    def _fork_siblings(
        self, parent: Request, siblings: list[Request], tokens: list[int], updated: list[Request]
    ) -> None:
        pending = self.pending_forks.pop(parent.request_id, [])
        for sibling, token_id in zip(siblings, tokens, strict=True):
            if sibling not in pending:
                continue  # aborted since the schedule was made
            # The prompt's K/V (all of it computed now) is shared, not copied.
            self.kv.fork(parent.request_id, sibling.request_id)
            sibling.num_computed_tokens = parent.num_computed_tokens
            sibling.num_cached_tokens = parent.num_cached_tokens
            sibling.status = RequestStatus.RUNNING
            self._enter_running(sibling)
            self._append_token(sibling, token_id, updated)

    def stats(self) -> SchedulerStats:
        kv = self.kv
        # Adapter pages share the block pool (S-LoRA) but are not requests' KV: vLLM's
        # kv_cache_usage_perc means the latter, and it returns to 0 once requests are done.
        adapter_blocks = self.lora.num_device_blocks if self.lora is not None else 0
        request_blocks = kv.num_used_blocks - adapter_blocks
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preemptions_total=self.num_preemptions_total,
            kv_blocks_used=request_blocks,
            kv_blocks_total=kv.num_blocks,
            kv_usage=kv.usage if not adapter_blocks else request_blocks / kv.num_blocks,
            lora_blocks_used=adapter_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_swapped=len(self.swapped),
            num_swapped_out_blocks_total=self.num_swapped_out_blocks_total,
            num_swapped_in_blocks_total=self.num_swapped_in_blocks_total,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted_tokens,
        )
