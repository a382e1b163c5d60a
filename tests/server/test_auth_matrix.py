"""Issue #33.6: with --api-key, every route that does work needs the key; the matrix of every
route x (no key, wrong key, `Authorization: Bearer`, `x-api-key`) against a live server.

A route added to the app without a place in PUBLIC or KEYED fails
test_every_route_is_in_the_matrix, so the matrix cannot silently fall behind the app.
"""

from __future__ import annotations

import pathlib

import httpx
import pytest

import pagedserve

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server

KEY = "sk-test-33"

# (method, path, body): what a client sends to each route.
PUBLIC = [
    ("GET", "/health", None), ("GET", "/ping", None), ("POST", "/ping", None), ("GET", "/version", None),
    ("GET", "/", None), ("GET", "/playground/app.js", None), ("GET", "/docs", None), ("GET", "/openapi.json", None),
]
KEYED = [
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/embeddings", {"input": "hi"}),
    ("GET", "/v1/models", None), ("GET", f"/v1/models/{TEST_MODEL}", None),
    ("POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}),
    ("POST", "/v1/unload_lora_adapter", {"lora_name": "x"}),
    ("GET", "/v1/stats", None),
    ("POST", "/v1/responses", {"input": "hi", "max_output_tokens": 2}), ("GET", "/v1/responses/resp_x", None),
    ("POST", "/v1/messages", {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
    ("GET", "/load", None), ("GET", "/metrics", None),
]
AUTH = {
    "none": {},
    "wrong": {"Authorization": "Bearer not-the-key"},
    "wrong-x": {"x-api-key": "not-the-key"},
    "bearer": {"Authorization": f"Bearer {KEY}"},
    "x-api-key": {"x-api-key": KEY},
}


@pytest.fixture(scope="module")
def server():
    with running_server([TEST_MODEL, *SERVE_ARGS, "--api-key", KEY]) as live:
        yield live


def _call(live: LiveServer, method: str, path: str, body: object, headers: dict) -> httpx.Response:
    return httpx.request(method, live.base_url + path, json=body, headers=headers, timeout=60)


def test_every_route_is_in_the_matrix(server: LiveServer) -> None:
    from pagedserve.server.api_server import build_app

    app = build_app(server.ctx)
    paths = {getattr(route, "path", None) for route in app.routes} - {None, "/docs/oauth2-redirect", "/redoc"}
    listed = {p for _, p, _ in PUBLIC + KEYED} | {"/playground", "/docs-assets", "/v1/models/{model_id}",
                                               "/v1/responses/{response_id}"}
    assert paths <= listed, sorted(paths - listed)


@pytest.mark.parametrize("auth", list(AUTH))
@pytest.mark.parametrize(("method", "path", "body"), KEYED, ids=lambda x: x if isinstance(x, str) else None)
def test_keyed_route_needs_the_key(server: LiveServer, method: str, path: str, body: object, auth: str) -> None:
    resp = _call(server, method, path, body, AUTH[auth])
    if auth in ("bearer", "x-api-key"):
        assert resp.status_code != 401 and resp.status_code < 500, resp.text
    else:
        assert resp.status_code == 401, resp.text
        if path.startswith("/v1/messages"):  # Anthropic's error shape on its routes
            assert resp.json()["error"]["type"] == "authentication_error"
        else:
            assert resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("auth", list(AUTH))
@pytest.mark.parametrize(("method", "path", "body"), PUBLIC, ids=lambda x: x if isinstance(x, str) else None)
def test_public_route_needs_no_key(server: LiveServer, method: str, path: str, body: object, auth: str) -> None:
    assert _call(server, method, path, body, AUTH[auth]).status_code == 200


def test_no_adapter_names_leak_without_the_key(server: LiveServer) -> None:
    """#33.6 (b): /tokenize told which model names exist (200 vs 404) to anyone."""
    for model in (TEST_MODEL, "shout"):
        assert _call(server, "POST", "/tokenize", {"prompt": "hi", "model": model}, {}).status_code == 401


def test_public_metrics_flag_opens_metrics_alone() -> None:
    """--public-metrics: /metrics without the key; /tokenize and /load still need it."""
    with running_server([TEST_MODEL, *SERVE_ARGS, "--api-key", KEY, "--public-metrics"]) as live:
        assert _call(live, "GET", "/metrics", None, {}).status_code == 200
        assert _call(live, "POST", "/tokenize", {"prompt": "hi"}, {}).status_code == 401
        assert _call(live, "GET", "/load", None, {}).status_code == 401


def test_no_error_names_a_server_path(server: LiveServer) -> None:
    """#33.6 (c): the tools hint named the chat template by its install path. Tools on a template
    that cannot render them are served now (issue 37.3); `auto` without --enable-auto-tool-choice
    is still refused, and neither answer names where the server is installed."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    install = str(pathlib.Path(pagedserve.__file__).resolve().parent)
    for choice, status in (("auto", 400), ("required", 200)):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": tools,
                "tool_choice": choice}
        resp = _call(server, "POST", "/v1/chat/completions", body, AUTH["bearer"])
        assert resp.status_code == status, resp.text
        assert install not in resp.text
