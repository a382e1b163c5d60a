"""Request-level batching baselines: static and dynamic batching on the iteration-level engine.

Both form a *batch*, a set of waiting requests, and admit only its members until every
member has finished; then the next batch forms. A batch keeps running while it shrinks
(finished members leave and free their KV at once, as in the paged engine), but nobody
joins it: that is the difference from continuous batching, where any free slot is refilled
at the next step. Inside a batch, members are admitted FCFS as the token budget and KV
memory allow, and a preempted member comes back first, exactly as in `Scheduler`.

When a batch launches:

    static   max_num_seqs requests wait, or the queue is closed (`close_queue()`: no request
             will ever come again, so the last partial batch goes). Callers that know nothing
             of batches (`LLM.generate`, the server) never close the queue; for them an idle
             poll closes the current wait: a schedule() call with no batch running and no
             request added since the previous call launches what is queued. Offline this
             costs one empty step; online it degrades to "launch what is there when the
             engine polls twice" - use dynamic for a bounded wait.
    dynamic  max_num_seqs requests wait, or the oldest waiting request has waited
             batch_window_s (measured on `clock`, which a simulated-time driver replaces),
             or the queue is closed.

The batch is the first max_num_seqs waiting requests, in queue order.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from pagedserve.config import BATCHING_POLICIES
from pagedserve.core.protocols import AdapterResidency, KVManager
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.core.scheduler import PreemptionPolicy, Scheduler, SchedulerLimits
from pagedserve.request import Request

BATCH_POLICIES = tuple(p for p in BATCHING_POLICIES if p != "continuous")


class BatchScheduler(Scheduler):
    """Admits only members of the current batch; see the module docstring for launch rules.

    Args:
        policy: "static" or "dynamic".
        window_s: dynamic batching's longest wait for the oldest request, in seconds.
        clock: the time `window_s` and arrival times are measured on.
        preemption, lora: as for `Scheduler`.
    """

    def __init__(
        self,
        limits: SchedulerLimits,
        kv_manager: KVManager,
        policy: str,
        window_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        preemption: PreemptionPolicy | None = None,
        lora: AdapterResidency | None = None,
    ) -> None:
        if policy not in BATCH_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(BATCH_POLICIES)}; got {policy!r}")
        if window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {window_s}")
        super().__init__(limits, kv_manager, preemption, lora)
        self.policy = policy
        self.window_s = window_s
        self.clock = clock
        self.queue_closed = False
        self.batch_sizes: list[int] = []
        self._members: set[str] = set()
        self._num_added = 0
        self._num_added_at_last_poll = -1

    def add_request(self, request: Request, siblings: list[Request] | None = None) -> None:
        super().add_request(request, siblings)
        self._num_added += 1

    def close_queue(self) -> None:
        """No request will be added any more: a partial batch may launch."""
        self.queue_closed = True

    @property
    def batch_running(self) -> bool:
        """True while some member of the current batch has not finished."""
        self._members.intersection_update(self.requests)
        return bool(self._members)

    def next_launch_time(self) -> float | None:
        """When, on `clock`, a waiting partial batch launches without new arrivals (dynamic);
        None if only arrivals or `close_queue()` can launch it, or nothing waits."""
        if self.policy != "dynamic" or self.batch_running or not self.waiting:
            return None
        return min(r.arrival_time for r in self.waiting) + self.window_s

    def _should_launch(self) -> bool:
        if len(self.waiting) >= self.limits.max_num_seqs or self.queue_closed:
            return True
        if self.policy == "dynamic":
            return self.clock() >= min(r.arrival_time for r in self.waiting) + self.window_s
        idle_poll = self._num_added == self._num_added_at_last_poll
        self._num_added_at_last_poll = self._num_added
        return idle_poll

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        if not self.batch_running:
            if not self.waiting or not self._should_launch():
                return
            batch = list(self.waiting)[: self.limits.max_num_seqs]
            # Parallel samples not yet forked belong to their first sample's batch.
            self._members = {r.request_id for r in batch}.union(
                *({s.request_id for s in self.pending_forks.get(r.request_id, ())} for r in batch)
            )
            self.batch_sizes.append(len(batch))
        members = deque(r for r in self.waiting if r.request_id in self._members)
        if not members:
            return
        others = [r for r in self.waiting if r.request_id not in self._members]
        # The base class admits from the head of `waiting`: show it the members only.
        self.waiting = members
        try:
            super()._schedule_waiting(out, budget)
        finally:
            self.waiting = deque([*self.waiting, *others])


def build_batch_scheduler(
    kind: str,
    limits: SchedulerLimits,
    kv: KVManager,
    window_s: float,
    preemption: PreemptionPolicy | None = None,
    lora: AdapterResidency | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Scheduler:
    """The scheduler for `SchedulerConfig.batching` == kind ("static" or "dynamic")."""
    return BatchScheduler(limits, kv, kind, window_s, clock=clock, preemption=preemption, lora=lora)
