"""LoRA on models with windowed layers (issue 36): Gemma 3 (5 windowed : 1 full, one layer a
page), Gemma 2 (alternating, two layers a page) and Mistral with a window (one windowed
group), whose layer groups share their cache tensors (core/kv_groups.py), so an adapter's
run of blocks packs several layers per tensor (lora/layout.py).

Oracle: PEFT on transformers (fp32, eager attention) with the same adapter, greedy, token for
token; requests on two adapters and on the base model in one batch, prompts longer than the
window (16 tokens, 4-token blocks), so windowed groups give blocks back to the pool that also
holds the adapters' runs. Every engine ends with no KV block held but the adapters'.
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
from windowed_configs import CONFIGS

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager

from lora_utils import hf_greedy_tokens, make_peft_adapter, peft_eager

BLOCK, NEW_TOKENS = 4, 24
# Cache tensors per model: a page is 1 layer (Gemma 3), 2 (Gemma 2), every layer (Mistral).
NUM_CACHES = {"gemma3": 1, "gemma2": 2, "mistral": 2}
ADAPTERS = [("all8", 8, "all-linear"), ("qv4", 4, ["q_proj", "v_proj"])]  # (name, rank, targets)


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
    path = tmp_path_factory.mktemp("lora-windowed") / request.param  # the name is the config's key
    save_random_model(CONFIGS[request.param], path)
    return path


def eager(path: Path, adapter: str | None) -> torch.nn.Module:
    return peft_eager(path, adapter)


def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    return hf_greedy_tokens(model, prompt, NEW_TOKENS)


@pytest.fixture(scope="module")
def case(checkpoint: Path) -> tuple[list[list[int]], list[LoRARequest | None], list[list[int]]]:
    """(prompts, each one's adapter or None, PEFT's / transformers' greedy tokens)."""
    loras = [LoRARequest(tag, i + 1, make_peft_adapter(checkpoint, checkpoint / "adapters", r, targets, seed=i))
             for i, (tag, r, targets) in enumerate(ADAPTERS)]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (40, 23, 57, 31, 48, 19)]
    chosen = [loras[0], None, loras[1], loras[0], loras[1], None]
    references = {None: eager(checkpoint, None)} | {lora.lora_int_id: eager(checkpoint, lora.lora_path)
                                                    for lora in loras}
    expected = [greedy(references[lora and lora.lora_int_id], p) for p, lora in zip(prompts, chosen, strict=True)]
    base = references[None]
    # The adapters really change the answers.
    assert sum(e != greedy(base, p) for p, e, lora in zip(prompts, expected, chosen, strict=True) if lora) >= 3
    return prompts, chosen, expected


def run(llm: LLM, prompts: list[list[int]], chosen: list[LoRARequest | None]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in generate(llm, prompts, chosen)]


def generate(llm: LLM, prompts: list[list[int]], chosen: list[LoRARequest | None]) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=chosen)


def test_mixed_adapters_in_one_batch_equal_peft(checkpoint: Path, case) -> None:
    prompts, chosen, expected = case
    llm = LLM(str(checkpoint), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              block_size=BLOCK, num_gpu_blocks_override=1200, max_num_batched_tokens=64, skip_tokenizer_init=True,
              enable_prefix_caching=True)
    engine = llm.llm_engine
    kv = engine.kv_manager
    assert isinstance(kv, HybridKVCacheManager)
    assert len(engine.runner.kv_caches) == NUM_CACHES[checkpoint.name]
    windowed = [g for g, w in enumerate(kv.windows) if w is not None]
    slid = 0

    def count_slides(_timings) -> None:
        # Blocks a windowed group gave back (null entries) while the adapters' runs are resident.
        nonlocal slid
        for request in engine.scheduler.running:
            slid += sum(len(kv.groups[g].get_block_table(request.request_id))
                        - kv.num_held_blocks(request.request_id, g) for g in windowed)

    engine.add_step_hook(count_slides)
    assert run(llm, prompts, chosen) == expected
    assert slid > 0
    lora_manager = engine.lora_manager
    assert lora_manager is not None and sorted(lora_manager.resident_ids()) == [1, 2]
    engine.assert_no_leaks()
    # Again, from the prefix cache (each adapter's own hash chain): the same tokens.
    outputs = generate(llm, prompts, chosen)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.num_cached_tokens > 0 for o in outputs)
    engine.assert_no_leaks()


