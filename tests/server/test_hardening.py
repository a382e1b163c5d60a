"""Issue #13: no single request can take the engine down; the server keeps its promises.

Each numbered defect of the issue has a regression test here (the issue's number in the
test's docstring); the parametrized bad-input table and the idle test are here too. The
OpenAPI fuzz run is tests/server/test_fuzz.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
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

from lora_utils import make_peft_adapter
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


def _batch() -> dict[str, tuple[str, SamplingParams]]:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, n=2, max_tokens=12, ignore_eos=True)
    return {**{f"r{i}": (prompt, greedy) for i, prompt in enumerate(PROMPTS)}, "s": ("Sampled", seeded)}


@pytest.fixture(scope="module")
def reference(model_path) -> dict:
    """The batch's outputs with no fault (the oracle: the same engine, nothing injected)."""
    return _run(_engine(model_path), _batch())


@pytest.mark.parametrize("point", ["sampling_inputs", "detokenize"])
def test_one_request_failing_alone_leaves_the_batch(model_path, reference, point) -> None:
    """#13.1 (the class): one request's failure ends it alone; the others' tokens are unchanged."""
    requests, want = _batch(), reference
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
    again = _run(engine, {"after": requests["r0"]})
    assert again["after"].outputs[0].token_ids == want["r0"].outputs[0].token_ids


# ---- the server ---------------------------------------------------------------------------------

HUGE = "hello world " * 850_000  # 10.2M characters


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """One server for this module: --stall-timeout 2 (the idle test) and runtime LoRA updates
    confined to a --lora-dir root holding one adapter."""
    root = tmp_path_factory.mktemp("lora_root")
    adapter = make_peft_adapter(model_path(TEST_MODEL), None, 8, ["q_proj", "v_proj"], seed=1)
    shutil.copytree(adapter, root / "sql")
    argv = [TEST_MODEL, *SERVE_ARGS, "--stall-timeout", "2", "--enable-lora", "--enable-lora-runtime-updates",
            "--lora-dir", str(root), "--max-lora-rank", "16"]
    with running_server(argv) as live:
        live.lora_root = root
        yield live


def _post(server: LiveServer, path: str, body: object, **kwargs) -> httpx.Response:
    # json.dumps escapes lone surrogates as \ud800 and writes NaN / Infinity literals, as a
    # careless client would; raw bytes go through unchanged.
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.base_url + path, content=content, headers={"content-type": "application/json"},
                      timeout=60, **kwargs)


