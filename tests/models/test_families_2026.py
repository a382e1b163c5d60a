"""The 2026 families (issue 36) vs Hugging Face transformers (fp32, eager attention).

Each tiny random config (2-4 layers, hidden 64) is saved with transformers' own class, then
(a) every fed position's logits through our loader and paged cache match transformers'
    full forward: one flat prefill batch, and incrementally (a prefix, then decodes and
    3-token chunks, so windows slide across cached blocks);
(b) through the engine: greedy token for token vs transformers' `generate`, with prompts
    sharing a prefix (prefix-cache hits on the second pass) and chunked prefill under a
    16-token budget.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from test_models import TINY, PagedRunner, prompts_for, save_random_model
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen3Config,
    SmolLM3Config,
)

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import load_model
from pagedserve.models.registry import supported_architectures

# Special ids inside the tiny vocabulary (some configs default to their real model's).
SMALL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS: dict[str, PretrainedConfig] = {
    "qwen3": Qwen3Config(**TINY | {"head_dim": 32}),
    "qwen3_window": Qwen3Config(
        **TINY | {"num_hidden_layers": 3}, use_sliding_window=True, sliding_window=8,
        max_window_layers=1,
    ),
    "phi3_partial_rotary": Phi3Config(
        **TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        **SMALL_IDS,
    ),
    "phi3_window": Phi3Config(**TINY, sliding_window=8, **SMALL_IDS),
    "granite": GraniteConfig(
        **TINY, embedding_multiplier=3.0, attention_multiplier=0.1, residual_multiplier=0.5,
        logits_scaling=2.5,
    ),
    "smollm3": SmolLM3Config(
        **TINY | {"num_hidden_layers": 4}, no_rope_layer_interval=2, **SMALL_IDS),
    "smollm3_window": SmolLM3Config(
        **TINY | {"num_hidden_layers": 4}, no_rope_layer_interval=2, use_sliding_window=True,
        sliding_window=8, **SMALL_IDS,
    ),
    # Softcaps small enough to bite on random weights; layers alternate window 8 / full.
    "gemma2": Gemma2Config(
        **TINY | {"num_hidden_layers": 3, "head_dim": 32}, query_pre_attn_scalar=24,
        sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **SMALL_IDS,
    ),
    "gemma3": Gemma3TextConfig(
        **TINY | {"num_hidden_layers": 4, "head_dim": 32}, query_pre_attn_scalar=24,
        sliding_window=8, **SMALL_IDS,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        },
    ),
}
NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)


@functools.cache
def _checkpoint(name: str, root: Path) -> Path:
    path = root / name
    save_random_model(CONFIGS[name], path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("families")


@pytest.fixture(params=list(CONFIGS))
def checkpoint(request, root: Path) -> Path:
    return _checkpoint(request.param, root)


@torch.inference_mode()
def hf_eager_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return [model(torch.tensor([p])).logits[0] for p in prompts]


@torch.inference_mode()
def hf_eager_greedy(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def test_registered() -> None:
    archs = {type(c).__name__.replace("TextConfig", "Config").replace("Config", "ForCausalLM")
             for c in CONFIGS.values()}
    assert archs <= set(supported_architectures())


def test_prefill_and_incremental_match_hf(checkpoint: Path) -> None:
    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"))
    prompts = prompts_for(config.vocab_size, [23, 1, 40])
    want = hf_eager_logits(checkpoint, prompts)
    for got, exp in zip(PagedRunner(model, 3).step(list(enumerate(prompts))), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    assert_incremental_matches(model, [prompts[0], prompts[2]], [want[0], want[2]])


def assert_incremental_matches(model: torch.nn.Module, prompts: list[list[int]], want: list[torch.Tensor]) -> None:
    """Request 0 decodes one token a step while request 1 feeds 3-token chunks, after prefixes
    of 5 and 11 tokens; the logits of every position equal `want` (transformers' whole-prompt run)."""
    runner = PagedRunner(model, 2)
    fed, got = [5, 11], [[], []]
    for r, out in enumerate(runner.step([(0, prompts[0][:5]), (1, prompts[1][:11])])):
        got[r].append(out)
    while fed[0] < len(prompts[0]) or fed[1] < len(prompts[1]):
        feeds = []
        for r, n in ((1, 3), (0, 1)):
            if fed[r] < len(prompts[r]):
                feeds.append((r, prompts[r][fed[r]: fed[r] + n]))
                fed[r] += len(feeds[-1][1])
        for (r, _), out in zip(feeds, runner.step(feeds), strict=True):
            got[r].append(out)
    for r in (0, 1):
        torch.testing.assert_close(torch.cat(got[r]), want[r], rtol=1e-4, atol=1e-4)


def engine_prompts(vocab: int) -> list[list[int]]:
    """Three prompts; the last two share a 24-token prefix (whole 8-token blocks)."""
    a, b, c = prompts_for(vocab, [7, 40, 30])
    return [a, b, b[:24] + c]


def test_engine_greedy_matches_hf(checkpoint: Path) -> None:
    """Greedy through the engine: chunked prefill (16-token steps), then the same prompts
    again, served from the prefix cache."""
    path = checkpoint
    config = PretrainedConfig.from_pretrained(path)
    prompts = engine_prompts(config.vocab_size)
    expected = hf_eager_greedy(path, prompts)
    llm = LLM(str(path), max_model_len=128, block_size=8, max_num_batched_tokens=16,
              kv_cache_memory_bytes=8 << 20, skip_tokenizer_init=True)
    for round_ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, f"round {round_}"
    assert any(o.num_cached_tokens > 0 for o in outputs)
