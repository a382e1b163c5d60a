"""The OpenAI-compatible server, driven by the official `openai` client against a live server.

One server per module (tests/server_fixtures.py) on the tiny `llama-gqa` test model; the
oracles are the offline `LLM`, the server's own non-streamed / non-concurrent answers, and
the engine's leak check once the server is idle.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagedserve.engine.input_processor import InputProcessor
from pagedserve.sampling_params import SamplingParams

from server_fixtures import TEST_MODEL, LiveServer, live_server  # noqa: F401

PROMPTS = ["The capital of France is", "Hello, my name is", "Paged attention stores", "One two three"]


@pytest.fixture(scope="module")
def client(live_server: LiveServer) -> openai.OpenAI:  # noqa: F811
    return openai.OpenAI(base_url=live_server.v1, api_key="EMPTY", max_retries=0)


def _greedy(client: openai.OpenAI, prompt: str | list[int], max_tokens: int = 16, **extra: object):
    return client.completions.create(
        model=TEST_MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=extra or None
    )


def _metric(server: LiveServer, name: str, **labels: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _wait_for(condition, timeout_s: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, "condition not reached in time"
        time.sleep(0.02)
    return time.monotonic() - start


# ---- happy paths ---------------------------------------------------------------------------


def test_models_health_version(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    assert [m.id for m in client.models.list().data] == [TEST_MODEL]
    assert httpx.get(live_server.base_url + "/health").status_code == 200
    assert httpx.get(live_server.base_url + "/version").json()["version"]


def test_greedy_completion_equals_offline_llm(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    from pagedserve import LLM

    llm = LLM(live_server.model_path, kv_cache_memory_bytes=8 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=16)
    for prompt in PROMPTS:
        # One prompt per call, like the server's sequential requests: same batch shapes.
        (want,) = llm.generate([prompt], greedy, use_tqdm=False)
        choice = _greedy(client, prompt, return_token_ids=True).choices[0]
        assert choice.token_ids == want.outputs[0].token_ids
        assert choice.text == want.outputs[0].text
        assert choice.prompt_token_ids == want.prompt_token_ids


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    for prompt in PROMPTS[:2]:
        full = _greedy(client, prompt, 24).choices[0]
        stream = client.completions.create(
            model=TEST_MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks) == full.text
        assert chunks[-1].choices[0].finish_reason == full.finish_reason


def test_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    full = client.chat.completions.create(model=TEST_MODEL, messages=messages, max_tokens=20, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=TEST_MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_text_parts_and_max_completion_tokens(client: openai.OpenAI) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    out = client.chat.completions.create(
        model=TEST_MODEL, messages=[{"role": "user", "content": parts}], max_completion_tokens=5,
        temperature=0, extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"


def test_n_and_seed_fan_out(client: openai.OpenAI) -> None:
    kwargs = dict(model=TEST_MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=1.0)
    out = client.completions.create(n=3, seed=7, **kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    # Sample i is the request with seed + i, so the whole call is reproducible.
    for i, choice in enumerate(out.choices):
        assert client.completions.create(seed=7 + i, **kwargs).choices[0].text == choice.text
    assert len({c.text for c in out.choices}) > 1
    tokens = sum(len(c.token_ids) for c in client.completions.create(
        n=3, seed=7, extra_body={"return_token_ids": True}, **kwargs).choices)
    assert out.usage.completion_tokens == tokens


def test_several_prompts_with_n(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    out = client.completions.create(model=TEST_MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    single = [_greedy(client, p, 6).choices[0].text for p in PROMPTS[:2]]
    assert [c.text for c in out.choices] == [single[0], single[0], single[1], single[1]]
    counts = [httpx.post(live_server.base_url + "/tokenize", json={"prompt": p}).json()["count"] for p in PROMPTS[:2]]
    assert out.usage.prompt_tokens == sum(counts)  # each prompt once, whatever n is


def test_best_of_returns_the_most_likely(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=TEST_MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, seed=3, best_of=3, n=1,
        extra_body={"ignore_eos": True},
    )
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    assert out.usage.completion_tokens == 3 * 6  # every sample was generated
    samples = [
        client.completions.create(model=TEST_MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=1.0,
                                  seed=3 + i, logprobs=0, extra_body={"ignore_eos": True}).choices[0]
        for i in range(3)
    ]
    best = max(samples, key=lambda c: sum(c.logprobs.token_logprobs))
    assert out.choices[0].text == best.text


def test_stop_string(client: openai.OpenAI) -> None:
    text = _greedy(client, PROMPTS[0], 16, ignore_eos=True).choices[0].text
    stop = text[5:8]
    assert stop and stop in text
    out = client.completions.create(
        model=TEST_MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop]
    )
    choice = out.choices[0]
    assert choice.text == text[: text.index(stop)]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop


def test_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(model=TEST_MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)  # top-3 plus the chosen token
    assert all(lp.token_logprobs[i] == max(lp.top_logprobs[i].values()) for i in range(5))  # greedy
    chat = client.chat.completions.create(
        model=TEST_MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob == t.top_logprobs[0].logprob for t in content)


def test_include_usage_exact(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    count = httpx.post(live_server.base_url + "/tokenize", json={"prompt": PROMPTS[2]}).json()["count"]
    stream = client.completions.create(
        model=TEST_MODEL, prompt=PROMPTS[2], max_tokens=7, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (count, 7, count + 7)
    assert all(c.usage is None for c in chunks[:-1])


def test_tokenize_detokenize_roundtrip(live_server: LiveServer) -> None:  # noqa: F811
    tokens = httpx.post(live_server.base_url + "/tokenize", json={"prompt": "Hello world"}).json()["tokens"]
    text = httpx.post(live_server.base_url + "/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.endswith("Hello world")
    chat = httpx.post(live_server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert chat.status_code == 200 and chat.json()["count"] > 1


# ---- errors --------------------------------------------------------------------------------

INVALID_COMPLETIONS = [
    ({"temperature": -1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"best_of": 1, "n": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 8}, "min_tokens"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": [""]}, "stop"), ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"), ({"seed": "x"}, "seed"),
    ({"prompt": []}, "prompt"), ({"prompt": [5, 99999]}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"), ({"stream": "maybe"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"suffix": "x"}, "suffix"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"ignore_eos": "maybe"}, "ignore_eos"),
    ({"skip_special_tokens": "maybe"}, "skip_special_tokens"),
]
INVALID_CHAT = [
    ({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"), ({"n": 0}, "n"), ({"seed": 1.5}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize(("patch", "param"), INVALID_COMPLETIONS + [({"chat": 1, **p}, f) for p, f in INVALID_CHAT],
                         ids=lambda x: str(x)[:60])
def test_invalid_field_is_400_naming_it(live_server: LiveServer, patch: dict, param: str) -> None:  # noqa: F811
    patch = dict(patch)
    if patch.pop("chat", None):
        path, body = "/v1/chat/completions", {"model": TEST_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    else:
        path, body = "/v1/completions", {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 4}
    resp = httpx.post(live_server.base_url + path, json={**body, **patch})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and param in error["message"]
    assert error["type"] == "invalid_request_error"


def test_invalid_json_is_400(live_server: LiveServer) -> None:  # noqa: F811
    resp = httpx.post(live_server.base_url + "/v1/completions", content=b"{nope",
                      headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "error" in resp.json()


def test_context_length(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048 tokens"):
        client.completions.create(model=TEST_MODEL, prompt=[7] * 2100, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048 tokens") as info:
        client.completions.create(model=TEST_MODEL, prompt=[7] * 2040, max_tokens=16)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model=TEST_MODEL, messages=[{"role": "user", "content": "hi " * 3000}])


def test_unknown_model_404_auth_401_queue_503(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    ctx = live_server.ctx
    ctx.api_key = "sekrit"
    try:
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2)
        assert httpx.get(live_server.v1 + "/models").status_code == 401
        assert httpx.get(live_server.base_url + "/health").status_code == 200  # not under /v1
        authed = openai.OpenAI(base_url=live_server.v1, api_key="sekrit", max_retries=0)
        assert authed.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2).choices
    finally:
        ctx.api_key = None
    ctx.max_queue_len = 0
    try:
        with pytest.raises(openai.InternalServerError, match="overloaded") as info:
            client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
    finally:
        ctx.max_queue_len = None
    assert _greedy(client, "still serving", 2).choices  # and the server carries on


# ---- concurrency and cancellation ------------------------------------------------------------


def test_64_concurrent_streams(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    expected = {p: _greedy(client, p, 12).choices[0].text for p in PROMPTS}
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=live_server.v1, api_key="EMPTY", max_retries=0)

        async def one(prompt: str) -> str:
            stream = await aclient.completions.create(
                model=TEST_MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert results == [expected[p] for p in prompts]


def _long_request(stream: bool) -> dict:
    return {"model": TEST_MODEL, "prompt": PROMPTS[0], "max_tokens": 1900, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def _assert_aborted_and_freed(server: LiveServer, aborts_before: float) -> None:
    # The abort reaches the engine within one step; the pool is whole again right after.
    waited = _wait_for(lambda: _metric(server, "vllm:request_success_total", finished_reason="abort")
                       > aborts_before, 5)
    _wait_for(lambda: _metric(server, "pagedserve:kv_blocks_used") == 0, 2)
    assert waited < 3
    server.wait_idle()
    server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


def test_stream_disconnect_frees_blocks(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    aborts = _metric(live_server, "vllm:request_success_total", finished_reason="abort")
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", live_server.v1 + "/completions", json=_long_request(True)) as resp:
            lines = resp.iter_lines()
            for _ in range(3):
                assert next(line for line in lines if line.startswith("data:"))
            assert _metric(live_server, "pagedserve:kv_blocks_used") > 0
    _assert_aborted_and_freed(live_server, aborts)
    assert _greedy(client, PROMPTS[0], 2).choices


def test_non_stream_disconnect_frees_blocks(live_server: LiveServer, client: openai.OpenAI) -> None:  # noqa: F811
    aborts = _metric(live_server, "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(live_server.v1 + "/completions", json=_long_request(False), timeout=httpx.Timeout(30, read=0.5))
    _assert_aborted_and_freed(live_server, aborts)
    assert _greedy(client, PROMPTS[0], 2).choices


def test_metrics_names(live_server: LiveServer) -> None:  # noqa: F811
    text = httpx.get(live_server.base_url + "/metrics").text
    for name in ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:request_queue_time_seconds_bucket",
                 "vllm:request_prefill_time_seconds_bucket", "vllm:request_decode_time_seconds_bucket",
                 "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "pagedserve:kv_blocks_used", "pagedserve:kv_blocks_total"]:
        assert re.search(rf"^{re.escape(name)}\{{", text, re.M), name
    assert _metric(live_server, "vllm:generation_tokens_total") > 0
    assert _metric(live_server, "pagedserve:kv_blocks_total") > 0


def test_request_phase_histograms(live_server: LiveServer) -> None:  # noqa: F811
    """vLLM's queue / prefill / decode histograms: one observation per finished request, and the
    three phases add up to no more than the request's end-to-end latency."""
    live_server.wait_idle()
    phases = ["vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"]
    names = [*phases, "vllm:e2e_request_latency_seconds"]
    before = {n: (_metric(live_server, n + "_count"), _metric(live_server, n + "_sum")) for n in names}
    client = openai.OpenAI(base_url=live_server.v1, api_key="x", max_retries=0)
    assert _greedy(client, PROMPTS[0], 6, ignore_eos=True).usage.completion_tokens == 6
    live_server.wait_idle()
    after = {n: (_metric(live_server, n + "_count"), _metric(live_server, n + "_sum")) for n in names}
    for name in names:
        assert after[name][0] == before[name][0] + 1, name
    spent = {n: after[n][1] - before[n][1] for n in names}
    assert spent["vllm:request_decode_time_seconds"] > 0  # 6 tokens: the last comes after the first
    assert sum(spent[n] for n in phases) <= spent["vllm:e2e_request_latency_seconds"] + 1e-3


