"""Takes docs/playground.png: the playground in headless Chromium after two replies.

    python scripts/playground_screenshot.py [--out docs/playground.png]

Starts `pagedserve serve` with the demo adapters on a free port in this process, asks the
`shout` adapter a question, then (new chat) the base model another with n=2 side by side, then
saves the page. Needs Debian's chromium (apt-get install -y chromium) and playwright.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from pagedserve.demo_adapters import SMOLLM2_NAME, serve_args  # noqa: E402

from server_fixtures import running_server  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/playground.png")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install -y chromium)")
    argv = [*serve_args(), "--kv-cache-memory", "48MiB", "--max-model-len", "1024", "--log-level", "warning"]
    with running_server(argv) as server, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1360, "height": 760})
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "40")
        for model, n, question in (("shout", 1, "Tell me one fact about dogs."),
                                   (SMOLLM2_NAME, 2, "Describe tea in one sentence.")):
            if n > 1:
                page.click("#new-chat")  # the base model's answer, not copying the shouted one above
            page.select_option("#model", model)
            page.fill("#n", str(n))
            page.fill("#temperature", "0" if n == 1 else "0.8")
            page.fill("#input", question)
            page.click("#send")
            page.wait_for_function("!document.body.classList.contains('streaming')", timeout=120_000)
        page.wait_for_timeout(1500)  # one more engine-panel refresh
        page.screenshot(path=args.out)
        browser.close()
    print(args.out, Path(args.out).stat().st_size, "bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