def _assert_names(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    # vLLM's context-length message is kept word for word; its param names the field.
    named = param in error["message"] or error["code"] == "context_length_exceeded"
    assert error["param"] == param and named, error


def _healthy(server: LiveServer) -> None:
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_huge_seed_is_400_and_the_engine_lives(server: LiveServer) -> None:
    """#13.1 over HTTP: the seeds that used to kill the engine thread are 400 naming `seed`."""
    for seed in (18446744073709551616, 10**30, -(2**63) - 1):
        resp = _post(server, "/v1/completions", {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 4, "seed": seed})
        _assert_names(resp, "seed")
    ok = _post(server, "/v1/completions", {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 4, "seed": 2**64 - 1,
                                           "n": 2, "temperature": 1.0})
    assert ok.status_code == 200, ok.text
    _healthy(server)


def test_failing_request_is_an_error_for_it_alone_over_http(model_path) -> None:
    """#13.1 over HTTP: a request that fails in the engine gets a 500 (or an error chunk when
    streamed); the requests around it are served and /health stays 200."""
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.server.api_server import build_app
    from pagedserve.server.metrics import ServerMetrics
    from pagedserve.server.serving_common import ServerContext

    # The async engine names its requests req-<call>-<prompt>, counting calls from 0; sample i
    # of an n > 1 request is <request>#i.
    faults = FailRequests("detokenize", ["req-1-0", "req-2-0#1"])
    metrics = ServerMetrics(TEST_MODEL)
    engine = AsyncLLMEngine(_engine(model_path, faults), metrics)
    app = build_app(ServerContext(engine, [TEST_MODEL], model_path(TEST_MODEL), metrics))
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def scenario() -> None:
        engine.start()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            first = await http.post("/v1/completions", json=body)
            failed = await http.post("/v1/completions", json=body)
            assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
            streamed = await http.post("/v1/completions", json={**body, "n": 2, "temperature": 1.0, "stream": True})
            events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and "injected fault" in events[-2]
            last = await http.post("/v1/completions", json=body)
            assert first.status_code == last.status_code == 200
            assert first.json()["choices"][0]["text"] == last.json()["choices"][0]["text"]
            assert (await http.get("/health")).status_code == 200
        await asyncio.sleep(0.2)
        engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
        await engine.shutdown()

    asyncio.run(scenario())


def test_idle_server_is_not_stalled(server: LiveServer) -> None:
    """#13.2: --stall-timeout 2, one request, 3 s idle: /health is still 200."""
    resp = _post(server, "/v1/completions", {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200
    time.sleep(3)
    _healthy(server)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "\ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok", "bad \udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "model": "\ud800"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
])
def test_lone_surrogate_is_400_naming_the_field(server: LiveServer, path: str, body: dict, param: str) -> None:
    """#13.3: a lone surrogate is a 400 naming the field, and the connection stays usable."""
    raw = json.dumps(body).encode()
    assert b"\\ud8" in raw or b"\\udf" in raw  # sent as the JSON escape, as a client would
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        resp = http.post(path, content=raw, headers={"content-type": "application/json"})
        _assert_names(resp, param)
        assert http.get("/health").status_code == 200  # same keep-alive connection


def test_long_prompt_refused_before_tokenizing(server: LiveServer) -> None:
    """#13.4: a text whose length proves it cannot fit is refused by its character count;
    text that is tokenized is tokenized in the tokenize worker, not on the event loop."""
    for path, body, param in [
        ("/v1/completions", {"prompt": HUGE}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
        ("/tokenize", {"prompt": HUGE}, "prompt"),
    ]:
        resp = _post(server, path, {"model": TEST_MODEL, **body})
        _assert_names(resp, param)
        assert f"has {len(HUGE)} characters" in resp.json()["error"]["message"]
    limit = server.ctx.processor.char_limit
    long_ok = "a" * (limit // 4)
    assert _post(server, "/tokenize", {"prompt": long_ok}).status_code == 200
    assert any(t.name.startswith("pagedserve-tokenize") for t in threading.enumerate())
    _healthy(server)


def _adapter_copy(server: LiveServer, name: str) -> os.PathLike:
    folder = server.lora_root / name
    if not folder.exists():
        shutil.copytree(server.lora_root / "sql", folder)
    return folder


@pytest.mark.parametrize("linked", ["adapter_model.safetensors", "adapter_config.json"])
def test_symlinked_adapter_file_outside_the_root_is_refused(server: LiveServer, tmp_path, linked: str) -> None:
    """#13.5: every file read for an adapter must resolve inside the --lora-dir root."""
    folder = _adapter_copy(server, f"sneaky-{linked.split('.')[0]}")
    outside = tmp_path / linked
    if not (folder / linked).is_symlink():
        shutil.move(folder / linked, outside)
        os.symlink(outside, folder / linked)
    resp = _post(server, "/v1/load_lora_adapter", {"lora_name": f"sneaky-{linked}", "lora_path": str(folder)})
    _assert_names(resp, "lora_path")
    assert "resolves outside" in resp.json()["error"]["message"]
    assert f"sneaky-{linked}" not in server.ctx.loras.adapters


@pytest.mark.parametrize(("body", "param"), [
    ({"lora_name": "nul", "lora_path": "/tmp/a\u0000b"}, "lora_path"),
    ({"lora_name": "long", "lora_path": "/tmp/" + "x" * 5000}, "lora_path"),
    ({"lora_name": "n" * 5000, "lora_path": "/tmp"}, "lora_name"),
    ({"lora_name": "", "lora_path": "/tmp"}, "lora_name"),
    ({"lora_name": "nul\u0000", "lora_path": "/tmp"}, "lora_name"),
])
def test_bad_adapter_names_and_paths_are_400(server: LiveServer, body: dict, param: str) -> None:
    """#13.6 and #13.7 (empty name): 400 naming the field, never a 500; nothing registered."""
    path_in_root = str(server.lora_root / "sql")
    body = {**body, "lora_path": body["lora_path"].replace("/tmp", path_in_root)}
    _assert_names(_post(server, "/v1/load_lora_adapter", body), param)
    assert body["lora_name"] not in server.ctx.loras.adapters


def test_concurrent_loads_of_one_name_exactly_one_wins(server: LiveServer) -> None:
    """#13.7: of 8 concurrent loads of one lora_name, exactly one succeeds."""
    folder = _adapter_copy(server, "twin")
    body = {"lora_name": "twin", "lora_path": str(folder)}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post(server, "/v1/load_lora_adapter", body), range(8)))
    assert sorted(r.status_code for r in answers) == [200] + [400] * 7
    assert all("already loaded" in r.json()["error"]["message"] for r in answers if r.status_code == 400)
    models = httpx.get(server.v1 + "/models").json()["data"]
    assert [m["id"] for m in models].count("twin") == 1
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "twin"}).status_code == 200


