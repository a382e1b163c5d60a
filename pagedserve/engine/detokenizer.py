"""Incremental detokenization: text grows token by token, never emitting half a character."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to the stream first, so the first output token is decoded in context
# (e.g. SentencePiece's leading-space handling), then discarded.
_PRIME_TOKENS = 6


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas.

    Fast (Rust) tokenizers use `tokenizers.decoders.DecodeStream`; others fall back to
    re-decoding the output and diffing, which is quadratic but correct.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        backend = getattr(tokenizer, "_tokenizer", None)
        self._rust: Tokenizer | None = backend if isinstance(backend, Tokenizer) else None
        self._token_ids: list[int] = []
        self._text_len = 0
        if self._rust is not None:
            self._stream = self._primed_stream(prompt_token_ids[-_PRIME_TOKENS:])

    def _primed_stream(self, prime_ids: list[int]) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self._skip_special)
        chunk = None
        assert self._rust is not None  # a detokenizer exists only with a tokenizer
        for token_id in prime_ids:
            chunk = stream.step(self._rust, token_id)
        if prime_ids and chunk is None:
            # The prompt ends inside a multi-byte character: priming would leak the
            # prompt's dangling bytes into the output text, so start clean instead.
            stream = DecodeStream(skip_special_tokens=self._skip_special)
        return stream

    def add(self, token_id: int) -> str:
        """Feeds one token; returns the text it completes (possibly empty)."""
        if self._rust is not None:
            return self._stream.step(self._rust, token_id) or ""
        self._token_ids.append(token_id)
        text = self._tokenizer.decode(self._token_ids, skip_special_tokens=self._skip_special)
        if text.endswith("\ufffd"):
            return ""  # a multi-byte character is not complete yet
        delta, self._text_len = text[self._text_len :], len(text)
        return delta


class TokenTextCache:
    """Decoded text of single tokens, for logprob entries (the same ids recur constantly)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text
