"""The Makefile's serve recipes, read by the tests that run what they run (so those follow it)."""

from __future__ import annotations

import re
from pathlib import Path

MAKEFILE = Path(__file__).resolve().parents[1] / "Makefile"


def recipe(target: str) -> list[str]:
    """The words of `target`'s one-command recipe, continuation lines joined."""
    text = MAKEFILE.read_text().replace("\\\n", " ")
    found = re.search(rf"^{re.escape(target)}:.*\n\t(.*)$", text, re.M)
    assert found, f"the Makefile has no {target} recipe"
    return found.group(1).split()


def serve_model() -> str:
    """The catalog name `make serve` serves (SERVE_MODEL)."""
    found = re.search(r"^SERVE_MODEL \?= (\S+)$", MAKEFILE.read_text(), re.M)
    assert found, "the Makefile sets no SERVE_MODEL"
    return found.group(1)


def make_serve_flags() -> list[str]:
    """The flags `make serve` gives after the model."""
    command = recipe("serve")
    assert command[:3] == [".venv/bin/pagedserve", "serve", "$(SERVE_MODEL)"], command
    return command[3:]