# Blocks a tight pool has: the larger adapter's run plus room for about two sequences.
TIGHT_BLOCKS = {"gemma3": 220, "gemma2": 80, "mistral": 50}


def test_one_adapter_slot_and_a_tight_pool_equal_peft(checkpoint: Path, case) -> None:
    """max_loras=1: the adapters take turns in the pool (evicted idle, written again), and
    requests preempt each other; windowed blocks given back and adapter runs reuse each
    other's block ids."""
    prompts, chosen, expected = case
    llm = LLM(str(checkpoint), enable_lora=True, max_loras=1, max_lora_rank=8, max_model_len=128,
              block_size=BLOCK, num_gpu_blocks_override=TIGHT_BLOCKS[checkpoint.name], max_num_batched_tokens=16,
              skip_tokenizer_init=True)
    engine = llm.llm_engine
    assert run(llm, prompts, chosen) == expected
    lora_manager = engine.lora_manager
    assert lora_manager is not None and lora_manager.num_device_loads >= 2
    assert engine.scheduler.num_preemptions_total > 0
    engine.assert_no_leaks()


def test_layout_packs_the_layers_that_share_a_cache_tensor(checkpoint: Path) -> None:
    """Every (layer, module) reads back its own delta from tensor `cache_index(layer, T)`; the
    matrices of the layers sharing a tensor do not overlap, and nothing outside the run is
    written."""
    from pagedserve.lora import kernels
    from pagedserve.lora.layout import cache_index, plan_layout, write_adapter
    from pagedserve.lora.peft_loader import TARGETABLE, load_peft_adapter, module_dims_for

    config = CONFIGS[checkpoint.name]
    num_layers, num_caches = config.num_hidden_layers, NUM_CACHES[checkpoint.name]
    path = make_peft_adapter(checkpoint, checkpoint / "adapters", 8, "all-linear", seed=0)
    dims = module_dims_for(config)
    adapter = load_peft_adapter(LoRARequest("all8", 1, path), dims, num_layers, 8)
    caches = [torch.zeros(2, 400, BLOCK, 2, 32) for _ in range(num_caches)]
    e = kernels.block_elems(caches[0], torch.float32)
    layout = plan_layout(adapter, num_layers, e, num_caches)
    first = 3
    write_adapter(adapter, layout, caches, first, torch.float32)
    for kv in caches:
        assert not kv[:, :first].any() and not kv[:, first + layout.num_blocks:].any()
    spans: dict[int, list[tuple[int, int]]] = {c: [] for c in range(num_caches)}
    for (layer, name), w in adapter.weights.items():
        m = TARGETABLE.index(name)
        (rank, in_dim), out_dim = w.lora_a.shape, w.lora_b.shape[0]
        spans[cache_index(layer, num_caches)].append((int(layout.a_offsets[layer, m]), rank * in_dim))
        sa, sb = kernels.flat_storage(caches[cache_index(layer, num_caches)], torch.float32)
        x = torch.randn(3, in_dim)
        y = torch.zeros(3, out_dim)
        base = first * e
        kernels.lora_apply(y, x, sa, sb, torch.tensor([0, 3]), layout.a_offsets[layer, m:m + 1] + base,
                           layout.b_offsets[layer, m:m + 1] + base, layout.ranks[layer, m:m + 1],
                           layout.scales[layer, m:m + 1])
        torch.testing.assert_close(y, x @ (w.scale * w.lora_b @ w.lora_a).T, rtol=1e-5, atol=1e-5)
    for tensor_spans in spans.values():
        tensor_spans.sort()
        assert all(s0 + n0 <= s1 for (s0, n0), (s1, _) in zip(tensor_spans, tensor_spans[1:], strict=False))
    with pytest.raises(ValueError, match="cannot share"):
        plan_layout(adapter, num_layers, e, num_layers + 1)