def test_no_leaks_when_idle(live_server: LiveServer) -> None:  # noqa: F811
    live_server.wait_idle()
    live_server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
    assert _metric(live_server, "pagedserve:kv_blocks_used") == 0


# ---- the engine loop without a model ----------------------------------------------------------


class _FakeEngine:
    """Stands in for LLMEngine: one token per step per request, or whatever `step_fn` does."""

    tokenizer = None
    max_model_len = 64
    vocab_size = 100
    hidden_size = 16
    structured_outputs = None  # no grammar manager (no tokenizer)
    # The real processor for a tokenizer-less model of this size (the handlers call it).
    input_processor = InputProcessor(None, vocab_size, max_model_len, [])

    def __init__(self, step_fn=None) -> None:
        self.requests: dict[str, int] = {}
        self.step_fn = step_fn
        self.shut_down = False

    def get_stats(self):
        from pagedserve.core.scheduler import SchedulerStats
        from pagedserve.engine.llm_engine import EngineStats

        sched = SchedulerStats(
            num_running=len(self.requests), num_waiting=0, num_preemptions_total=0, kv_blocks_used=0,
            kv_blocks_total=8, kv_usage=0.0, prefix_cache_queries=0, prefix_cache_hits=0,
        )
        return EngineStats(sched, 0, 0, 0, 0)

    def add_request(self, request_id, prompt, params, arrival_time=None, lora_request=None, priority=0) -> str:
        if prompt == "bad":
            raise ValueError("prompt is bad")
        self.requests[request_id] = 0
        return request_id

    def abort_request(self, ids) -> None:
        for request_id in ids:
            self.requests.pop(request_id, None)

    def health_problem(self) -> None:
        return None

    def shutdown(self) -> None:
        """The async engine stops the engine's tensor-parallel workers when its loop ends."""
        self.shut_down = True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        from pagedserve.outputs import CompletionOutput, RequestOutput

        if self.step_fn is not None:
            self.step_fn()
        time.sleep(0.01)
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] += 1
            done = self.requests[request_id] >= 3
            outputs.append(RequestOutput(request_id, None, [1], [CompletionOutput(
                0, "x", [5], None, None, "length" if done else None)], finished=done))
            if done:
                del self.requests[request_id]
        return outputs


