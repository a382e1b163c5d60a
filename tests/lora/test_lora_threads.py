"""Adapter loads run no torch operator off the engine thread.

An operator large enough to go parallel starts an OpenMP worker pool for the thread that runs
it; with a second pool in the process, every parallel region of the engine thread cost ~50 us
more (engine/engine_thread.py). The LoRA manager's loader thread used to convert and check the
adapter's tensors (fp32 copies, finite checks) and so gave every server that loaded an adapter
a second pool. A new pool shows as new OS threads that Python did not start."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams

from lora_utils import make_peft_adapter, peft_greedy

pytestmark = pytest.mark.skipif(
    torch.get_num_threads() < 2 or not os.path.isdir("/proc/self/task"),
    reason="needs a parallel torch (2+ threads) and Linux's /proc to count threads",
)


def _native_threads() -> int:
    """This process's OS threads that Python did not start (OpenMP's workers among them)."""
    return len(os.listdir("/proc/self/task")) - threading.active_count()


def test_a_background_adapter_load_starts_no_second_openmp_pool(model_path, tmp_path) -> None:
    base = model_path("demo")
    # Rank 64 on the MLP: lora_B of up_proj is 688 x 64 floats, above torch's parallel grain
    # (32k elements), so converting it on the loader thread would start a pool there.
    adapter = make_peft_adapter(base, tmp_path, 64, ["gate_proj", "up_proj", "down_proj"], seed=3)
    llm = LLM(base, max_model_len=128, kv_cache_memory_bytes=16 << 20, enable_lora=True, max_lora_rank=64)
    engine = llm.llm_engine
    prompt = [5, 17, 42, 99, 7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # the engine thread's pool
    torch.ones(1 << 16).add(1)
    before = _native_threads()

    engine.add_request("with-adapter", {"prompt_token_ids": prompt}, params, lora_request=LoRARequest("mlp64", 1, adapter))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens = list(output.outputs[0].token_ids)

    assert engine.lora_manager.num_disk_loads == 1  # through the background loader
    assert tokens == peft_greedy(base, adapter, prompt, 6)
    assert _native_threads() == before
