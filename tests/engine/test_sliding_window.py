"""Sliding-window layers in the paged cache (issue 36.4): windowed layer groups give their
out-of-window blocks back to the pool (core/hybrid_kv_manager.py), and generation stays
token for token transformers' (fp32, eager attention) on tiny random models whose prompts
plus outputs run far past the window (window 16, block_size 4, up to 134 tokens), under
preemption (a pool too small for every request at once) and with prefix-cache hits.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    PretrainedConfig,
)
from windowed_configs import CONFIGS, WINDOW

from pagedserve import LLM, SamplingParams
from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager, window_blocks_bound

BLOCK = 4
# Pages per model: room for one or two of the four sequences at their longest (a page is
# one layer for Gemma 3, two for Gemma 2, both layers for Mistral, whose sequences hold
# only their window).
NUM_BLOCKS = {"gemma3": 110, "gemma2": 70, "mistral": 20}
NEW_TOKENS = 64
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


def save_random_model(config: PretrainedConfig, path: Path) -> None:
    """Random weights large enough that attention patterns matter (no near-tied logits)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.2 * torch.randn_like(p) + (0 if "gemma" in config.model_type else 1))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.save_pretrained(path)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param, numbered=False)
    save_random_model(CONFIGS[request.param], path)
    return path


def prompts(vocab: int) -> list[list[int]]:
    """Four prompts; the last two share a 32-token prefix (whole blocks, twice the window)."""
    g = torch.Generator().manual_seed(1)
    a, b, c, d = (torch.randint(3, vocab, (n,), generator=g).tolist() for n in (70, 40, 50, 20))
    return [a, b, c, c[:32] + d]


@torch.inference_mode()
def hf_greedy(path: Path, prompt_ids: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    outs = []
    for p in prompt_ids:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def test_greedy_matches_hf_under_preemption_and_prefix_hits(checkpoint: Path) -> None:
    config = PretrainedConfig.from_pretrained(checkpoint)
    ids = prompts(config.vocab_size)
    expected = hf_greedy(checkpoint, ids)
    # Too few blocks for the four sequences at once: requests preempt each other.
    num_blocks = NUM_BLOCKS[checkpoint.name]
    llm = LLM(str(checkpoint), max_model_len=160, block_size=BLOCK, max_num_batched_tokens=16,
              num_gpu_blocks_override=num_blocks, enable_prefix_caching=True, skip_tokenizer_init=True)
    engine = llm.llm_engine
    kv = engine.kv_manager
    assert isinstance(kv, HybridKVCacheManager)
    # The null block stands in for given-back blocks: NaN there would reach the outputs
    # (0 * NaN) if windowed attention read a position outside its window.
    for cache in engine.runner.kv_caches:
        cache[:, kv.null_block] = float("nan")
    windowed = [g for g, w in enumerate(kv.windows) if w is not None]
    bound = window_blocks_bound(WINDOW, BLOCK)
    checked = 0

    def check_window(_timings) -> None:
        nonlocal checked
        kv.check_integrity()
        for request in engine.scheduler.running:
            # A plain decode (no recompute after preemption): its window alone is held.
            if request.num_output_tokens >= 2 and request.num_preemptions == 0:
                for g in windowed:
                    assert kv.num_held_blocks(request.request_id, g) <= bound
                checked += 1

    engine.add_step_hook(check_window)
    outputs = llm.generate([{"prompt_token_ids": p} for p in ids], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert engine.scheduler.num_preemptions_total > 0
    assert checked > 0
    engine.assert_no_leaks()
    # The third prompt alone (its blocks stay cached, the windowed ones given back during its
    # prefill too), then the fourth: it hits the shared 32 tokens, its windowed groups' last
    # window of them included, and still matches.
    engine.remove_step_hook(check_window)
    (out,) = llm.generate([{"prompt_token_ids": ids[2]}], SamplingParams(temperature=0.0, max_tokens=1),
                          use_tqdm=False)
    assert out.outputs[0].token_ids == expected[2][:1]
    (out,) = llm.generate([{"prompt_token_ids": ids[3]}], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == expected[3]
    assert out.num_cached_tokens >= 32  # more when its own first run is still cached
    engine.assert_no_leaks()


def test_windowed_group_keeps_only_the_window() -> None:
    """A 200-token sequence decoding one token a step: every windowed group holds at most
    ceil(W / block_size) + 1 blocks, the full group all of them; all come back at the end."""
    kv = HybridKVCacheManager(200, BLOCK, [WINDOW, None, WINDOW], enable_caching=False)
    bound = window_blocks_bound(WINDOW, BLOCK)
    assert kv.allocate_slots("a", 0, 10)
    for n in range(10, 200):
        assert kv.allocate_slots("a", n, 1)
        kv.check_integrity()
        assert kv.num_held_blocks("a", 0) <= bound and kv.num_held_blocks("a", 2) <= bound
        assert kv.num_held_blocks("a", 1) == -(-(n + 1) // BLOCK)
    # Forks share (the null entries too); rollback and free leave nothing behind.
    kv.fork("a", "b")
    assert kv.allocate_slots("b", 200, 3)
    kv.rollback("b", 201)
    kv.check_integrity()
    kv.free("a")
    kv.free("b")
    kv.assert_all_free()
    assert kv.num_used_blocks == 0 and kv.usage == 0.0
