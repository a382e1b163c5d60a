"""Issue #13: no single request can take the engine down; the server keeps its promises.

Each numbered defect of the issue has a regression test here (the issue's number in the
test's docstring); the parametrized bad-input table and the idle test are here too. The
OpenAPI fuzz run is tests/test_fuzz.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import threading
import time

import httpx
import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagedserve.engine.faults import FailRequests
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

PROMPTS = ["The capital of France is", "Hello, my name is", "Paged attention stores", "One two three"]


def _engine(model_path, faults=None, **scheduler) -> LLMEngine:
    config = EngineConfig(
        model=ModelConfig(model=model_path(TEST_MODEL)),
        cache=CacheConfig(kv_cache_memory_bytes=8 << 20),
        scheduler=SchedulerConfig(**scheduler),
    )
    return LLMEngine(config, faults=faults)


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


# ---- 1. one request must not kill the engine ------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, 10**30, -(2**63) - 1, True])
def test_seed_out_of_torch_range_is_refused_naming_seed(seed) -> None:
    """#13.1 (the case): seeds torch cannot take are refused before they reach a generator."""
    with pytest.raises(ValueError, match="^seed must be"):
        SamplingParams(seed=seed, temperature=1.0)
    for ok in (SEED_MIN, SEED_MAX, 0):
        assert SamplingParams(seed=ok).seed == ok
    # The samples of an n > 1 request derive seed + i, wrapped into the range.
    assert SamplingParams(seed=SEED_MAX, n=3, temperature=1.0).for_sample(2).seed == 1  # mod 2**64


@pytest.mark.parametrize("point", ["sampling_inputs", "detokenize"])
def test_one_request_failing_alone_leaves_the_batch(model_path, point) -> None:
    """#13.1 (the class): one request's failure ends it alone; the others' tokens are unchanged."""
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True)
    requests = {f"r{i}": (prompt, greedy) for i, prompt in enumerate(PROMPTS)}
    requests["s"] = ("Sampled", seeded)
    want = _run(_engine(model_path), requests)
    faults = FailRequests(point, ["r1", "s#1" if point == "detokenize" else "s#0"])
    engine = _engine(model_path, faults)
    got = _run(engine, requests)
    assert faults.num_raised >= 1
    assert got["r1"].outputs[0].finish_reason == "error" and "injected fault" in got["r1"].outputs[0].stop_reason
    for request_id in ("r0", "r2", "r3"):
        assert got[request_id].outputs[0].token_ids == want[request_id].outputs[0].token_ids
        assert got[request_id].outputs[0].finish_reason == "length"
    samples = {o.index: o for o in got["s"].outputs}
    if point == "sampling_inputs":
        # The first sample failed before forking its sibling: both end with the error.
        assert [o.finish_reason for o in got["s"].outputs] == ["error", "error"]
    else:
        assert samples[1].finish_reason == "error"
        assert samples[0].token_ids == {o.index: o for o in want["s"].outputs}[0].token_ids
    # The engine keeps serving (and the autouse fixture checks that every block came back).
    again = _run(engine, {"after": (PROMPTS[0], greedy)})
    assert again["after"].outputs[0].token_ids == want["r0"].outputs[0].token_ids