def test_async_engine_validation_then_death() -> None:
    from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError

    steps = {"n": 0}

    def step_fn() -> None:
        steps["n"] += 1
        if steps["n"] > 4:
            raise RuntimeError("boom")

    async def scenario() -> None:
        fake = _FakeEngine(step_fn)
        engine = AsyncLLMEngine(fake)
        engine.start()
        with pytest.raises(ValueError, match="prompt is bad"):
            await engine.add_requests([("ok", SamplingParams()), ("bad", SamplingParams())])
        outputs = [o async for o in engine.generate("ok", SamplingParams())]
        assert [o.finished for o in outputs] == [False, False, True] and engine.health() is None
        with pytest.raises(EngineDeadError, match="boom"):
            async for _ in engine.generate("ok", SamplingParams()):
                pass
        assert "died" in engine.health()
        with pytest.raises(EngineDeadError):
            await engine.add_requests([("ok", SamplingParams())])
        await engine.shutdown()  # joins the dead loop's thread
        assert fake.shut_down  # a dead loop stops the engine (its tensor-parallel workers)

    asyncio.run(scenario())


def test_async_engine_stall_makes_health_fail() -> None:
    import threading

    from pagedserve.engine.async_engine import AsyncLLMEngine

    release = threading.Event()

    async def scenario() -> None:
        engine = AsyncLLMEngine(_FakeEngine(lambda: release.wait(5)), stall_timeout_s=0.2)
        engine.start()
        assert engine.health() is None
        stream = engine.generate("ok", SamplingParams())
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.5)
        assert "stalled" in engine.health()
        release.set()
        await task
        await stream.aclose()
        await asyncio.sleep(0.1)
        assert engine.health() is None
        await engine.shutdown()

    asyncio.run(scenario())


