"""compilation_config level 3 (torch.compile over the decode forward) against eager and HF.

One compiled engine per module (compiling costs ~5 s per size on 2 cores after inductor's
start-up): sizes 1 and 4, so batch 1 runs its own graph and batch 3 is padded to 4.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.compilation.config import CompilationConfig
from pagedserve.engine_args import EngineArgs

from hf_reference import hf_greedy, make_prompts

MODEL = "llama-gqa"
NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW, logprobs=2)
COMPILED = {"level": 3, "compile_sizes": [1, 4]}


def _llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 16 << 20)
    kwargs.setdefault("max_model_len", 256)
    return LLM(path, dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def engines(model_path):
    path = model_path(MODEL)
    compiled = _llm(path, compilation_config=COMPILED)
    assert compiled.llm_engine.runner.compiled is not None, "the decode graph did not compile"
    return path, compiled, _llm(path)


def _run(llm: LLM, prompts: list[list[int]]) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def _assert_same(compiled_out: list, eager_out: list) -> None:
    for i, (c, e) in enumerate(zip(compiled_out, eager_out, strict=True)):
        c, e = c.outputs[0], e.outputs[0]
        assert c.token_ids == e.token_ids, f"prompt {i}: compiled and eager tokens differ"
        diffs = [abs(lc[t].logprob - le[t].logprob) for lc, le in zip(c.logprobs, e.logprobs, strict=True) for t in lc]
        assert max(diffs) < 1e-4, f"prompt {i}: logprobs differ by {max(diffs)}"


@pytest.mark.parametrize("batch", [1, 3])
def test_compiled_decode_matches_eager_and_transformers(engines, batch):
    path, compiled, eager = engines
    prompts = make_prompts(compiled.llm_engine.vocab_size, lengths=[5, 17, 33][:batch], seed=batch)
    calls = dict(compiled.llm_engine.runner.compiled.calls)
    out = _run(compiled, prompts)
    _assert_same(out, _run(eager, prompts))
    for o, p in zip(out, prompts, strict=True):
        assert o.outputs[0].token_ids == hf_greedy(path, p, new_tokens=NEW, min_new_tokens=NEW)
    size = 1 if batch == 1 else 4  # batch 3 is padded to the size-4 graph
    assert compiled.llm_engine.runner.compiled.calls[size] >= NEW - 1 + calls[size]
    assert compiled.llm_engine.runner.compiled.guard_misses == 0


def test_a_guard_miss_runs_the_step_eagerly(engines):
    """Inputs no graph was compiled for (int32 ids) are refused before any KV write; the
    runner then runs the step eagerly."""
    _, compiled, _ = engines
    graphs = compiled.llm_engine.runner.compiled
    ids = torch.tensor([5], dtype=torch.int32)
    misses = graphs.guard_misses
    with torch.inference_mode():
        assert graphs(ids, ids.clone(), None, compiled.llm_engine.runner.kv_caches) is None
    assert graphs.guard_misses == misses + 1


def test_compiled_decode_with_prefix_hits_and_preemption(engines):
    path, compiled, eager = engines
    vocab = compiled.llm_engine.vocab_size
    shared = make_prompts(vocab, lengths=[40], seed=7)[0]
    # Three prompts sharing 40 tokens (two full blocks of 16 hit the prefix cache), then a
    # pool too small for all three: the latest is preempted and recomputed.
    prompts = [shared + tail for tail in make_prompts(vocab, lengths=[3, 9, 14], seed=8)]
    small = _llm(path, compilation_config=COMPILED, num_gpu_blocks_override=9, max_model_len=80)
    out = _run(small, prompts)
    stats = small.llm_engine.get_stats()
    assert stats.scheduler.num_preemptions_total > 0
    assert small.llm_engine.runner.compiled.calls[4] > 0
    assert small.llm_engine.runner.compiled.guard_misses == 0
    _assert_same(out, _run(eager, prompts))
    assert stats.scheduler.prefix_cache_hits > 0


def test_compilation_config_forms_and_errors():
    assert CompilationConfig.from_value(None).enabled is False
    assert CompilationConfig.from_value(3).enabled
    assert CompilationConfig.from_value("-O3").enabled
    assert CompilationConfig.from_value('{"level": 3, "compile_sizes": [8, 1]}').compile_sizes == (8, 1)
    options = CompilationConfig.from_value({"level": 3, "inductor_compile_config": {"cpp_wrapper": True}})
    assert dict(options.inductor_compile_config) == {"cpp_wrapper": True}
    for bad, field in ((2, "level"), ({"level": 3, "cudagraph_mode": 1}, "cudagraph_mode"),
                       ({"compile_sizes": [0]}, "compile_sizes"), ("{", "JSON"),
                       ({"inductor_compile_config": [1]}, "inductor_compile_config")):
        with pytest.raises(ValueError, match=field):
            CompilationConfig.from_value(bad)
    config = EngineArgs(model="m", compilation_config=3, enforce_eager=True).create_engine_config()
    assert not config.compilation.enabled  # enforce_eager wins, as in vLLM
    with pytest.raises(ValueError, match="enable_lora"):
        EngineArgs(model="m", compilation_config=3, enable_lora=True).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineArgs(model="m", compilation_config=3, tensor_parallel_size=2).create_engine_config()


def test_compilation_config_flags():
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["m", "-O3"]))
    assert args.create_engine_config().compilation.enabled
    args = EngineArgs.from_cli_args(parser.parse_args(["m", "--compilation-config", '{"level": 3, "compile_sizes": [2]}']))
    assert args.create_engine_config().compilation.compile_sizes == (2,)
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "-O", '{"level": 3, "nope": 1}'])


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_compiled_decode_quantized_matches_eager(model_path, quantization):
    """The group-wise GEMV ops trace as opaque calls too (their fakes): same greedy tokens."""
    path = model_path(MODEL)
    compiled = _llm(path, quantization=quantization, compilation_config={"level": 3, "compile_sizes": [4]})
    prompts = make_prompts(compiled.llm_engine.vocab_size, lengths=[4, 9, 20], seed=3)
    _assert_same(_run(compiled, prompts), _run(_llm(path, quantization=quantization), prompts))
    assert compiled.llm_engine.runner.compiled.calls[4] >= NEW - 1
