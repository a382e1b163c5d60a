"""Tokenizer loading (Hugging Face tokenizers, with their chat templates)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a folder, or the one in a .gguf file's metadata (with its chat template)."""
    from transformers import AutoTokenizer

    from pagedserve.models.gguf import load_gguf_tokenizer
    from pagedserve.models.hub import is_gguf

    try:
        if is_gguf(path):
            return load_gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path that failed
        raise ValueError(f"could not load a tokenizer from {path!r}: {exc}") from exc
