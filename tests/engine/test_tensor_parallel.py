"""Tensor parallelism on gloo: 2 ranks against 1 rank on the same weights (fp32).

Greedy token for token and logprobs within 1e-4 (sampled tokens and prompt logprobs too)
for each architecture family, with int8 weights, with LoRA adapters (a mixed batch, against
1 rank and PEFT); a killed worker fails the running request and the engine's health at once
(an idle engine's health too); bad `tensor_parallel_size` values are refused naming the field.
Each 2-rank engine is built once per module (a worker process costs a few seconds) and its
workers must exit when it shuts down.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.distributed.parallel_state import TensorParallelError
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine_args import EngineArgs

from hf_reference import make_prompts
from lora_utils import make_peft_adapter, peft_greedy

ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, max_num_batched_tokens=48)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=2)
TOLERANCE = 1e-4


def _prompts(llm: LLM) -> list[dict]:
    vocab = llm.llm_engine.vocab_size
    # A 60-token prompt under a 48-token budget: chunked prefill over the ranks too.
    return [{"prompt_token_ids": p} for p in make_prompts(vocab, lengths=[5, 23, 60], seed=7)]


def _run(llm: LLM) -> list:
    prompts = _prompts(llm)
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)]
    sampled = SamplingParams(temperature=0.9, top_k=20, max_tokens=12, seed=11, logprobs=0)
    return llm.generate([*prompts, prompts[1]], [*params, sampled], use_tqdm=False)


def _assert_same(one_rank: list, two_ranks: list) -> None:
    for i, (a, b) in enumerate(zip(one_rank, two_ranks, strict=True)):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids, f"request {i}: 1 rank and 2 ranks differ"
        for entry_a, entry_b in zip(ca.logprobs or [], cb.logprobs or [], strict=True):
            assert entry_a.keys() == entry_b.keys()
            for token, lp in entry_a.items():
                assert abs(lp.logprob - entry_b[token].logprob) < TOLERANCE
        for entry_a, entry_b in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            if entry_a is None:
                assert entry_b is None
                continue
            assert entry_a.keys() == entry_b.keys()
            assert max(abs(lp.logprob - entry_b[t].logprob) for t, lp in entry_a.items()) < TOLERANCE


def _shutdown(llm: LLM) -> None:
    engine = llm.llm_engine
    processes = list(engine.tp_workers.processes)
    engine.shutdown()
    # No orphans: every worker has exited once shutdown returns.
    assert all(p.poll() is not None for p in processes), "a tensor-parallel worker outlived shutdown"


@pytest.fixture(scope="module", params=["llama-gqa", "qwen2", "opt", "gpt2"])
def engines(request, model_path):
    path = model_path(request.param)
    single = LLM(path, **ENGINE)
    parallel = LLM(path, tensor_parallel_size=2, **ENGINE)
    yield single, parallel
    _shutdown(parallel)


def test_two_ranks_match_one_rank(engines):
    single, parallel = engines
    assert parallel.llm_engine.tp_workers is not None and single.llm_engine.tp_workers is None
    # Each rank holds half the heads' KV: half the bytes per block, the same block ids.
    spec_1, spec_2 = single.llm_engine.runner.kv_cache_spec(), parallel.llm_engine.runner.kv_cache_spec()
    assert spec_2.num_kv_heads * 2 == spec_1.num_kv_heads
    _assert_same(_run(single), _run(parallel))
    # The workers hold nothing between steps (also checked by the autouse leak check).
    states = parallel.llm_engine.tp_workers.query_state()
    assert states == [{"holds_step": False, "generators": 0, "num_blocks": parallel.llm_engine.num_blocks,
                       "num_kv_heads": spec_2.num_kv_heads}]


def test_two_ranks_with_int8_weights(model_path):
    path = model_path("llama-gqa")
    single = LLM(path, quantization="int8", **ENGINE)
    parallel = LLM(path, quantization="int8", tensor_parallel_size=2, **ENGINE)
    try:
        # Group-wise int8 (32 columns) quantizes each rank's shard to exactly the 1-rank values.
        _assert_same(_run(single), _run(parallel))
        # A worker that dies while the engine is idle: /health knows before any request comes.
        engine = parallel.llm_engine
        assert engine.health_problem() is None
        worker = engine.tp_workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        assert "tensor-parallel rank 1" in engine.health_problem()
        with pytest.raises(TensorParallelError, match="rank 1 .* died"):
            parallel.generate(_prompts(parallel)[:1], GREEDY, use_tqdm=False)
        engine.abort_request(list(engine.scheduler.requests))
    finally:
        _shutdown(parallel)


def test_two_ranks_with_lora(model_path, tmp_path):
    """S-LoRA's split: A whole / B by rows on q,k,v,gate,up; A by columns / B whole on o, down."""
    from pagedserve.lora.request import LoRARequest

    path = model_path("llama-gqa")
    adapters = [
        LoRARequest("all8", 1, make_peft_adapter(path, tmp_path / "all8", 8, "all-linear", seed=3)),
        LoRARequest("attn4", 2, make_peft_adapter(path, tmp_path / "attn4", 4, ["q_proj", "v_proj", "o_proj"],
                                                  seed=4, use_rslora=True)),
    ]
    lora_engine = dict(ENGINE, enable_lora=True, max_lora_rank=8)
    single = LLM(path, **lora_engine)
    parallel = LLM(path, tensor_parallel_size=2, **lora_engine)
    try:
        prompts = _prompts(single)
        which = [adapters[0], None, adapters[1]]  # adapters and the base model in one batch
        outs = [llm.generate(prompts, GREEDY, lora_request=which, use_tqdm=False) for llm in (single, parallel)]
        _assert_same(*outs)
        # And against PEFT itself (the 1-rank engine's own oracle).
        assert outs[1][0].outputs[0].token_ids == peft_greedy(path, adapters[0].lora_path, prompts[0]["prompt_token_ids"], 16)
    finally:
        _shutdown(parallel)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size=3 does not divide num_attention_heads=4"),
    ],
)
def test_bad_tensor_parallel_size_is_refused(model_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model_path("llama-gqa"), **{**ENGINE, **kwargs})


