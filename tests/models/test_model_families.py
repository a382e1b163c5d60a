"""OPT and GPT-2 vs Hugging Face transformers (fp32), like the Llama family's tests.

(a) Random configs covering each option (pre-/post-LN, project_in/out, no biases, no
    LayerNorm affine, GELU variants, inverse-layer-idx scaling): every position's logits
    through our loader and paged cache vs transformers' full forward.
(b) The "opt" and "gpt2" demo models through the engine: batched greedy token for token vs
    `generate` with logprobs within 1e-4, and chunked prefill under a tiny token budget.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_models import PagedRunner, hf_logits, prompts_for, save_config, save_random_model
from transformers import AutoConfig, GPT2Config, OPTConfig, PretrainedConfig

from pagedserve import LLM, SamplingParams
from pagedserve.models.loader import load_model
from pagedserve.models.registry import supported_architectures

from hf_reference import NEW_TOKENS, hf_greedy, hf_token_logprobs, make_prompts

TINY_OPT = dict(
    vocab_size=96,
    hidden_size=64,
    ffn_dim=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)
TINY_GPT2 = dict(vocab_size=96, n_embd=64, n_layer=2, n_head=4, n_positions=256)
CONFIGS: dict[str, PretrainedConfig] = {
    "opt_pre_ln_proj": OPTConfig(**TINY_OPT, word_embed_proj_dim=32),
    "opt_post_ln_gelu": OPTConfig(
        **TINY_OPT, do_layer_norm_before=False, activation_function="gelu"
    ),
    "opt_no_bias_no_affine": OPTConfig(
        **TINY_OPT, enable_bias=False, layer_norm_elementwise_affine=False,
        tie_word_embeddings=False,
    ),
    "gpt2": GPT2Config(**TINY_GPT2),
    "gpt2_inv_layer_scale_relu": GPT2Config(
        **TINY_GPT2, n_inner=80, scale_attn_by_inverse_layer_idx=True, activation_function="relu"
    ),
}
DEMO_MODELS = ["opt", "gpt2"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    save_random_model(CONFIGS[request.param], path)
    return path


def test_registered() -> None:
    assert {"OPTForCausalLM", "GPT2LMHeadModel"} <= set(supported_architectures())


def test_prefill_and_incremental_match_hf(checkpoint: Path) -> None:
    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"))
    prompts = prompts_for(config.vocab_size, [23, 1, 40])
    want = hf_logits(checkpoint, prompts)
    for got, exp in zip(PagedRunner(model, 3).step(list(enumerate(prompts))), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    # Incremental: a 7-token prefix, then 5-token chunks through the KV cache.
    runner = PagedRunner(model, 3)
    prompt = prompts[2]
    got = [runner.step([(0, prompt[:7])])[0]]
    for start in range(7, len(prompt), 5):
        got.append(runner.step([(0, prompt[start : start + 5])])[0])
    torch.testing.assert_close(torch.cat(got), want[2], rtol=1e-4, atol=1e-4)


def _rewrite_names(path: Path, rename, extra: dict[str, torch.Tensor]) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors = {rename(k): v for k, v in tensors.items()} | extra
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize("family", ["opt", "gpt2"])
def test_original_checkpoint_names_load(tmp_path: Path, family: str) -> None:
    """facebook/opt-* name tensors `decoder.*`; OpenAI's gpt2 `h.N.*` plus mask buffers."""
    config = CONFIGS["opt_pre_ln_proj" if family == "opt" else "gpt2"]
    save_random_model(config, tmp_path)
    prompt = prompts_for(config.vocab_size, [12])
    want = hf_logits(tmp_path, prompt)[0]
    if family == "opt":
        _rewrite_names(tmp_path, lambda k: k.removeprefix("model."), {})
    else:
        mask = torch.tril(torch.ones(1, 1, 256, 256))
        _rewrite_names(
            tmp_path, lambda k: k.removeprefix("transformer."), {"h.0.attn.bias": mask}
        )
    model, _ = load_model(tmp_path, torch.float32, torch.device("cpu"))
    got = PagedRunner(model, 1).step([(0, prompt[0])])[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "config, arch, option",
    [
        (OPTConfig(**TINY_OPT, activation_function="swish"), "OPTForCausalLM", "swish"),
        (GPT2Config(**TINY_GPT2, add_cross_attention=True), "GPT2LMHeadModel", "add_cross_attention"),
    ],
    ids=["opt_activation", "gpt2_cross_attention"],
)
def test_unsupported_is_refused(
    tmp_path: Path, config: PretrainedConfig, arch: str, option: str
) -> None:
    save_config(config, tmp_path, arch)
    with pytest.raises(ValueError, match=option):
        load_model(tmp_path, torch.float32, torch.device("cpu"))


# ---- through the engine, on the demo models -------------------------------------------


@pytest.fixture(scope="module", params=DEMO_MODELS)
def reference(request, model_path):
    """(model path, prompts, HF greedy outputs) for one demo model."""
    path = model_path(request.param)
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size)
    expected = [hf_greedy(path, p, min_new_tokens=NEW_TOKENS) for p in prompts]
    return path, prompts, expected


def _generate(path: str, prompts: list[list[int]], **kwargs) -> tuple[LLM, list]:
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=32 << 20, **kwargs)
    return llm, llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)


def test_batched_greedy_matches_transformers_with_logprobs(reference) -> None:
    path, prompts, expected = reference
    _, outputs = _generate(path, prompts)
    for i, (out, prompt, exp) in enumerate(zip(outputs, prompts, expected, strict=True)):
        completion = out.outputs[0]
        assert completion.token_ids == exp, f"prompt {i}: engine and transformers differ"
        ours = [e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids, strict=True)]
        theirs = hf_token_logprobs(path, prompt, completion.token_ids)
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-4


def test_chunked_prefill_under_tiny_budget(reference) -> None:
    path, prompts, expected = reference
    llm, outputs = _generate(path, prompts, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.llm_engine.get_stats().num_steps_total > 300 // 16
