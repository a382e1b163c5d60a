"""Headless Chromium for the playground tests: Debian's `chromium` driven by Playwright.

Playwright's own browser download is not reachable here, so the browser is the system's
(`apt-get install -y chromium`, done by .ci/run), passed as `executable_path`. Without it
the browser tests skip locally but fail in CI (CI=true), so a CI run can never pass by
silently not running them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _missing(why: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"browser tests cannot run in CI: {why}", pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    path = chromium_path()
    if path is None:
        _missing("no chromium on PATH (apt-get install -y chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install playwright)")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
