"""Qwen3-MoE (issue 36.2) vs Hugging Face transformers (fp32, eager attention).

Tiny random configs (3 layers, 8 experts, top-2, hidden 64) saved with transformers' own
class. Oracles:
  * the MoE block alone: ours on transformers' Qwen3MoeSparseMoeBlock weights, many tokens
    (every expert active, several tokens per expert);
  * every fed position's logits through our loader and paged cache (one flat batch, then
    decodes interleaved with 3-token chunks);
  * the engine's greedy tokens vs transformers' `generate`, batched, chunked prefill under a
    16-token budget, the second pass served from the prefix cache;
  * a GGUF file the test writes as llama.cpp stores qwen3moe (stacked ffn_*_exps) vs
    transformers on the HF folder;
  * int8 / int4 experts (per expert): transformers on the weights the quantized layers use.
LoRA (attention adapters only) is tested in tests/lora/test_lora_moe.py; two tensor-parallel
ranks give transformers' tokens (slow: worker processes).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_families_2026 import (
    SMALL_IDS,
    assert_incremental_matches,
    engine_prompts,
    hf_eager_greedy,
    hf_eager_logits,
)
from test_models import TINY, PagedRunner, prompts_for, save_random_model
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as HFMoeBlock

from pagedserve import LLM, SamplingParams
from pagedserve.models.gguf import _gguf_to_hf_names, load_gguf_config
from pagedserve.models.layers.moe import FusedMoE, TopKRouter
from pagedserve.models.loader import load_model, weight_bytes
from pagedserve.models.registry import supported_architectures
from pagedserve.quantization import QuantizationConfig

# Tensors a quantized test file stores quantized: attention projections and experts.
QUANTIZED_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "_exps")
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=32, **SMALL_IDS)
CONFIGS = {
    # Layer 1 dense (mlp_only_layers); top-2 weights not renormalised (Qwen3MoeConfig's default).
    "moe": Qwen3MoeConfig(**TINY | {"num_hidden_layers": 3}, mlp_only_layers=[1], **MOE),
    # Only layers 1 and 3 sparse (decoder_sparse_step 2); weights renormalised to sum 1.
    "moe_step2_norm": Qwen3MoeConfig(
        **TINY | {"num_hidden_layers": 4}, decoder_sparse_step=2, norm_topk_prob=True, **MOE),
}
NEW_TOKENS = 24


@functools.cache
def _checkpoint(name: str, root: Path) -> Path:
    save_random_model(CONFIGS[name], root / name)
    return root / name


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qwen3_moe")


@pytest.fixture(params=list(CONFIGS))
def checkpoint(request, root: Path) -> Path:
    return _checkpoint(request.param, root)


def test_registered_and_layers_follow_config(root: Path) -> None:
    assert "Qwen3MoeForCausalLM" in supported_architectures()
    model, _ = load_model(_checkpoint("moe_step2_norm", root), torch.float32, torch.device("cpu"))
    sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
    assert sparse == [False, True, False, True]


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@torch.inference_mode()
def test_moe_block_matches_hf(norm_topk_prob: bool) -> None:
    config = Qwen3MoeConfig(**TINY, **MOE | {"norm_topk_prob": norm_topk_prob})
    torch.manual_seed(0)
    hf = HFMoeBlock(config)
    for p in hf.parameters():
        p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    router = TopKRouter(64, 8, 2, norm_topk_prob)
    experts = FusedMoE(8, 64, 32)
    router.weight.copy_(hf.gate.weight)
    for e, expert in enumerate(experts):  # HF keeps the experts stacked: (E, 2I, H), (E, H, I)
        expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])
        expert.down_proj.weight.copy_(hf.experts.down_proj[e])
    x = torch.randn(50, 64)
    weights, ids = router(x)
    assert len(ids.unique()) == 8  # every expert has tokens
    got = experts(x, weights, ids)
    torch.testing.assert_close(got, hf(x[None])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 32])
@torch.inference_mode()
def test_loaded_moe_block_at_decode_sizes_matches_hf(root: Path, dtype: torch.dtype, tokens: int) -> None:
    """A loaded sparse layer at decode sizes (up to gemv.MAX_ROWS tokens: the whole layer is
    one `gemv_moe` call on the experts' stacked tiles) against transformers' block on the
    same weights, in the same dtype."""
    from transformers import AutoModelForCausalLM

    from pagedserve.quantization import gemv

    path = _checkpoint("moe", root)
    model, config = load_model(path, dtype, torch.device("cpu"))
    ours = model.model.layers[0].mlp
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).model.layers[0].mlp
    x = torch.randn(tokens, config.hidden_size, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    got = ours(x)
    if gemv.gemv_ops() is not None:
        assert ours.experts.stacked_tiles is not None, "the fused decode path is in use"
    # bf16: each of transformers' roundings is ours; the sums' order is not, which may move
    # a result by one bf16 ulp (2^-8 relative; AVX512-BF16 here gives transformers' bits).
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (8e-3, 1e-3)
    torch.testing.assert_close(got, hf(x[None])[0], rtol=rtol, atol=atol)


def test_prefill_and_incremental_match_hf(checkpoint: Path) -> None:
    model, config = load_model(checkpoint, torch.float32, torch.device("cpu"))
    loaded_bytes = weight_bytes(model)
    prompts = prompts_for(config.vocab_size, [23, 1, 40])
    want = hf_eager_logits(checkpoint, prompts)
    for got, exp in zip(PagedRunner(model, 3).step(list(enumerate(prompts))), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    # The first forward stacked the experts' GEMV tiles (moe.FusedMoE): moved, not copied.
    assert weight_bytes(model) == loaded_bytes
    assert_incremental_matches(model, [prompts[0], prompts[2]], [want[0], want[2]])


def test_engine_greedy_matches_hf(root: Path) -> None:
    """Three requests batched, 16-token steps (chunked prefill), then again from the prefix
    cache; token for token as transformers' generate."""
    path = _checkpoint("moe", root)
    prompts = engine_prompts(CONFIGS["moe"].vocab_size)
    expected = hf_eager_greedy(path, prompts)
    llm = LLM(str(path), max_model_len=128, block_size=8, max_num_batched_tokens=16,
              kv_cache_memory_bytes=8 << 20, skip_tokenizer_init=True, enable_prefix_caching=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    for round_ in range(2):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected, f"round {round_}"
    assert any(o.num_cached_tokens > 0 for o in outputs)
    llm.llm_engine.assert_no_leaks()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_experts_match_hf_on_their_weights(root: Path, tmp_path: Path, method: str) -> None:
    """Every expert linear gets the method, per expert (the router stays float), and the
    model equals transformers run on the weights each quantized layer computes with (its
    output for the identity matrix; weight-only, so activations stay float)."""
    path = _checkpoint("moe", root)
    quant = QuantizationConfig(method, 32, activations="none")
    model, config = load_model(path, torch.float32, torch.device("cpu"), quant)
    sparse = model.model.layers[0].mlp
    names = {e.gate_up_proj.quant_method.name for e in sparse.experts}
    names |= {e.down_proj.quant_method.name for e in sparse.experts}
    assert all(name.startswith(method) for name in names), names
    assert isinstance(sparse.gate.weight, torch.nn.Parameter) and sparse.gate.weight.dtype == torch.float32
    save_quantized_weights(model, path, tmp_path)
    prompts = prompts_for(config.vocab_size, [23, 40])
    want = hf_eager_logits(tmp_path, prompts)
    for got, exp in zip(PagedRunner(model, 2).step(list(enumerate(prompts))), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def save_quantized_weights(model: torch.nn.Module, folder: Path, out: Path) -> None:
    """`folder`'s checkpoint with every linear weight replaced by what `model`'s quantized
    layer multiplies by (x = I gives W^T; no layer here has a bias), in HF names."""
    import shutil

    from pagedserve.models.layers.linear import LinearBase

    weights = load_file(folder / "model.safetensors")
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        w = layer(torch.eye(layer.input_size)).T.contiguous()  # (out, in)
        stem, _, name = prefix.rpartition(".")
        for part, rows in zip(parts.get(name, (name,)), w.split(layer.output_sizes), strict=True):
            assert weights[f"{stem}.{part}.weight"].shape == rows.shape
            weights[f"{stem}.{part}.weight"] = rows.contiguous()
    for file in folder.iterdir():
        if file.name != "model.safetensors":
            shutil.copy(file, out / file.name)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})


def write_qwen3moe_gguf(folder: Path, config: Qwen3MoeConfig, out: Path, qtype: str = "F32") -> None:
    """The folder's weights as llama.cpp's converter stores a qwen3moe model: attention as
    qwen3, each layer's experts stacked into ffn_{gate,up,down}_exps (E, out, in), the
    router as ffn_gate_inp, with the metadata keys llama.cpp writes. `qtype`: the type of
    the attention projections and the experts (the rest F32); the folder's weights are
    replaced by the values the file holds (gguf's own dequantization)."""
    gguf = pytest.importorskip("gguf")
    kind = gguf.GGMLQuantizationType[qtype]

    def add(name: str, hf_names: list[str], tensor: torch.Tensor) -> None:
        data = tensor.float().numpy()
        if qtype != "F32" and name.rpartition(".")[0].endswith(QUANTIZED_PARTS):
            data = gguf.quants.quantize(data, kind)
            values = torch.from_numpy(gguf.quants.dequantize(data, kind).reshape(tensor.shape).copy())
            for i, hf_name in enumerate(hf_names):  # what the file holds, for transformers
                weights_out[hf_name] = values[i] if len(hf_names) > 1 else values
            writer.add_tensor(name, data, raw_dtype=kind)
        else:
            writer.add_tensor(name, data)

    writer = gguf.GGUFWriter(str(out), "qwen3moe")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    names = {hf: g for g, hf in _gguf_to_hf_names("qwen3moe", config).items()}
    weights = load_file(folder / "model.safetensors")
    weights_out = dict(weights)
    for layer in range(config.num_hidden_layers):
        for proj in ("gate", "up", "down"):
            experts = [f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
                       for e in range(config.num_experts)]
            add(f"blk.{layer}.ffn_{proj}_exps.weight", experts,
                torch.stack([weights.pop(name) for name in experts]))
    for name, tensor in weights.items():
        add(names[name], [name], tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if qtype != "F32":
        save_file({k: v.contiguous() for k, v in weights_out.items()}, folder / "model.safetensors",
                  metadata={"format": "pt"})


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_qwen3moe_matches_hf(tmp_path: Path, qtype: str) -> None:
    """Dequantized at load (Q8_0: attention and stacked experts) vs transformers on the
    values the file holds."""
    # llama.cpp's qwen3moe: every layer sparse, top-k weights renormalised.
    config = Qwen3MoeConfig(**TINY, norm_topk_prob=True, **MOE)
    save_random_model(config, tmp_path / "hf")
    path = tmp_path / "qwen3moe.gguf"
    write_qwen3moe_gguf(tmp_path / "hf", config, path, qtype)
    loaded = load_gguf_config(path)
    assert loaded.architectures == ["Qwen3MoeForCausalLM"]
    assert (loaded.moe_intermediate_size, loaded.num_experts, loaded.num_experts_per_tok,
            loaded.norm_topk_prob, loaded.mlp_only_layers) == (32, 8, 2, True, [])
    model, _ = load_model(path, torch.float32, torch.device("cpu"), gguf_blocks=False)
    prompts = prompts_for(config.vocab_size, [30, 1, 17])
    want = hf_eager_logits(tmp_path / "hf", prompts)
    for got, exp in zip(PagedRunner(model, 3).step(list(enumerate(prompts))), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)
    if qtype == "F32":
        return
    # quantization="gguf": the attention's Q8_0 blocks served as they are, the experts (3-D
    # in the file) dequantized at load.
    model, _ = load_model(path, torch.float32, torch.device("cpu"), QuantizationConfig("gguf", activations="none"))
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.quant_method.name.startswith("gguf")
    assert not layer.mlp.experts[0].gate_up_proj.quant_method.name.startswith("gguf")
    for got, exp in zip(PagedRunner(model, 3).step(list(enumerate(prompts))), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # two worker processes: ~50 s on the shared 2-core machine
def test_two_ranks_greedy_matches_hf(root: Path) -> None:
    """Tensor parallelism: each rank holds a slice of every expert's columns, and one
    all-reduce a layer sums the experts' partial outputs."""
    path = _checkpoint("moe", root)
    prompts = engine_prompts(CONFIGS["moe"].vocab_size)
    llm = LLM(str(path), tensor_parallel_size=2, max_model_len=128, block_size=8,
              kv_cache_memory_bytes=8 << 20, skip_tokenizer_init=True, dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_eager_greedy(path, prompts)
    llm.llm_engine.assert_no_leaks()