def test_error_after_stream_started_is_an_error_chunk() -> None:
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.server.api_server import build_app
    from pagedserve.server.metrics import ServerMetrics
    from pagedserve.server.serving_common import ServerContext

    steps = {"n": 0}

    def step_fn() -> None:
        steps["n"] += 1
        if steps["n"] == 2:
            raise RuntimeError("kernel exploded")

    async def scenario() -> None:
        metrics = ServerMetrics("fake")
        engine = AsyncLLMEngine(_FakeEngine(step_fn), metrics)
        app = build_app(ServerContext(engine, ["fake"], "/nowhere", metrics))
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            resp = await http.post("/v1/completions", json={"prompt": [1, 2], "stream": True})
            events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
            assert '"text":"x"' in events[0] and "kernel exploded" in events[1] and events[2] == "[DONE]"
            health = await http.get("/health")
            assert health.status_code == 503 and "died" in health.json()["error"]["message"]
            resp = await http.post("/v1/completions", json={"prompt": [1, 2]})
            assert resp.status_code == 503

    asyncio.run(scenario())


# ---- CLI ----------------------------------------------------------------------------------------


def test_parse_bytes() -> None:
    from pagedserve.engine_args import parse_bytes

    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MB") == 512 * 10**6 and parse_bytes("1e9") == 10**9
    assert parse_bytes("64MiB") == 64 << 20 and parse_bytes("4096") == 4096
    for bad in ["", "2 parsecs", "-1GiB", "0"]:
        with pytest.raises(Exception, match="size"):
            parse_bytes(bad)


