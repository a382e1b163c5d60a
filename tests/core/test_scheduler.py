"""Scheduler tests with fake model outputs: no model, no tensors."""

from __future__ import annotations

from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.protocols import Residency
from pagedserve.core.scheduler import Scheduler, SchedulerLimits
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams

EOS = 999


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, chunked=True) -> Scheduler:
    return Scheduler(SchedulerLimits(max_num_seqs, budget, chunked), KVCacheManager(num_blocks, block_size))


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=EOS,
        arrival_time=arrival,
        max_output_tokens=max_tokens,
    )


def run_step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    sampled = [token if item.sample else None for item in out.scheduled]
    sched.update_from_output(out, sampled)
    sched.kv.check_integrity()
    return out


def plan(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_fcfs_admission_under_token_budget_with_chunked_prefill():
    sched = make_scheduler(budget=10)
    for i, n in enumerate([6, 7, 3]):
        sched.add_request(make_request(f"r{i}", n, arrival=i))
    out = run_step(sched)
    # r0 takes 6, r1 gets the remaining 4 as its first chunk; r2 waits.
    assert plan(out) == [("r0", 6), ("r1", 4)]
    assert [s.sample for s in out.scheduled] == [True, False]
    out = run_step(sched)
    # r0 decodes 1, r1 finishes its prompt (3), r2 prefills (3).
    assert plan(out) == [("r0", 1), ("r1", 3), ("r2", 3)]
    assert all(s.sample for s in out.scheduled)


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    sched = make_scheduler(budget=10, chunked=False)
    sched.add_request(make_request("a", 6, arrival=0))
    sched.add_request(make_request("b", 7, arrival=1))
    assert plan(run_step(sched)) == [("a", 6)]
    assert plan(run_step(sched)) == [("a", 1), ("b", 7)]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2, budget=100)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 2, arrival=i))
    assert [r for r, _ in plan(run_step(sched))] == ["r0", "r1"]
    assert len(sched.waiting) == 1


def test_requests_leave_the_batch_in_the_step_they_finish():
    sched = make_scheduler(budget=100)
    sched.add_request(make_request("short", 2, max_tokens=1, arrival=0))
    sched.add_request(make_request("long", 2, max_tokens=3, arrival=1))
    run_step(sched)
    assert [r.request_id for r in sched.running] == ["long"]
    assert sched.kv.get_block_table("short") == []
    sched.add_request(make_request("new", 2, arrival=2))
    assert plan(run_step(sched)) == [("long", 1), ("new", 2)]


def test_preemption_evicts_latest_arrival_and_it_resumes_first():
    # 4 blocks of 4 tokens. Two requests of 8 prompt tokens fill the cache.
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(make_request("old", 8, max_tokens=3, arrival=0))
    sched.add_request(make_request("young", 8, max_tokens=3, arrival=1))
    run_step(sched)  # both prefill (4 blocks used) and sample a token each
    sched.add_request(make_request("late", 2, arrival=2))
    out = run_step(sched)
    # "old" needs a 3rd block for token 9: "young" (latest arrival) is preempted.
    assert out.preempted_ids == ["young"]
    assert plan(out) == [("old", 1)]
    young = [r for r in sched.waiting if r.request_id == "young"][0]
    assert young.status == RequestStatus.PREEMPTED and young.num_computed_tokens == 0
    # The preempted request is at the head of the queue, ahead of "late".
    assert [r.request_id for r in sched.waiting] == ["young", "late"]
    while sched.has_unfinished_requests():
        run_step(sched)
    sched.kv.assert_all_free()
    assert sched.num_preemptions_total == 1


def test_recompute_after_preemption_prefills_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=64)
    sched.add_request(make_request("old", 8, max_tokens=3, arrival=0))
    sched.add_request(make_request("young", 8, max_tokens=3, arrival=1))
    run_step(sched)
    run_step(sched)  # young preempted with 1 output token
    young = sched.waiting[0]
    assert young.num_output_tokens == 1
    while young.status != RequestStatus.RUNNING:
        out = run_step(sched)
    # Its re-prefill covers the 8 prompt tokens plus its 1 output token, then samples.
    assert ("young", 9) in plan(out)


