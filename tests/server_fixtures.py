"""A live server for tests: uvicorn in a background thread of the test process, on 127.0.0.1.

In-process so tests can reach the engine (leak checks between steps) and tweak serving
options (API key, queue limit) without restarting it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pagedserve.entrypoints.chat_utils import builtin_template_path

TEST_MODEL = "llama-gqa"
SERVE_ARGS = ["--kv-cache-memory", "8MiB", "--log-level", "warning", "--stall-timeout", "30"]
# Tool calling on the test model: hermes, with the built-in template that renders tools.
TOOL_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", builtin_template_path()]


@dataclass
class LiveServer:
    base_url: str
    ctx: object  # pagedserve.server.serving_common.ServerContext
    model_path: str

    @property
    def v1(self) -> str:
        return self.base_url + "/v1"

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until the engine has no request at all (what a leak check needs)."""
        engine = self.ctx.engine
        deadline = time.monotonic() + timeout_s
        while engine.call_in_engine_thread(lambda e: e.has_unfinished_requests()):
            assert time.monotonic() < deadline, "engine did not become idle"
            time.sleep(0.02)

    def abort_count(self) -> float:
        """Requests the server has finished as aborted (vLLM's request_success_total, reason abort)."""
        import httpx

        text = httpx.get(self.base_url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line)

    def assert_no_leaks(self) -> None:
        """Idle, then the engine's leak check: every KV block free, every reference count zero."""
        self.wait_idle()
        self.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


def _bound_socket() -> socket.socket:
    # Bind port 0 and hand the socket to uvicorn: no race for a "free" port.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.fixture(scope="module")
def live_server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS]) as server:
        yield server


@contextlib.contextmanager
def running_server(serve_argv: list[str]) -> Iterator[LiveServer]:
    """A real server (uvicorn in a thread) for `pagedserve serve <serve_argv>`."""
    import uvicorn

    from pagedserve.entrypoints.cli import build_parser
    from pagedserve.entrypoints.model_source import engine_args_from
    from pagedserve.server.api_server import HTTPOptions, build_app
    from pagedserve.server.launch import build_context

    args = build_parser().parse_args(["serve", *serve_argv])
    engine_args, name = engine_args_from(args)
    model_path = str(engine_args.model)
    ctx = build_context(args, engine_args, name)
    sock = _bound_socket()
    port = sock.getsockname()[1]
    config = uvicorn.Config(build_app(ctx, HTTPOptions.from_cli_args(args)), log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", ctx, model_path)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def hf_prompt_tokens(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """The reference prompt length: the same chat rendered by transformers with TOOL_ARGS' template."""
    with open(builtin_template_path()) as f:
        template = f.read()
    return len(tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                             add_generation_prompt=True, tokenize=True, return_dict=False))
