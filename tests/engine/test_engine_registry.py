"""The live-engine registry the leak check reads (no patching of LLMEngine)."""

from __future__ import annotations

import gc

from pagedserve import LLM
from pagedserve.engine import registry


def test_engines_register_and_go_away(model_path) -> None:
    llm = LLM(model_path("llama-gqa"), max_model_len=64, kv_cache_memory_bytes=2 << 20)
    engine = llm.llm_engine
    assert engine in registry.live_engines() and registry.driver_of(engine) is None
    seq = engine.created_seq
    del llm, engine
    gc.collect()
    assert all(e.created_seq != seq for e in registry.live_engines())