def test_cli_help_is_fast() -> None:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pagedserve", "serve", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--kv-cache-memory" in out.stdout and "--no-enable-prefix-caching" in out.stdout
    assert time.monotonic() - start < 5
    probe = "import sys, pagedserve.entrypoints.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


def test_sigterm_shuts_down_gracefully_exit_0(tmp_path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "serve", TEST_MODEL, "--port", str(port), "--kv-cache-memory",
         "8MiB", "--log-level", "warning", "--shutdown-timeout", "0.2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, proc.stdout.read()
            try:
                return httpx.get(base + "/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        _wait_for(up, 60)
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", base + "/v1/completions", json=_long_request(True)) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
        assert proc.wait(30) == 0
        # Cut short after the 0.2 s grace period (the test model writes the request's 1,900 tokens
        # in well under a second): an error chunk, then [DONE].
        assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2], rest[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_return_tokens_as_token_ids(live_server: LiveServer) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=live_server.v1, api_key="x", max_retries=0)
    plain = _greedy(client, PROMPTS[0], 5, logprobs=2, return_token_ids=True)
    as_ids = _greedy(client, PROMPTS[0], 5, logprobs=2, return_token_ids=True, return_tokens_as_token_ids=True)
    choice = as_ids.choices[0]
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
    assert choice.logprobs.token_logprobs == plain.choices[0].logprobs.token_logprobs
    assert all(re.fullmatch(r"token_id:\d+", key) for top in choice.logprobs.top_logprobs for key in top)
    chat = client.chat.completions.create(
        model=TEST_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=2, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(re.fullmatch(r"token_id:\d+", top.token) for c in content for top in c.top_logprobs)
