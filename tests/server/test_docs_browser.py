"""/docs and /redoc render offline: a real browser with every request beyond this server cut off."""

from __future__ import annotations

from urllib.parse import urlparse

import httpx
import pytest

from browser_fixtures import browser  # noqa: F401
from server_fixtures import TEST_MODEL, running_server


@pytest.fixture(scope="module")
def server():
    argv = ["--model", TEST_MODEL, "--kv-cache-memory-bytes", "16MiB"]
    with running_server(argv) as live:
        yield live


def _render(browser, server, path: str, ready_selector: str) -> list[str]:  # noqa: F811
    """Loads `path` with the internet cut off and waits for `ready_selector`; returns the URLs loaded."""
    context = browser.new_context()
    page = context.new_page()
    local = urlparse(server.base_url).netloc
    loaded: list[str] = []
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    def offline(route) -> None:  # as on a machine without internet: only this server answers
        url = urlparse(route.request.url)
        if url.scheme in ("http", "https") and url.netloc != local:
            route.abort()
        else:
            loaded.append(route.request.url)
            route.continue_()

    page.route("**/*", offline)
    page.goto(server.base_url + path)
    page.wait_for_selector(ready_selector, state="attached", timeout=30_000)
    context.close()
    assert not errors, errors
    return loaded


def test_swagger_ui_renders_offline(browser, server) -> None:  # noqa: F811
    loaded = _render(browser, server, "/docs", ".opblock-summary-path[data-path='/v1/chat/completions']")
    assert any(url.endswith("/docs-assets/swagger-ui-bundle.js") for url in loaded)


def test_redoc_renders_offline(browser, server) -> None:  # noqa: F811
    # ReDoc's only outside request is its footer logo, which it hides when the load fails.
    loaded = _render(browser, server, "/redoc", "h1:has-text('pagedserve')")
    assert any(url.endswith("/docs-assets/redoc.standalone.js") for url in loaded)


def test_docs_assets_are_served(server) -> None:
    page = httpx.get(server.base_url + "/docs").text
    assert "/docs-assets/swagger-ui-bundle.js" in page and "cdn" not in page.lower()
    asset = httpx.get(server.base_url + "/docs-assets/swagger-ui-bundle.js")
    assert asset.status_code == 200 and len(asset.content) > 100_000