def test_int8_groups_straddling_two_ranks_are_refused(model_path):
    # o_proj's 64 input columns split into 32 per rank: a 64-column group would straddle them.
    with pytest.raises(ValueError, match="quantization_group_size=64 does not divide .*o_proj"):
        LLM(model_path("llama-gqa"), quantization="int8", quantization_group_size=64,
            tensor_parallel_size=2, **ENGINE)


def test_cli_flag():
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    args = EngineArgs.from_cli_args(parser.parse_args(["m", "-tp", "2"]))
    assert args.tensor_parallel_size == 2
    assert args.create_engine_config().parallel.tensor_parallel_size == 2


def test_killed_worker_fails_the_request_and_health(model_path):
    engine = LLMEngine(EngineArgs(model=model_path("llama-gqa"), tensor_parallel_size=2, **ENGINE)
                       .create_engine_config())
    processes = list(engine.tp_workers.processes)

    async def scenario() -> tuple[float, str | None]:
        async_engine = AsyncLLMEngine(engine)
        async_engine.start()
        assert async_engine.health() is None
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = async_engine.generate({"prompt_token_ids": [5, 6, 7]}, params)
        await stream.__anext__()  # running
        os.kill(processes[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(EngineDeadError, match="tensor-parallel"):
            async for _ in stream:
                pass
        failed_after = time.monotonic() - killed
        health = async_engine.health()
        await async_engine.shutdown()
        return failed_after, health

    failed_after, health = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert failed_after < 10, f"the request failed only {failed_after:.1f} s after the worker died"
    assert health is not None and "tensor-parallel" in health  # /health answers 503 with it
    assert all(p.poll() is not None for p in processes)  # the loop's death stopped the workers
    engine.abort_request(list(engine.scheduler.requests))  # the leak check: nothing left held
