"""The input processor (issue #15.2): one place that tokenizes, renders chat templates, checks
lengths and validates, called by the offline `LLM` and by the server (in its tokenize worker,
never on the engine thread)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.input_processor import EngineInput, InputError, InputProcessor
from pagedserve.engine.tokenizer import load_tokenizer

from server_fixtures import SERVE_ARGS, TEST_MODEL, LiveServer, running_server


class _RecordingTokenizer:
    """A real tokenizer that notes which thread encodes or renders (a tokenizer, not the
    processor under test, is what it stands in for)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return self._inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        return self._inner.apply_chat_template(*args, **kwargs)


@pytest.fixture(scope="module")
def tokenizer(model_path) -> Any:
    return load_tokenizer(model_path(TEST_MODEL))


def test_process_prepares_everything_the_engine_needs(tokenizer) -> None:
    processor = InputProcessor(tokenizer, vocab_size=1024, max_model_len=64, eos_token_ids=[2, 7, 9])
    item = processor.process("Hello world", SamplingParams(max_tokens=1000, stop_token_ids=[7]))
    assert isinstance(item, EngineInput)
    assert item.prompt == "Hello world" and item.prompt_token_ids == tokenizer.encode("Hello world")
    assert item.params.stop_token_ids == [7, 9]  # the model's other EOS ids end it too
    assert item.max_output_tokens == 64 - len(item.prompt_token_ids)  # offline: capped, not refused
    with pytest.raises(InputError) as bad:
        processor.process({"prompt_token_ids": [1, 5000]})
    assert bad.value.param == "prompt" and "[0, 1024)" in str(bad.value)
    with pytest.raises(InputError) as long:
        processor.check_context_length(60, 10, "messages")
    assert long.value.param == "max_tokens" and long.value.code == "context_length_exceeded"
    with pytest.raises(InputError, match="priority"):
        processor.process("hi", priority=1)


def test_text_too_long_is_refused_before_tokenizing(tokenizer) -> None:
    recording = _RecordingTokenizer(tokenizer)
    processor = InputProcessor(recording, vocab_size=1024, max_model_len=64, eos_token_ids=[2])
    huge = "a" * (processor.char_limit + 1)
    with pytest.raises(InputError, match=f"has {len(huge)} characters") as prompt:
        processor.process(huge)
    with pytest.raises(InputError) as chat:
        processor.render_chat([{"role": "user", "content": huge}])
    assert (prompt.value.param, chat.value.param) == ("prompt", "messages")
    assert recording.threads == []


def test_offline_llm_uses_the_same_checks(model_path) -> None:
    llm = LLM(model_path(TEST_MODEL), max_model_len=64, kv_cache_memory_bytes=4 << 20)
    with pytest.raises(InputError, match="maximum context length is 64 tokens") as err:
        llm.generate({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    assert err.value.param == "prompt"
    with pytest.raises(InputError, match="has .* characters"):
        llm.chat([{"role": "user", "content": "a" * 10**6}], use_tqdm=False)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with running_server([TEST_MODEL, *SERVE_ARGS]) as live:
        yield live


def test_server_processes_inputs_in_the_tokenize_worker(server: LiveServer, tokenizer) -> None:
    engine = server.ctx.engine
    recording = _RecordingTokenizer(tokenizer)
    engine.call_in_engine_thread(lambda e: e.set_tokenizer(recording))
    try:
        ok = httpx.post(server.v1 + "/completions", json={"model": TEST_MODEL, "prompt": "Hello there", "max_tokens": 3})
        chat = httpx.post(server.v1 + "/chat/completions", json={
            "model": TEST_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        assert ok.status_code == chat.status_code == 200, (ok.text, chat.text)
    finally:
        engine.call_in_engine_thread(lambda e: e.set_tokenizer(tokenizer))
    assert recording.threads and all(t.startswith("pagedserve-tokenize") for t in recording.threads), recording.threads
