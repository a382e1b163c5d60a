"""Static and dynamic batching baselines, driven with fake model outputs (no model)."""

from __future__ import annotations

import pytest

from pagedserve.core.batching import BatchScheduler
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import SchedulerLimits
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(policy: str, max_num_seqs: int = 2, window_s: float = 1.0, num_blocks: int = 64):
    clock = FakeClock()
    limits = SchedulerLimits(max_num_seqs, 64, True)
    return BatchScheduler(limits, KVCacheManager(num_blocks, 4), policy, window_s, clock=clock), clock


def make_request(rid: str, prompt_len: int = 3, max_tokens: int = 2, arrival: float = 0.0) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=list(range(1, prompt_len + 1)),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        eos_token_id=None,
        arrival_time=arrival,
        max_output_tokens=max_tokens,
    )


def step(sched: BatchScheduler) -> list[str]:
    out = sched.schedule()
    sched.update_from_output(out, [7 if item.sample else None for item in out.scheduled])
    sched.kv.check_integrity()
    return [item.request.request_id for item in out.scheduled]


def test_static_waits_for_a_full_batch_and_runs_it_to_completion():
    sched, _ = make_scheduler("static", max_num_seqs=2)
    sched.add_request(make_request("a", max_tokens=3))
    assert step(sched) == []  # one of two: wait (an arrival since the last poll)
    sched.add_request(make_request("b", max_tokens=1))
    sched.add_request(make_request("c", max_tokens=1))
    assert step(sched) == ["a", "b"]
    # b finished at once, but c may not join until a (the longest) ends too.
    assert step(sched) == ["a"]
    assert step(sched) == ["a"]
    assert sched.batch_sizes == [2]
    assert step(sched) == []  # c alone: waits for a second request ...
    sched.close_queue()  # ... until the caller says none will come
    assert step(sched) == ["c"]
    assert not sched.has_unfinished_requests()
    sched.kv.pool.assert_all_free()


def test_static_idle_poll_launches_a_partial_batch_for_offline_callers():
    sched, _ = make_scheduler("static", max_num_seqs=4)
    for rid in "ab":
        sched.add_request(make_request(rid, max_tokens=1))
    assert step(sched) == []  # requests arrived since the last poll
    assert step(sched) == ["a", "b"]  # nothing new: the caller has no more to add now


def test_dynamic_launches_when_the_oldest_request_has_waited_the_window():
    sched, clock = make_scheduler("dynamic", max_num_seqs=3, window_s=1.0)
    sched.add_request(make_request("a", arrival=0.0))
    clock.now = 0.5
    sched.add_request(make_request("b", arrival=0.5))
    assert step(sched) == []
    assert sched.next_launch_time() == pytest.approx(1.0)
    clock.now = 1.0
    assert step(sched) == ["a", "b"]
    sched.add_request(make_request("c", arrival=1.0))
    assert sched.next_launch_time() is None  # the batch runs: c waits for it, not a window
    clock.now = 5.0  # c has waited long, but the batch still runs
    assert step(sched) == ["a", "b"]
    assert sched.next_launch_time() == pytest.approx(2.0)
    assert step(sched) == ["c"]  # batch done: c launches at once (its window passed)


def test_dynamic_launches_a_full_batch_without_waiting():
    sched, _ = make_scheduler("dynamic", max_num_seqs=2, window_s=100.0)
    for rid in "abc":
        sched.add_request(make_request(rid))
    assert step(sched) == ["a", "b"]
    assert sched.batch_sizes == [2]


def test_a_preempted_member_stays_in_its_batch():
    # 6 blocks of 4: two members of 7-token prompts + 8 outputs (4 blocks each) do not fit.
    sched, _ = make_scheduler("static", max_num_seqs=2, num_blocks=6)
    sched.add_request(make_request("a", prompt_len=7, max_tokens=8))
    sched.add_request(make_request("b", prompt_len=7, max_tokens=8))
    sched.add_request(make_request("late", prompt_len=2, max_tokens=1))
    seen: set[str] = set()
    for _ in range(60):
        if "a" not in sched.requests and "b" not in sched.requests:
            break
        seen.update(step(sched))
    assert sched.num_preemptions_total > 0
    assert "late" not in seen, "a request outside the batch never joins it"
    sched.close_queue()
    assert step(sched) == ["late"]


def test_continuous_batching_admits_at_once_for_contrast():
    from pagedserve.core.scheduler import Scheduler

    sched = Scheduler(SchedulerLimits(2, 64, True), KVCacheManager(64, 4))
    sched.add_request(make_request("a", max_tokens=3))
    sched.add_request(make_request("b", max_tokens=1))
    sched.add_request(make_request("c", max_tokens=1))
    assert step(sched) == ["a", "b"]
    assert step(sched) == ["a", "c"]  # c takes b's slot at once


def test_bad_policy_and_window_are_rejected():
    limits = SchedulerLimits(2, 64, True)
    with pytest.raises(ValueError, match="policy"):
        BatchScheduler(limits, KVCacheManager(8, 4), "orca")
    with pytest.raises(ValueError, match="batch_window_s"):
        BatchScheduler(limits, KVCacheManager(8, 4), "dynamic", -1.0)


def test_engine_runs_static_and_dynamic_offline(model_path):
    from pagedserve import LLM

    prompts = [{"prompt_token_ids": [10 + i, 20 + i, 30 + i]} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = None
    for batching in ("continuous", "static", "dynamic"):
        llm = LLM(model_path("llama-gqa"), batching=batching, batch_window_s=0.0, max_num_seqs=2,
                  num_gpu_blocks_override=64, max_model_len=128, skip_tokenizer_init=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        expected = expected or tokens
        assert tokens == expected, f"{batching} changes the outputs"
