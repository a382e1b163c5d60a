"""Online serving on a simulated clock, driven by measured (or fitted) step times.

An `LLMEngine` is fed requests at their arrival times on a virtual clock `now`:

    loop:
        add every request with arrival <= now (arrival_time = its arrival on this clock)
        engine idle?        -> now = next arrival                 (idle time costs nothing)
        t = wall time of engine.step()
        nothing scheduled?  -> a batching policy is holding requests back:
                               now = next arrival or its launch time (dynamic window)
        otherwise           -> now += t; tokens produced in the step appear at `now`

With a `step_time` model, t is the model's time for the step instead of its wall time
(bench/clock.py: the same engine's measured steps, fitted, so load from other processes on
the machine does not leak into the latencies).

Latencies are what a server running these steps back to back would show (requests queue
while earlier steps run, as online), but a run costs only the engine's busy time: idle gaps
between arrivals are skipped. Left out is what a real server adds on top: HTTP,
detokenization, streaming (`bench serve --base-url` measures those on a live server).

`now` is a `SimClock` the engine was built with (`LLMEngine(config, clock=SimClock())`, as
`bench/common.make_engine` does): arrival, scheduling and finish times, and the batching
baselines' windows, are all in simulated time. Each step's plan is read from
`engine.last_scheduler_output`; nothing on the engine is replaced. Once the trace has no
arrivals left, a batch scheduler's queue is closed.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.bench.workloads import WorkloadRequest
from pagedserve.core.contiguous import MemoryBreakdown, memory_breakdown
from pagedserve.sampling_params import SamplingParams

# Wall seconds the engine may schedule nothing, with nothing to wait for, before a run fails.
MAX_STALL_S = 120.0


@dataclass(slots=True)
class RequestRecord:
    prompt_len: int
    arrival_s: float
    output_len: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def ttft_s(self) -> float:
        return (self.first_token_s or 0.0) - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return (self.finish_s or 0.0) - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        if self.output_len < 2 or self.first_token_s is None or self.finish_s is None:
            return None
        return (self.finish_s - self.first_token_s) / (self.output_len - 1)


@dataclass
class SimRun:
    records: list[RequestRecord]
    makespan_s: float = 0.0
    # Engine busy time on the simulated clock, and the wall time the steps really took.
    busy_s: float = 0.0
    wall_s: float = 0.0
    num_steps: int = 0
    # Sum over steps of (requests in the step) x (step time): / busy_s = mean batch size.
    seq_seconds: float = 0.0
    num_preemptions: int = 0
    peak_blocks_used: int = 0
    # Sum of the per-step memory breakdowns (sampled after every step), when asked for.
    memory: MemoryBreakdown | None = None
    memory_samples: int = 0
    # Per step: (step_features, measured seconds), to fit a step-time model on.
    steps: list[tuple[tuple[int, int, int], float]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


class SimClock:
    """The simulated clock: `now` seconds, moved only by the driver (`run_simulated`)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_simulated(
    engine: Any,
    requests: list[WorkloadRequest],
    arrivals: list[float],
    sample_memory: bool = False,
    on_finish: Callable[[], None] | None = None,
    id_prefix: str = "",
    step_time: Callable[[Any], float] | None = None,
    lora_requests: list[Any] | None = None,
) -> SimRun:
    """Runs `requests` arriving at `arrivals` (s) through `engine` on the simulated clock.

    Every request is greedy with ignore_eos and max_tokens = its output length, so the
    lengths are exact. `on_finish` is called once per finished request (progress bars).
    `step_time(scheduler_output)` replaces the measured wall time of each step (a fitted
    cost model, `bench/clock.py`); the measured times are still kept in `run.steps`.
    `lora_requests[i]` is request i's adapter (None: the base model).
    """
    if not isinstance(engine.clock, SimClock):
        raise ValueError("run_simulated needs an engine built with clock=SimClock() "
                         "(bench.common.make_engine builds one)")
    if engine.has_unfinished_requests():
        raise ValueError("run_simulated needs an idle engine (its clock restarts at 0)")
    records = [RequestRecord(len(r.prompt_token_ids), arrivals[i]) for i, r in enumerate(requests)]
    run = SimRun(records, memory=MemoryBreakdown() if sample_memory else None)
    sim = _Simulation(engine, requests, arrivals, run, id_prefix, on_finish, step_time)
    sim.lora_requests = lora_requests
    sched = engine.scheduler
    if hasattr(sched, "close_queue"):
        sched.queue_closed = False  # a batch scheduler reused for another trace
    preemptions_before = sched.num_preemptions_total
    sim.drive()
    run.makespan_s = sim.now - (min(arrivals) if arrivals else 0.0)
    run.num_preemptions = sched.num_preemptions_total - preemptions_before
    return run


