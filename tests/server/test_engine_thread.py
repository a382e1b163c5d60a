"""The server's engine is built on the thread that steps it (engine/engine_thread.py): a model
loaded on the main thread and stepped on another left two OpenMP pools in the process, and
every parallel region of every step paid for waking a sleeping worker."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve.config import CacheConfig, EngineConfig, ModelConfig
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineObserver
from pagedserve.engine.llm_engine import EngineStats, LLMEngine
from pagedserve.sampling_params import SamplingParams
from tests.server_fixtures import TEST_MODEL


class _StepThreads(EngineObserver):
    def __init__(self) -> None:
        self.threads: set[int] = set()

    def on_stats(self, stats: EngineStats) -> None:
        self.threads.add(threading.get_ident())


def test_the_engine_is_built_and_stepped_on_one_thread_not_the_main_one(model_path) -> None:
    built_on: list[int] = []

    def factory() -> LLMEngine:
        built_on.append(threading.get_ident())
        config = EngineConfig(model=ModelConfig(model=model_path(TEST_MODEL)),
                              cache=CacheConfig(kv_cache_memory_bytes=8 << 20))
        return LLMEngine(config)

    observer = _StepThreads()
    engine = AsyncLLMEngine.build(factory, observer)

    async def scenario() -> list[int]:
        engine.start()
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        outputs = [output async for output in engine.generate("Hello", params)]
        engine.call_in_engine_thread(lambda e: e.assert_no_leaks())
        await engine.shutdown()
        return list(outputs[-1].outputs[0].token_ids)

    tokens = asyncio.run(scenario())
    assert len(tokens) == 4
    assert built_on and built_on[0] != threading.main_thread().ident
    assert observer.threads == {built_on[0]}


def test_an_engine_that_fails_to_build_raises_in_the_caller() -> None:
    def factory() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncLLMEngine.build(factory)
