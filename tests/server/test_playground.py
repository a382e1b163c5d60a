"""The playground's HTTP side (server/playground.py): the page, its assets, /v1/stats.

The browser behaviour is in test_playground_browser.py; here a plain HTTP client checks
what the page relies on, on the small `llama-gqa` test model.
"""

from __future__ import annotations

import re
from importlib import resources

import httpx
import pytest

from server_fixtures import TEST_MODEL, LiveServer, live_server  # noqa: F401

ASSETS = ("index.html", "app.js", "markdown.js", "style.css")


def test_assets_are_package_data() -> None:
    static = resources.files("pagedserve.server") / "static"
    for name in ASSETS:
        assert (static / name).is_file(), name
    # No CDN: every script and style sheet the page loads is one of ours.
    html = (static / "index.html").read_text()
    sources = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert sources and all(s.startswith("playground/") for s in sources), sources


def test_page_is_served_without_key_and_api_needs_it(live_server: LiveServer) -> None:  # noqa: F811
    ctx = live_server.ctx
    ctx.api_key = "sekrit"
    try:
        page = httpx.get(live_server.base_url + "/", timeout=60)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert 'id="api-key"' in page.text
        for name in ASSETS[1:]:
            asset = httpx.get(f"{live_server.base_url}/playground/{name}", timeout=60)
            assert asset.status_code == 200, name
        assert httpx.get(live_server.base_url + "/v1/stats", timeout=60).status_code == 401
        ok = httpx.get(live_server.base_url + "/v1/stats", headers={"Authorization": "Bearer sekrit"}, timeout=60)
        assert ok.status_code == 200
    finally:
        ctx.api_key = None


def test_no_model_text_reaches_inner_html() -> None:
    # The page's safety rule, checked on its source: model text goes through textContent
    # and createTextNode only.
    static = resources.files("pagedserve.server") / "static"
    for name in ("app.js", "markdown.js"):
        source = re.sub(r"^\s*//.*$", "", (static / name).read_text(), flags=re.M)  # code, not comments
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write", source), name


def _stats(server: LiveServer) -> dict:
    response = httpx.get(server.base_url + "/v1/stats", timeout=60)
    assert response.status_code == 200
    return response.json()


def test_stats_match_the_engine_and_metrics(live_server: LiveServer) -> None:  # noqa: F811
    before = _stats(live_server)
    kv = before["kv_blocks"]
    assert kv["used"] + kv["adapters"] + kv["cached"] + kv["free"] == kv["total"]
    assert before["requests"] == {"running": 0, "waiting": 0, "swapped": 0}
    prompt = "Paged attention stores keys and values in blocks " * 3
    for _ in range(2):  # the second one hits the first one's cached blocks
        r = httpx.post(live_server.v1 + "/completions", timeout=60,
                       json={"model": TEST_MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200
    after = _stats(live_server)
    assert after["tokens"]["generation_total"] - before["tokens"]["generation_total"] == 10
    assert after["prefix_cache"]["hits"] > before["prefix_cache"]["hits"]
    assert 0 < after["prefix_cache"]["hit_rate"] <= 1
    # Finished requests leave their full prompt blocks cached (free, but reusable).
    assert after["kv_blocks"]["cached"] > 0 and after["kv_blocks"]["used"] == 0
    metrics = httpx.get(live_server.base_url + "/metrics", timeout=60).text
    hits = re.search(r'^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$', metrics, re.M)
    assert hits and float(hits.group(1)) == after["prefix_cache"]["hits"]
    live_server.wait_idle()
    live_server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


@pytest.mark.parametrize("path", ["/", "/playground/app.js"])
def test_head_and_unknown_assets(live_server: LiveServer, path: str) -> None:  # noqa: F811
    assert httpx.get(live_server.base_url + path, timeout=60).status_code == 200
    assert httpx.get(live_server.base_url + "/playground/nope.js", timeout=60).status_code == 404
