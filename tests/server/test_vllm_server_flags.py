"""A `vllm serve` command line, program name changed, passes a request through the openai client."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from server_fixtures import TEST_MODEL, running_server

VLLM_ARGV = [
    "--model", TEST_MODEL, "--max-model-len", "1k", "--kv-cache-memory-bytes", "16MiB", "--swap-space", "0.01",
    "--enforce-eager", "--trust-remote-code", "--tokenizer-mode", "auto", "--load-format", "auto",
    "--disable-log-stats", "--disable-log-requests", "--uvicorn-log-level", "warning",
    "--api-key", "k1", "k2", "--allowed-origins", '["http://app.example"]', "--enable-request-id-headers",
    "--disable-fastapi-docs", "--scheduling-policy", "fcfs", "--max-num-seqs", "8",
    "--enable-server-load-tracking",
]


@pytest.fixture(scope="module")
def server():
    with running_server(VLLM_ARGV) as live:
        yield live


def test_vllm_command_line_serves_with_either_key(server) -> None:
    for key in ("k1", "k2"):
        client = openai.OpenAI(base_url=server.v1, api_key=key, max_retries=0)
        assert client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="k3", max_retries=0).models.list()
    card = openai.OpenAI(base_url=server.v1, api_key="k1", max_retries=0).models.retrieve(TEST_MODEL)
    assert card.id == TEST_MODEL
    missing = httpx.get(server.v1 + "/models/nope", headers={"Authorization": "Bearer k1"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_cors_request_id_ping_and_docs(server) -> None:
    preflight = httpx.options(server.v1 + "/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(server.v1 + "/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    echoed = httpx.get(server.base_url + "/ping", headers={"X-Request-Id": "abc-123"})
    assert echoed.status_code == 200 and echoed.headers["x-request-id"] == "abc-123"
    assert httpx.post(server.base_url + "/ping").headers["x-request-id"]
    assert httpx.get(server.base_url + "/docs").status_code == 404
    assert httpx.get(server.base_url + "/openapi.json").status_code == 404


def test_load_counts_requests_in_flight(server) -> None:
    # /load tells about the server: behind the key (issue #33.6).
    assert httpx.get(server.base_url + "/load").status_code == 401
    key = {"Authorization": "Bearer k2"}
    assert httpx.get(server.base_url + "/load", headers=key).json() == {"server_load": 0}
    body = {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 900, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reply = pool.submit(httpx.post, server.v1 + "/completions", json=body,
                            headers={"Authorization": "Bearer k1"}, timeout=120)
        seen = set()
        while not reply.done():
            seen.add(httpx.get(server.base_url + "/load", headers=key).json()["server_load"])
        assert reply.result().status_code == 200
    assert 1 in seen and seen <= {0, 1}
    assert httpx.get(server.base_url + "/load", headers=key).json() == {"server_load": 0}


def test_api_key_from_vllm_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.server.launch import api_keys

    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert api_keys(None) == ["from-env"] and api_keys(["a", "b"]) == ["a", "b"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert api_keys(None) is None


def test_priority_field_needs_the_priority_policy(server) -> None:
    body = {"model": TEST_MODEL, "prompt": "hi", "max_tokens": 2, "priority": 3}
    resp = httpx.post(server.v1 + "/completions", json=body, headers={"Authorization": "Bearer k1"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "priority"
    body["priority"] = 0
    assert httpx.post(server.v1 + "/completions", json=body, headers={"Authorization": "Bearer k1"}).status_code == 200


def test_priority_orders_waiting_requests() -> None:
    """--scheduling-policy priority, one sequence at a time: of two requests waiting behind a
    running one, the lower priority value runs first, whatever their arrival order."""
    argv = ["--model", TEST_MODEL, "--kv-cache-memory-bytes", "16MiB", "--scheduling-policy", "priority",
            "--max-num-seqs", "1"]
    with running_server(argv) as live:
        client = openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0)

        def complete(priority: int, max_tokens: int) -> float:
            client.completions.create(model=TEST_MODEL, prompt="hi", max_tokens=max_tokens,
                                      extra_body={"priority": priority, "ignore_eos": True})
            return time.monotonic()

        def waiting() -> int:
            return live.ctx.engine.call_in_engine_thread(lambda e: e.get_stats().scheduler.num_waiting)

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(complete, 0, 400)
            while httpx.get(live.base_url + "/load").json()["server_load"] < 1:
                time.sleep(0.005)
            late_low = pool.submit(complete, 5, 4)
            while waiting() < 1:
                time.sleep(0.005)
            late_high = pool.submit(complete, -1, 4)
            while waiting() < 2 and not first.done():
                time.sleep(0.005)
            assert not first.done(), "the running request finished before both others queued"
            assert late_high.result() < late_low.result()
            first.result()
        live.wait_idle()
        live.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
