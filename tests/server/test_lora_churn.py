"""Issue #33's LoRA churn test: concurrent streams while one adapter is loaded and unloaded
over and over. Every answer is the adapter's own output (greedy: its tokens equal the
adapter's reference, the base model's differ) or a clean 404 naming it; no 5xx; at the end
the engine's registered adapters are exactly /v1/models' and every KV block is free.

Scaled to the CI's two cores: 12 streams for ~8 s (the issue's 50 for 30 s is the same test
with bigger numbers: CHURN_STREAMS / CHURN_SECONDS).
"""

from __future__ import annotations

import json
import shutil
import threading
import time

import httpx
import pytest

from hf_reference import make_prompts
from lora_utils import make_peft_adapter
from server_fixtures import SERVE_ARGS, TEST_MODEL, running_server

CHURN_STREAMS = 12
CHURN_SECONDS = 8.0
NAME = "churn"


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_root")
    adapter = make_peft_adapter(model_path(TEST_MODEL), None, 8, ["q_proj", "v_proj"], seed=1)
    shutil.copytree(adapter, root / NAME)
    argv = [TEST_MODEL, *SERVE_ARGS, "--enable-lora", "--enable-lora-runtime-updates",
            "--lora-dir", str(root), "--max-lora-rank", "16"]
    with running_server(argv) as live:
        live.lora_root = root
        yield live


def _stream(http: httpx.Client, model: str, prompt: list[int]) -> tuple[int, list[int], dict | None]:
    """(status, generated token ids, the error body if the answer was one)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True,
            "return_token_ids": True}
    tokens: list[int] = []
    with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp.status_code, tokens, resp.json()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return event["error"].get("code") == "model_not_found" and 404 or 500, tokens, event
            for choice in event["choices"]:
                tokens += choice.get("token_ids") or []
    return 200, tokens, None


def test_lora_churn(server) -> None:
    http = httpx.Client(base_url=server.base_url, timeout=60)
    (prompt,) = make_prompts(1024, [10], seed=9)
    path = str(server.lora_root / NAME)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": path}).status_code == 200
    status, reference, _ = _stream(http, NAME, prompt)
    assert status == 200 and len(reference) == 8
    assert _stream(http, TEST_MODEL, prompt)[1] != reference  # the adapter's answer is recognisable

    stop = threading.Event()
    problems: list[str] = []
    counts = {"ok": 0, "404": 0}
    lock = threading.Lock()

    def client() -> None:
        with httpx.Client(base_url=server.base_url, timeout=60) as own:
            while not stop.is_set():
                status, tokens, error = _stream(own, NAME, prompt)
                with lock:
                    if status == 200 and tokens == reference:
                        counts["ok"] += 1
                    elif status == 404 and NAME in (error or {}).get("error", {}).get("message", "") \
                            and tokens == reference[:len(tokens)]:
                        counts["404"] += 1
                    else:
                        problems.append(f"{status} {tokens} {error}")

    threads = [threading.Thread(target=client) for _ in range(CHURN_STREAMS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + CHURN_SECONDS
    cycles = 0
    try:
        while time.monotonic() < deadline:
            unload = http.post("/v1/unload_lora_adapter", json={"lora_name": NAME})
            assert unload.status_code == 200, unload.text
            time.sleep(0.05)
            load = http.post("/v1/load_lora_adapter", json={"lora_name": NAME, "lora_path": path})
            assert load.status_code == 200, load.text
            time.sleep(0.2)
            cycles += 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not problems, problems[:5]
    assert cycles >= 5 and counts["ok"] > 0 and counts["404"] > 0, (cycles, counts)

    server.wait_idle()
    engine = server.ctx.engine
    registered = engine.call_in_engine_thread(lambda e: {r.lora_name for r in e.lora_manager.registered.values()})
    listed = {m["id"] for m in http.get("/v1/models").json()["data"]} - {TEST_MODEL}
    assert registered == listed == {NAME}
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": NAME}).status_code == 200
    assert engine.call_in_engine_thread(lambda e: e.lora_manager.registered) == {}
    engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
    http.close()