def test_abort_frees_blocks_at_once_wherever_the_request_is():
    sched = make_scheduler(budget=8, max_num_seqs=1)
    sched.add_request(make_request("run", 5, arrival=0))
    sched.add_request(make_request("wait", 5, arrival=1))
    run_step(sched)
    sched.finish_requests(["run", "wait"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    sched.kv.assert_all_free()
    assert sched.schedule().finished_ids == ["run", "wait"]


# ---- priority policy (vLLM's --scheduling-policy priority) ---------------------------------------


def make_priority_scheduler(num_blocks=64, max_num_seqs=8, budget=32) -> Scheduler:
    limits = SchedulerLimits(max_num_seqs, budget, True, policy="priority")
    return Scheduler(limits, KVCacheManager(num_blocks, 4))


def prioritized(rid: str, prompt_len: int, priority: int, arrival: float, max_tokens: int = 4) -> Request:
    request = make_request(rid, prompt_len, max_tokens=max_tokens, arrival=arrival)
    request.priority = priority
    return request


def test_priority_admits_lower_values_first_fcfs_within_a_priority():
    sched = make_priority_scheduler(budget=8)
    for rid, prio, arrival in [("late-low", 5, 0), ("b", 1, 1), ("c", 1, 2), ("urgent", 0, 3)]:
        sched.add_request(prioritized(rid, 4, prio, arrival))
    assert [r.request_id for r in sched.waiting] == ["urgent", "b", "c", "late-low"]
    assert plan(run_step(sched)) == [("urgent", 4), ("b", 4)]


def test_fcfs_policy_ignores_priority_order():
    sched = make_scheduler(budget=8)
    for rid, prio, arrival in [("first", 5, 0), ("second", 0, 1)]:
        request = make_request(rid, 4, arrival=arrival)
        request.priority = prio
        sched.add_request(request)
    assert plan(run_step(sched)) == [("first", 4), ("second", 4)]


def test_priority_preempts_the_lowest_priority_first():
    # 6 blocks of 4 tokens: three requests of 8 prompt tokens fill them; decoding needs more.
    sched = make_priority_scheduler(num_blocks=6, budget=64)
    sched.add_request(prioritized("important-late", 8, 0, arrival=2, max_tokens=8))
    sched.add_request(prioritized("unimportant-early", 8, 9, arrival=0, max_tokens=8))
    sched.add_request(prioritized("middle", 8, 4, arrival=1, max_tokens=8))
    run_step(sched)
    preempted: list[str] = []
    while sched.running and not preempted:
        preempted = run_step(sched).preempted_ids
    assert preempted[0] == "unimportant-early"
    assert "important-late" in [r.request_id for r in sched.running]
    assert sched.waiting[0].request_id == "unimportant-early"


class FakeAdapters:
    """An `AdapterResidency` (core/protocols.py) with adapters in given states; counts pins."""

    def __init__(self, states: dict[int, Residency]) -> None:
        self.states = states
        self.pins: dict[int, int] = {}
        self.placements = {lora_id: object() for lora_id in states}

    def prepare(self, lora_id: int) -> Residency:
        return self.states[lora_id]

    def error(self, lora_id: int) -> Exception:
        return ValueError(f"adapter {lora_id} is corrupt")

    def acquire(self, lora_id: int) -> None:
        self.pins[lora_id] = self.pins.get(lora_id, 0) + 1

    def release(self, lora_id: int) -> None:
        self.pins[lora_id] -= 1

    def evict_idle(self) -> bool:
        return False

    num_device_blocks = 0  # the scheduler's statistics read it

    def resident(self, lora_id: int) -> object:
        assert self.states[lora_id] is Residency.READY, "placement asked for an adapter not resident"
        return self.placements[lora_id]


def with_adapter(rid: str, lora_id: int, arrival: float) -> Request:
    request = make_request(rid, 4, max_tokens=2, arrival=arrival)
    request.lora_id = lora_id
    return request


def test_adapter_residency_comes_in_through_the_constructor():
    adapters = FakeAdapters({1: Residency.READY, 2: Residency.LOADING, 3: Residency.FAILED})
    sched = Scheduler(SchedulerLimits(8, 64, True), KVCacheManager(64, 4), lora=adapters)
    for i, lora_id in enumerate([2, 1, 0, 3, 1]):
        sched.add_request(with_adapter(f"r{i}", lora_id, arrival=i))
    out = run_step(sched)
    # Loading adapter 2: r0 waits, later requests go first; failed adapter 3: r3 ends alone.
    # The batch is grouped by adapter, base model first, and carries adapter 1's placement.
    assert plan(out) == [("r2", 4), ("r1", 4), ("r4", 4)]
    assert out.lora_adapters == {1: adapters.placements[1]}
    failed = sched.take_failed()
    assert [r.request_id for r in failed] == ["r3"] and sched.take_failed() == []
    assert failed[0].status == RequestStatus.FINISHED_ERROR
    assert failed[0].stop_reason == "adapter 3 is corrupt"
    assert adapters.pins == {1: 2}  # pinned by its two running requests
    adapters.states[2] = Residency.READY
    out = run_step(sched)
    assert plan(out) == [("r2", 1), ("r1", 1), ("r4", 1), ("r0", 4)]
    assert out.lora_adapters == {1: adapters.placements[1], 2: adapters.placements[2]}
    while sched.has_unfinished_requests():
        run_step(sched)
    assert adapters.pins == {1: 0, 2: 0}
    sched.kv.assert_all_free()
