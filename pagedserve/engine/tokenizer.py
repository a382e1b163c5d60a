"""Tokenizer loading (Hugging Face tokenizers, with their chat templates)."""

from __future__ import annotations

from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - re-raised with the path that failed
        raise ValueError(f"could not load a tokenizer from {path!r}: {exc}") from exc