class _Simulation:
    def __init__(self, engine, requests, arrivals, run, id_prefix, on_finish, step_time) -> None:
        self.engine, self.requests, self.arrivals, self.run = engine, requests, arrivals, run
        self.id_prefix, self.on_finish, self.step_time = id_prefix, on_finish, step_time
        self.pending = deque(sorted(range(len(requests)), key=lambda i: arrivals[i]))
        self.lora_requests: list[Any] | None = None
        self.clock: SimClock = engine.clock
        self.clock.now = 0.0

    @property
    def now(self) -> float:
        return self.clock.now

    @now.setter
    def now(self, value: float) -> None:
        self.clock.now = value

    def _admit_arrivals(self) -> None:
        engine, pending = self.engine, self.pending
        while pending and self.arrivals[pending[0]] <= self.now:
            i = pending.popleft()
            params = SamplingParams(temperature=0.0, max_tokens=self.requests[i].output_len, ignore_eos=True)
            lora = {"lora_request": self.lora_requests[i]} if self.lora_requests else {}
            engine.add_request(f"{self.id_prefix}{i}", {"prompt_token_ids": self.requests[i].prompt_token_ids},
                               params, arrival_time=self.arrivals[i], **lora)
        if not pending and hasattr(engine.scheduler, "close_queue"):
            engine.scheduler.close_queue()

    def drive(self) -> None:
        engine, stalled = self.engine, 0.0
        while self.pending or engine.has_unfinished_requests():
            self._admit_arrivals()
            if not engine.has_unfinished_requests():
                self.now = self.arrivals[self.pending[0]]
                continue
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            out = engine.last_scheduler_output
            if out.is_empty and not out.preempted_ids:
                event = _next_event(engine.scheduler, self.arrivals, self.pending)
                if event is None:
                    # Waiting on something outside the schedule (an adapter loading from
                    # disk, static batching's idle poll): that time passes for real.
                    self.now += elapsed
                    stalled += elapsed
                    if stalled > MAX_STALL_S:
                        raise RuntimeError(f"the engine scheduled nothing for {MAX_STALL_S} s")
                else:
                    self.now = max(self.now, event)
                continue
            stalled = 0.0
            simulated = self.step_time(out) if self.step_time is not None else elapsed
            self.now += simulated
            _record_step(engine, self.run, out, simulated, elapsed)
            self._record_outputs(outputs)

    def _record_outputs(self, outputs: list) -> None:
        for output in outputs:
            record = self.run.records[int(output.request_id[len(self.id_prefix):])]
            if record.first_token_s is None:
                record.first_token_s = self.now
            if output.finished:
                record.finish_s = self.now
                record.output_len = sum(len(c.token_ids) for c in output.outputs)
                if self.on_finish is not None:
                    self.on_finish()


def _next_event(sched: Any, arrivals: list[float], pending: deque) -> float | None:
    """When something can change for a policy holding its queue back: the next arrival, or
    a dynamic batch's launch time; None if neither is known."""
    candidates = [arrivals[pending[0]]] if pending else []
    launch = sched.next_launch_time() if hasattr(sched, "next_launch_time") else None
    if launch is not None:
        candidates.append(launch)
    return min(candidates) if candidates else None


def _record_step(engine: Any, run: SimRun, out: Any, simulated: float, measured: float) -> None:
    run.num_steps += 1
    run.busy_s += simulated
    run.wall_s += measured
    run.seq_seconds += len(out.scheduled) * simulated
    run.steps.append((step_features(out), measured))
    kv = engine.kv_manager
    run.peak_blocks_used = max(run.peak_blocks_used, kv.pool.num_used_blocks)
    if run.memory is not None:
        sched = engine.scheduler
        head = sched.waiting[0] if sched.waiting else None
        run.memory.add(memory_breakdown(kv, sched.running, head))
        run.memory_samples += 1


def step_features(out: Any) -> tuple[int, int, int]:
    """(sequences, new tokens, context tokens attended) of one step: what its time depends on."""
    context = sum(item.num_computed_tokens + item.num_new_tokens for item in out.scheduled)
    return len(out.scheduled), out.num_batched_tokens, context


def percentiles_ms(values: list[float]) -> dict[str, float]:
    """mean / median / p90 / p99 of seconds, in milliseconds (linear interpolation)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": 1000 * sum(ordered) / len(ordered), "median": 1000 * pct(50),
            "p90": 1000 * pct(90), "p99": 1000 * pct(99)}


def summarize(run: SimRun) -> dict[str, Any]:
    """Throughput, latency percentiles (ms), normalized latency and mean batch size of a run."""
    done = [r for r in run.records if r.finish_s is not None]
    out_tokens = sum(r.output_len for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    span = run.makespan_s or 1e-9
    summary: dict[str, Any] = {
        "completed": len(done),
        "makespan_s": run.makespan_s,
        "busy_s": run.busy_s,
        "wall_s": run.wall_s,
        "num_steps": run.num_steps,
        "request_throughput": len(done) / span,
        "output_throughput": out_tokens / span,
        "total_token_throughput": (in_tokens + out_tokens) / span,
        # The vLLM paper's metric: mean over requests of end-to-end latency / output length.
        "normalized_latency_s": sum(r.e2e_s / max(r.output_len, 1) for r in done) / max(len(done), 1),
        "mean_batched_requests": run.seq_seconds / run.busy_s if run.busy_s else 0.0,
        "num_preemptions": run.num_preemptions,
        "peak_blocks_used": run.peak_blocks_used,
        "ttft_ms": percentiles_ms([r.ttft_s for r in done]),
        "tpot_ms": percentiles_ms([t for r in done if (t := r.tpot_s) is not None]),
        "e2e_ms": percentiles_ms([r.e2e_s for r in done]),
    }
    if run.memory is not None:
        summary["memory"] = memory_summary(run.memory, run.memory_samples)
    summary.update(run.extra)
    return summary


def memory_summary(total: MemoryBreakdown, samples: int) -> dict[str, Any]:
    """Shares of the summed breakdown (weights each step by the memory in use then)."""
    return {
        "shares": total.shares(),
        "samples": samples,
        "mean_slots": {name: getattr(total, name) / max(samples, 1)
                       for name in ("token_states", "reserved", "internal", "external", "free", "rounding")},
        "rounding_share": total.rounding / total.total if total.total else 0.0,
    }