def test_queue_full_503_has_retry_after(server: LiveServer) -> None:
    """#13.9: the overload 503 tells the client when to retry."""
    server.ctx.max_queue_len = 0
    try:
        resp = _post(server, "/v1/completions", {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 2})
    finally:
        server.ctx.max_queue_len = None
    assert resp.status_code == 503 and int(resp.headers["retry-after"]) >= 1


def test_openapi_document_describes_the_server(server: LiveServer) -> None:
    """#13.8: error statuses and real content types documented; no 422; models strict."""
    doc = httpx.get(server.base_url + "/openapi.json").json()
    assert "422" not in json.dumps(doc["paths"]) and "HTTPValidationError" not in json.dumps(doc)
    completions = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "500", "503"} <= set(completions)
    assert {"application/json", "text/event-stream"} <= set(completions["200"]["content"])
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert not doc["paths"]["/health"]["get"]["responses"]["200"].get("content")
    assert "503" in doc["paths"]["/health"]["get"]["responses"]
    # What the document forbids, the server refuses.
    _assert_names(_post(server, "/detokenize", {"tokens": [False]}), "tokens")
    _assert_names(_post(server, "/v1/completions", {"prompt": "hi", "min_tokens": 0.0}), "min_tokens")
    # What it allows, the server takes: /tokenize is one of two shapes.
    assert _post(server, "/tokenize", {"messages": [{"role": "user", "content": "x"}]}).status_code == 200
    _assert_names(_post(server, "/tokenize", {}), "prompt")
    # #37: null is absent, so the document admits null for every optional field; an unknown
    # field is not forbidden by the document (additionalProperties left open), nor by the server.
    request = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"type": "null"} in request["properties"]["n"]["anyOf"]
    assert {"type": "null"} in request["properties"]["stream"]["anyOf"]
    assert request.get("additionalProperties", True) is not False
    chat = {"model": TEST_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    assert _post(server, "/v1/chat/completions", {**chat, "n": None, "x_unknown": 1}).status_code == 200


# Fields of OpenAI's or vLLM's API that would change the output and that this server does
# not implement: each is a 400 naming it, never silently ignored (issues #16.6, #37.1). The
# whole list, with the reason for each, is request_fields.REFUSED (and
# docs/vllm_compatibility.md); an entry leaves both when implemented.
UNSUPPORTED = ["suffix", "audio", "verbosity", "logits_processors", "kv_transfer_params"]
# Any other unknown field is accepted (and logged once): #37.1 (c).
UNKNOWN = ["no_such_field", "metadata"]


@pytest.mark.parametrize("field", UNSUPPORTED + UNKNOWN)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unimplemented_field_is_400_naming_it(server: LiveServer, path: str, field: str) -> None:
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    resp = _post(server, path, {"model": TEST_MODEL, "max_tokens": 2, **base, field: {"type": "json_object"}})
    if field in UNKNOWN:
        assert resp.status_code == 200, resp.text
        return
    _assert_names(resp, field)
    assert "not supported" in resp.json()["error"]["message"]


# ---- the bad-input table ---------------------------------------------------------------------

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
NAN, INF = float("nan"), float("inf")

BAD_INPUTS = [
    # wrong types
    (CMPL, {"prompt": 5}, "prompt"), (CMPL, {"prompt": {"a": 1}}, "prompt"), (CMPL, {"max_tokens": "5"}, "max_tokens"),
    (CMPL, {"n": True}, "n"), (CMPL, {"temperature": "1"}, "temperature"), (CMPL, {"stop": [1]}, "stop"),
    (CMPL, {"logprobs": 1.0}, "logprobs"), (CMPL, {"seed": 1.5}, "seed"), (CMPL, {"stream": 1}, "stream"),
    (CMPL, {"min_tokens": 0.0}, "min_tokens"), (CMPL, {"prompt": [1, "a"]}, "prompt"),
    (CHAT, {"messages": "hi"}, "messages"), (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages"),
    (CHAT, {"messages": MSG, "logprobs": 1}, "logprobs"),
    # not implemented and would change the output (#37.1); a refused nested field names its parent
    (CMPL, {"suffix": "x"}, "suffix"), (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object", "whitespace": "x"}}, "response_format"),
    ("/tokenize", {"prompt": "a", "messages": MSG}, "prompt"),
    # out of range
    (CMPL, {"temperature": -1}, "temperature"), (CMPL, {"top_p": 0}, "top_p"), (CMPL, {"n": 1000}, "n"),
    (CMPL, {"max_tokens": 10**12}, "max_tokens"), (CMPL, {"seed": 2**64}, "seed"), (CMPL, {"seed": -(2**63) - 1}, "seed"),
    (CMPL, {"top_k": -5}, "top_k"), (CMPL, {"min_tokens": 10**9}, "min_tokens"), (CMPL, {"best_of": 10**6}, "best_of"),
    (CMPL, {"logprobs": 10**6}, "logprobs"), (CMPL, {"repetition_penalty": 1e308}, "repetition_penalty"),
    (CHAT, {"messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 99, "logprobs": True}, "top_logprobs"),
    # NaN / Infinity (JSON has neither; Python's parser reads them)
    (CMPL, {"temperature": NAN}, "temperature"), (CMPL, {"top_p": INF}, "top_p"),
    (CMPL, {"presence_penalty": -INF}, "presence_penalty"), (CMPL, {"logit_bias": {"5": NAN}}, "logit_bias"),
    (CHAT, {"messages": MSG, "frequency_penalty": NAN}, "frequency_penalty"),
    # empty and huge prompts
    (CMPL, {"prompt": []}, "prompt"), (CMPL, {"prompt": [[]]}, "prompt"), (CMPL, {"prompt": ""}, None),
    (CMPL, {"prompt": HUGE}, "prompt"), (CMPL, {"prompt": [7] * 100_000}, "prompt"),
    (CMPL, {"prompt": ["a"] * 2000, "max_tokens": 1}, "n"),
    (CHAT, {"messages": []}, "messages"), (CHAT, {"messages": [{"role": "user", "content": HUGE}]}, "messages"),
    # invalid UTF-8, surrogates
    (CMPL, b'{"prompt": "\xff\xfe"}', None), (CMPL, b'{"prompt": "hi", "stop": "\xc3"}', None),
    (CMPL, {"prompt": "\ud800"}, "prompt"), (CMPL, {"user": "\udc00"}, "user"),
    (CMPL, {"logit_bias": {"\ud800": 1}}, "logit_bias"),
    # out-of-vocabulary token ids
    (CMPL, {"prompt": [10**6]}, "prompt"), (CMPL, {"prompt": [-1]}, "prompt"), (CMPL, {"prompt": [[1], [10**9]]}, "prompt"),
    (CMPL, {"stop_token_ids": [10**6]}, "stop_token_ids"), (CMPL, {"stop_token_ids": [-1]}, "stop_token_ids"),
    # many stop strings, bad logit_bias keys
    (CMPL, {"stop": ["x"] * 10_000}, "stop"), (CMPL, {"stop": [""]}, "stop"),
    (CMPL, {"logit_bias": {"abc": 1}}, "logit_bias"), (CMPL, {"logit_bias": {"-1": 1}}, "logit_bias"),
    (CMPL, {"logit_bias": {"1.5": 1}}, "logit_bias"), (CMPL, {"logit_bias": {"": 1}}, "logit_bias"),
    (CMPL, {"logit_bias": {"99999999999": 1}}, "logit_bias"), (CMPL, {"logit_bias": {"99999": 1}}, "logit_bias"),
    (CMPL, {"logit_bias": {"5": 101}}, "logit_bias"),
    # /tokenize and /detokenize
    ("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": HUGE}, "prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": [False]}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1.5]}, "tokens"), ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": [1], "model": "nope"}, "model"),
    # the LoRA admin routes
    ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/tmp"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": 5, "lora_path": "/tmp"}, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "a"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/etc"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp/\u0000"}, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "\ud800"}, "lora_path"),
    ("/v1/unload_lora_adapter", {"lora_name": ""}, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": ["a"]}, "lora_name"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_INPUTS, ids=lambda x: repr(x)[:50])
def test_bad_input_table(server: LiveServer, path: str, body: dict | bytes, param: str | None) -> None:
    """Every answer < 500; every 400 names the field (None: no single field to name, e.g.
    a body that is not UTF-8 JSON); the server stays healthy."""
    if isinstance(body, dict) and path in (CMPL, CHAT):
        base = {"prompt": "hi"} if path == CMPL else {"messages": MSG}
        body = {"model": TEST_MODEL, "max_tokens": 2, **base, **body}
    resp = _post(server, path, body)
    assert resp.status_code < 500, resp.text
    if resp.status_code == 400 and param is not None:
        _assert_names(resp, param)
    elif param is not None:
        assert resp.status_code == 404 and resp.json()["error"]["param"] == param, resp.text
    _healthy(server)


def test_server_is_clean_after_the_table(server: LiveServer) -> None:
    server.wait_idle()
    server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
    _healthy(server)
