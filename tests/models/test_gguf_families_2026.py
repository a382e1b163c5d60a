"""GGUF files of the 2026 families (issue 36): qwen3, phi3, gemma2, gemma3.

Each test saves a tiny random HF model, writes the same weights as a GGUF file the way
llama.cpp's converter names and stores them (F32; Gemma's norms as 1 + w; Phi-3's fused
qkv / gate-up), with only the metadata llama.cpp writes, and checks that the model we load
from the file gives transformers' logits on the HF folder. The HF config states what
llama.cpp derives where the file says nothing (Gemma: query_pre_attn_scalar = head_dim,
Gemma 3: 5 windowed : 1 full layers, local RoPE base 10000), so a wrong derivation fails.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_families_2026 import SMALL_IDS, hf_eager_logits
from test_models import PagedRunner, prompts_for, save_random_model
from transformers import Gemma2Config, Gemma3TextConfig, Phi3Config, PretrainedConfig, Qwen3Config

from pagedserve.models.gguf import _gguf_to_hf_names, load_gguf_config
from pagedserve.models.loader import load_model

gguf = pytest.importorskip("gguf")

DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)
CONFIGS: dict[str, PretrainedConfig] = {
    # head_dim 32 != hidden / heads: read from attention.key_length.
    "qwen3": Qwen3Config(**DIMS, num_hidden_layers=2, head_dim=32, rope_theta=1e6, **SMALL_IDS),
    # rope.dimension_count 8 of head_dim 16: partial rotary 0.5; a window on every layer.
    "phi3": Phi3Config(
        **DIMS, num_hidden_layers=2, sliding_window=8, **SMALL_IDS,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
    "gemma2": Gemma2Config(
        **DIMS, num_hidden_layers=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **SMALL_IDS,
    ),
    # 7 layers: windowed 0-4 and 6, full 5 (llama.cpp's pattern of 6).
    "gemma3": Gemma3TextConfig(
        **DIMS, num_hidden_layers=7, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
        **SMALL_IDS, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
    ),
}


END_OF_TURN = 50


def write_gguf_from_hf(
    folder: Path, arch: str, config: PretrainedConfig, out: Path, tokens: bool = False
) -> None:
    """The folder's weights as llama.cpp's converter stores them, with its metadata keys;
    `tokens`: a token list too, <end_of_turn> at END_OF_TURN."""
    writer = gguf.GGUFWriter(str(out), arch)
    if tokens:
        vocab = [f"<tok{i}>" for i in range(config.vocab_size)]
        vocab[:3], vocab[END_OF_TURN] = ["<pad>", "<bos>", "<eos>"], "<end_of_turn>"
        writer.add_token_list(vocab)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    params = config.rope_parameters
    full = params.get("full_attention", params)
    writer.add_rope_freq_base(full["rope_theta"])
    rotary = int(head_dim * params.get("partial_rotary_factor", 1.0))
    writer.add_rope_dimension_count(rotary)
    if arch in ("qwen3", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    names = {hf: g for g, hf in _gguf_to_hf_names(arch, config).items()}
    for name, tensor in load_file(folder / "model.safetensors").items():
        data = tensor.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            data = data + 1  # llama.cpp stores Gemma's (1 + w)
        writer.add_tensor(names[name], data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_gguf_matches_hf(tmp_path: Path, arch: str) -> None:
    config = CONFIGS[arch]
    save_random_model(config, tmp_path / "hf")
    path = tmp_path / f"{arch}.gguf"
    write_gguf_from_hf(tmp_path / "hf", arch, config, path)
    loaded = load_gguf_config(path)
    assert loaded.architectures == [type(config).__name__.replace("TextConfig", "Config").replace(
        "Config", "ForCausalLM")]
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    prompts = prompts_for(config.vocab_size, [30, 1, 17])
    want = hf_eager_logits(tmp_path / "hf", prompts)
    for got, exp in zip(PagedRunner(model, 3).step(list(enumerate(prompts))), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-4)


def test_gguf_end_of_turn_ends_generation(tmp_path: Path) -> None:
    """A Gemma 3 file names <eos> as its eos id; <end_of_turn> (what an instruct model ends a
    reply with) must end generation too, as llama.cpp's end-of-generation list has it."""
    from pagedserve.config import ModelConfig
    from pagedserve.models.source import eos_token_ids, resolve_model_source

    config = CONFIGS["gemma3"]
    save_random_model(config, tmp_path / "hf")
    path = tmp_path / "gemma3.gguf"
    write_gguf_from_hf(tmp_path / "hf", "gemma3", config, path, tokens=True)
    source = resolve_model_source(ModelConfig(str(path), skip_tokenizer_init=True), torch.device("cpu"))
    assert source.generation_eos_ids == (END_OF_TURN,)
    assert eos_token_ids(source.hf_config, None, source.generation_eos_ids) == [2, END_OF_TURN]
