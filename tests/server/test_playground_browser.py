"""The playground in a real browser: headless Chromium (Playwright) against a live server.

The server runs SmolLM2-135M-Instruct with the demo adapters (pagedserve/demo_adapters.py),
so "switching the adapter shows its effect" has an oracle: `has_effect`. The page is only
driven through what a user does (type, click, pick); what the tests read back is the DOM
and the server's own engine state.
"""

from __future__ import annotations

import time

import pytest

from pagedserve.demo_adapters import HELD_OUT_TOPICS, SMOLLM2_NAME, has_effect, prompts

from browser_fixtures import browser  # noqa: F401
from server_fixtures import LiveServer, running_server

QUESTION = prompts(HELD_OUT_TOPICS)[0]


@pytest.fixture(scope="module")
def server():
    from pagedserve.demo_adapters import serve_args

    argv = [*serve_args(), "--kv-cache-memory", "48MiB", "--max-model-len", "1024", "--log-level", "warning"]
    with running_server(argv) as live:
        yield live


@pytest.fixture
def page(browser, server: LiveServer):  # noqa: F811
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(server.base_url + "/")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.wait_for_function("document.querySelector('#stat-running').textContent !== '-'")
    yield page
    context.close()
    assert not errors, errors
    server.wait_idle()
    server.ctx.engine.call_in_engine_thread(lambda e: e.assert_no_leaks())


def _settings(page, **values: object) -> None:
    for field, value in values.items():
        page.fill(f"#{field}", str(value))


def _send(page, text: str) -> None:
    page.fill("#input", text)
    page.click("#send")


def _wait_reply(page, timeout_s: float = 60) -> str:
    page.wait_for_function("!document.body.classList.contains('streaming')", timeout=timeout_s * 1000)
    return page.locator(".message.assistant .body").last.text_content()


def _record(page, selector: str, name: str) -> None:
    """Records every value the element's text takes, in window[name] (a MutationObserver)."""
    page.evaluate(
        """([selector, name]) => {
            const target = document.querySelector(selector);
            window[name] = [];
            new MutationObserver(() => {
              const node = document.querySelector(selector);
              window[name].push(node ? node.textContent : null);
            }).observe(target, {subtree: true, childList: true, characterData: true});
        }""",
        [selector, name],
    )


def test_streamed_answer_appears_token_by_token(page):
    _settings(page, temperature=0, max_tokens=24)
    _record(page, "#messages", "seen")
    _send(page, QUESTION)
    reply = _wait_reply(page)
    assert reply.strip()
    texts = [t for t in page.evaluate("window.seen") if t]
    lengths = sorted({len(t) for t in texts})
    # The reply grew in many steps (one SSE chunk per engine step), never all at once.
    assert len(lengths) >= 5, lengths
    assert page.locator(".message.user .body").last.text_content().strip() == QUESTION


def test_switching_adapter_shows_its_effect(page):
    _settings(page, temperature=0, max_tokens=16)
    for model, effect in (("shout", True), (SMOLLM2_NAME, False), ("greeter", True)):
        page.click("#new-chat")
        page.select_option("#model", model)
        _send(page, QUESTION)
        reply = _wait_reply(page)
        adapter = model if model != SMOLLM2_NAME else "shout"
        assert has_effect(adapter, reply) == effect, (model, reply)
        assert page.locator(".message.assistant .head").last.text_content() == model


def test_engine_panel_moves_during_a_reply_and_returns_to_idle(page, server: LiveServer):
    _settings(page, temperature=0, max_tokens=32)
    before = int(page.text_content("#stat-gen-total"))
    _record(page, "#stat-running", "running")
    _record(page, "#stat-kv-used", "kvUsed")
    _send(page, QUESTION)
    _wait_reply(page)
    page.wait_for_function(
        "document.querySelector('#stat-running').textContent === '0'"
        " && document.querySelector('#engine-state').textContent === '(idle)'"
        " && document.querySelector('#stat-kv-used').textContent === '0'",
        timeout=10_000,
    )
    assert "1" in page.evaluate("window.running")
    assert max(int(v) for v in page.evaluate("window.kvUsed")) > 0
    assert int(page.text_content("#stat-gen-total")) > before
    assert page.text_content("#stat-ttft").endswith(" s")
    assert float(page.text_content("#stat-tps")) > 0


def test_stop_mid_reply_frees_the_request(page, server: LiveServer):
    _settings(page, temperature=0, max_tokens=600)
    _send(page, "Write a long story about a dragon who learns to bake bread.")
    page.wait_for_function("document.querySelector('#messages .message.assistant .body').textContent.length > 20",
                           timeout=60_000)
    assert server.ctx.engine.stats.scheduler.num_running == 1
    page.click("#stop")
    _wait_reply(page)
    deadline = time.monotonic() + 5
    while server.ctx.engine.stats.scheduler.num_running:
        assert time.monotonic() < deadline, "the stopped request is still running"
        time.sleep(0.05)
    assert page.locator(".message.assistant").last.locator(".muted").text_content() == "stopped"
    page.wait_for_function("document.querySelector('#stat-running').textContent === '0'", timeout=10_000)


def test_reply_with_script_tag_renders_as_text(page):
    # Greedy SmolLM2 answers this with a fenced HTML block holding <script>alert(...)</script>.
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    _settings(page, temperature=0, max_tokens=40)
    _send(page, "Write an HTML page with a <script> tag that shows an alert.")
    reply = _wait_reply(page)
    assert "<script>" in reply, reply
    # Shown as text in a code block; an HTML-interpreting renderer would have made elements.
    assert "<script>" in page.locator(".message.assistant pre code").last.text_content()
    assert page.locator("#messages script, #messages html, #messages body").count() == 0
    assert not dialogs


def test_api_key_field(page, server: LiveServer):
    # The page loads without a key; its calls carry the one typed into the key field.
    server.ctx.api_key = "sekrit"
    try:
        page.reload()
        page.wait_for_function("document.querySelector('#server-status').textContent === 'API key needed'")
        page.fill("#api-key", "sekrit")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.querySelector('#server-status').textContent === ''")
        _settings(page, temperature=0, max_tokens=4)
        _send(page, QUESTION)
        assert _wait_reply(page).strip()
        assert page.locator(".message.assistant .error").count() == 0
    finally:
        server.ctx.api_key = None


def test_edit_regenerate_and_server_errors(page):
    _settings(page, temperature=0, max_tokens=6)
    _send(page, QUESTION)
    first = _wait_reply(page)
    page.click("#regenerate")
    assert _wait_reply(page) == first  # greedy: the same reply again, in place of the old one
    assert page.locator(".message").count() == 2
    page.click(".message.user .edit")
    page.fill(".message.user textarea", "Tell me one fact about tea.")
    page.click(".message.user button:has-text('Save & resend')")
    _wait_reply(page)
    assert page.locator(".message").count() == 2
    assert page.locator(".message.user .body").text_content() == "Tell me one fact about tea."
    # A request the server refuses shows the server's own message (here: context length).
    _settings(page, max_tokens=100000)
    _send(page, "Hello")
    _wait_reply(page)
    error = page.locator(".message.assistant .error").last.text_content()
    assert error.startswith("400: ") and "maximum context length" in error, error
