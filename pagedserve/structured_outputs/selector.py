"""Which grammar backend a name means (the factory lives here, not beside the interface in
backend.py, so that the interface and its implementations import in one direction only).
xgrammar, the non-default backend, is imported only when asked for: it is a heavy import."""

from __future__ import annotations

from typing import Any

from pagedserve.structured_outputs.backend import GrammarBackend
from pagedserve.structured_outputs.llguidance_backend import LLGuidanceBackend


def load_backend(name: str, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> GrammarBackend:
    """The backend called `name` ("llguidance" or "xgrammar") for this tokenizer."""
    if name == "llguidance":
        return LLGuidanceBackend(tokenizer, vocab_size, eos_token_id)
    if name == "xgrammar":
        from pagedserve.structured_outputs.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, vocab_size, eos_token_id)
    raise ValueError(f"structured outputs backend must be 'llguidance' or 'xgrammar', got {name!r}")
