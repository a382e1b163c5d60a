"""GGUF loading on a small file the test writes with the `gguf` package: greedy token for
token equal to transformers loading the same file (fp32), the natively served tensor types,
the raw-block seam, and clear errors for what we do not serve."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_utils import llama_gguf_writer

from pagedserve import LLM, SamplingParams
from pagedserve.models.gguf import GGUFQuantizedTensor, iter_gguf_tensors, load_gguf_config

gguf = pytest.importorskip("gguf")

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 3, 64, 128, 4, 2, 256
# One layer per mix of types, so every supported type is read (norms stay F32 as llama.cpp does).
LAYER_TYPES = [
    {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "F16",
     "ffn_gate": "BF16", "ffn_up": "Q8_0", "ffn_down": "Q4_1"},
    {"attn_q": "Q4_1", "attn_k": "Q8_0", "attn_v": "F32", "attn_output": "Q4_0",
     "ffn_gate": "Q4_1", "ffn_up": "F16", "ffn_down": "Q8_0"},
    {"attn_q": "F16", "attn_k": "BF16", "attn_v": "Q8_0", "attn_output": "Q4_1",
     "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "BF16"},
]


def _add(writer, name: str, weights: np.ndarray, qtype: str) -> None:
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype == "F32":
        writer.add_tensor(name, weights.astype(np.float32))
    elif qtype == "F16":
        writer.add_tensor(name, weights.astype(np.float16))
    elif qtype == "I8":  # an integer tensor: no weight type, gguf cannot dequantize it
        writer.add_tensor(name, (weights * 100).astype(np.int8))
    else:
        data = gguf.quants.quantize(weights.astype(np.float32), kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


def write_gguf(path, arch: str = "llama", tied: bool = False, extra_type: str | None = None) -> None:
    """A random 3-layer Llama-shaped GGUF (token ids only: no tokenizer metadata needed)."""
    rng = np.random.default_rng(0)
    writer = llama_gguf_writer(path, arch, LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB)

    def rand(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    _add(writer, "token_embd.weight", rand(VOCAB, HIDDEN, scale=0.5), "Q8_0")
    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for i, types in enumerate(LAYER_TYPES):
        _add(writer, f"blk.{i}.attn_norm.weight", 1 + rand(HIDDEN), "F32")
        _add(writer, f"blk.{i}.ffn_norm.weight", 1 + rand(HIDDEN), "F32")
        for part, shape in shapes.items():
            qtype = extra_type if (extra_type and i == 0 and part == "attn_q") else types[part]
            _add(writer, f"blk.{i}.{part}.weight", rand(*shape), qtype)
            if arch == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                _add(writer, f"blk.{i}.{part}.bias", rand(shape[0], scale=0.5), "F32")
    _add(writer, "output_norm.weight", 1 + rand(HIDDEN), "F32")
    if not tied:
        _add(writer, "output.weight", rand(VOCAB, HIDDEN, scale=0.5), "Q4_1")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=[("llama", False), ("llama", True), ("qwen2", True)],
                ids=["llama-untied", "llama-tied", "qwen2-tied"])
def gguf_file(request, tmp_path_factory):
    arch, tied = request.param
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / "tiny.gguf"
    write_gguf(path, arch=arch, tied=tied)
    return path


def _hf_greedy(path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def test_config_from_metadata(gguf_file):
    config = load_gguf_config(gguf_file)
    arch = gguf.GGUFReader(str(gguf_file)).fields["general.architecture"]
    assert config.architectures == [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[
        bytes(arch.parts[arch.data[0]]).decode()]]
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (HEADS, KV_HEADS, VOCAB)
    assert config.eos_token_id == 2
    has_output = any(t.name == "output.weight" for t in gguf.GGUFReader(str(gguf_file)).tensors)
    assert config.tie_word_embeddings is not has_output


def test_greedy_equals_transformers(gguf_file):
    prompts = [[5, 9, 33, 120], list(range(3, 40)), [7]]
    expected = _hf_greedy(gguf_file, prompts, 12)
    llm = LLM(str(gguf_file), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_raw_blocks_dequantize_to_the_loaded_weights(gguf_file):
    config = load_gguf_config(gguf_file)
    dense = dict(iter_gguf_tensors(gguf_file, config, torch.float32))
    raw = dict(iter_gguf_tensors(gguf_file, config, torch.float32, keep_quantized=True))
    assert raw.keys() == dense.keys()
    kinds = {t.qtype for t in raw.values() if isinstance(t, GGUFQuantizedTensor)}
    assert kinds == {"Q8_0", "Q4_0", "Q4_1"}
    for name, tensor in raw.items():
        if isinstance(tensor, GGUFQuantizedTensor):
            assert tensor.blocks.dtype == torch.uint8 and tensor.shape == tuple(dense[name].shape)
            # q/k rows come back in HF order in both forms (Llama's permutation undone).
            torch.testing.assert_close(tensor.dequantize(), dense[name], rtol=0, atol=0)
        else:
            torch.testing.assert_close(tensor, dense[name], rtol=0, atol=0)


def test_unsupported_tensor_type_is_named(tmp_path):
    """Every type gguf dequantizes loads (test_gguf_types.py); one it cannot is named."""
    path = tmp_path / "i8.gguf"
    write_gguf(path, extra_type="I8")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight.*I8.*cannot dequantize"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    write_gguf(path, arch="phi2")
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=4 << 20)
