"""Every GGUF tensor type the `gguf` package dequantizes loads: one small random file per type
(every matrix, embedding and head included, in that type), greedy token for token equal to
transformers loading the same file in float32 (its GGUF loader dequantizes with gguf). The
linear layers of Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS files are served from the
file's own blocks (quantization/gguf_decode.py: the same numbers), so those cases test the
native kernels end to end; the other types are dequantized at load, and one log line per load
says what dequantizing cost.

Two activation settings: float activations (`quantization_activations="none"`, FLOAT) equal
plain transformers; the default, int8 activations (llama.cpp's arithmetic: x rounded per block
of 32, integer dot products), equals transformers whose rounded layers get their input rounded
the same way (`gemv.q8_round_trip`, a forward pre-hook): an independent float64-free reference
of the same function.

Types `gguf.quants.quantize` cannot produce (K-quants, I-quants, NVFP4) are written as random
blocks (tests/gguf_utils.py: `random_blocks`): any bytes are a valid block once its scales are
finite, and both sides read the same bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch
from gguf_utils import llama_gguf_writer, quantizable_types, quantized

from pagedserve import LLM, SamplingParams
from pagedserve.models.gguf import (
    GGUFQuantizedTensor,
    dequantizable_types,
    iter_gguf_tensors,
    load_gguf_config,
)
from pagedserve.models.layers.linear import LinearBase
from pagedserve.models.loader import load_model
from pagedserve.quantization import QuantizationConfig, gemv

gguf = pytest.importorskip("gguf")

# 256 columns: the super-block of the K- and I-quants.
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2, 256, 512, 4, 2, 256
ENGINE = {"dtype": "float32", "skip_tokenizer_init": True, "kv_cache_memory_bytes": 4 << 20}
FLOAT = {"quantization": "gguf", "quantization_activations": "none"}  # float activations
NATIVE = ("Q8_0", "Q4_0", "Q4_1")  # covered by test_gguf.py / test_gguf_quantized.py
TYPES = [t for t in quantizable_types() if t not in NATIVE and t != "BF16"]
PROMPTS = [[5, 9, 33, 120], list(range(3, 40)), [7]]


def write_gguf(path, qtype: str, arch: str = "llama", types: dict[str, str] | None = None) -> None:
    """A random 2-layer model whose matrices are all `qtype` (or `types[part]`), F32 norms;
    qwen2 gets F32 q/k/v biases and an untied head."""
    rng = np.random.default_rng(sum(map(ord, qtype)))
    writer = llama_gguf_writer(path, arch, LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB)

    def add(name: str, shape: tuple[int, ...], kind: str, scale: float = 0.06, offset: float = 0.0) -> None:
        w = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, w)
        else:
            data = quantized(w, kind, rng)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])

    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    add("token_embd.weight", (VOCAB, HIDDEN), qtype, scale=0.5)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32", offset=1.0)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32", offset=1.0)
        for part, shape in shapes.items():
            add(f"blk.{i}.{part}.weight", shape, (types or {}).get(part, qtype))
            if arch == "qwen2" and part in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{part}.bias", (shape[0],), "F32", scale=0.5)
    add("output_norm.weight", (HIDDEN,), "F32", offset=1.0)
    add("output.weight", (VOCAB, HIDDEN), qtype, scale=0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _file(tmp_path, qtype: str, **kwargs):
    path = tmp_path / qtype / "tiny.gguf"  # one file per folder (transformers' loader)
    path.parent.mkdir()
    write_gguf(path, qtype, **kwargs)
    return path


def _reference(path, rounded: Callable[[str], bool] | None = None) -> torch.nn.Module:
    """transformers on the file (float32); `rounded(name)`: the linear layers whose input is
    rounded as int8 activations round it (the LM head is "lm_head")."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    for name, module in model.named_modules():
        if rounded is not None and isinstance(module, torch.nn.Linear) and rounded(name):
            module.register_forward_pre_hook(lambda _m, args: (gemv.q8_round_trip(args[0]),))
    # No EOS, as our ignore_eos: `min_new_tokens` would instead mask EOS (id 2) out of the
    # argmax, and a random model picks it now and then.
    model.generation_config.eos_token_id = None
    return model


def _hf_greedy(path, prompts: list[list[int]], new_tokens: int = 12,
               rounded: Callable[[str], bool] | None = None) -> list[list[int]]:
    model = _reference(path, rounded)
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def _engine_greedy(path, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(str(path), **ENGINE, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_every_type_a_test_can_write_is_dequantizable():
    assert set(TYPES) <= set(dequantizable_types())
    assert {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"} <= set(TYPES)


# The types people publish run in the fast suite; the rest (the same dequantize-at-load path,
# another block layout each) in `make test-slow`, which CI runs.
COMMON = {"Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K"}


@pytest.mark.parametrize("qtype", [t if t in COMMON else pytest.param(t, marks=pytest.mark.slow) for t in TYPES])
def test_greedy_equals_transformers(tmp_path, qtype: str):
    path = _file(tmp_path, qtype)
    assert _engine_greedy(path, PROMPTS, **FLOAT) == _hf_greedy(path, PROMPTS)


def _every_layer(_name: str) -> bool:
    return True


@pytest.mark.skipif(gemv.gemv_ops() is None, reason="int8 activations need the GEMV kernel")
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q5_0", "Q5_1", "IQ4_NL"])
def test_int8_activations_equal_transformers_with_rounded_inputs(tmp_path, qtype: str):
    """The default: every linear layer (head included) of a file of one of the <= 6-bit types
    rounds its input to int8 per block of 32 (bit quads x q8); prefill (37 rows) and decode
    steps alike. IQ4_NL (int8 tiles, float16 scales) keeps float activations by default and
    rounds them (int8 quads x q8) when asked.

    Not Q6_K here: this random Q6_K model is chaotic under rounding (x times 1 + 1e-6 noise
    before the rounding moves its logprobs by ~0.7 nats), so the float order of a sum flips a
    greedy token; tests/kernels/test_gguf_kernels.py checks its layers against gguf's values."""
    path = _file(tmp_path, qtype)
    if qtype == "IQ4_NL":
        assert _engine_greedy(path, PROMPTS) == _hf_greedy(path, PROMPTS)
        asked = {"quantization": "gguf", "quantization_activations": "int8"}
        assert _engine_greedy(path, PROMPTS, **asked) == _hf_greedy(path, PROMPTS, rounded=_every_layer)
        return
    assert _engine_greedy(path, PROMPTS) == _hf_greedy(path, PROMPTS, rounded=_every_layer)


@pytest.mark.skipif(gemv.gemv_ops() is None, reason="int8 activations need the GEMV kernel")
def test_bit_quad_files_run_every_step_in_the_decoder_loop(tmp_path, monkeypatch):
    """gemv_bits_q8 takes any row count, so it is the loop's GEMM call too: the prefill (45 rows)
    runs in the C++ loop with one kernel call a layer, and its tokens and logprobs are the
    Python layers' exactly. The Q4_K_M layout of Qwen2.5's files: a Q6_K v beside Q4_K q, k
    (a qkv in two parts: gemv_bits_q8_parts), biases, a Q6_K down."""
    path = _file(tmp_path, "Q4_K", arch="qwen2", types={"attn_v": "Q6_K", "ffn_down": "Q6_K"})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    runs = {}
    for mode in ("cpp", "off"):
        monkeypatch.setenv("PAGEDSERVE_DECODER_LOOP", mode)
        llm = LLM(str(path), **ENGINE)
        runs[mode] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]
        loop = llm.llm_engine.runner.decoder_loop
        qkv = llm.llm_engine.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.quant_method.decode_op(qkv)[0] == "gemv_bits_q8_parts"
        if mode == "cpp":
            assert loop is not None and loop.max_tokens is None
            assert loop.calls == 12  # one prefill step, eleven decode steps
    for ours, python in zip(runs["cpp"], runs["off"], strict=True):
        assert ours.token_ids == python.token_ids and ours.logprobs == python.logprobs


def test_qwen2_with_biases_and_an_untied_head(tmp_path):
    """The layout of Qwen2.5's Q4_K_M files: Q4_K and Q6_K matrices, Q5_0 / Q8_0 where a
    row of 896 is not whole super-blocks (here: v and down), F32 biases."""
    path = _file(tmp_path, "Q4_K", arch="qwen2", types={"attn_v": "Q6_K", "ffn_down": "Q5_0", "attn_k": "Q8_0"})
    assert _engine_greedy(path, PROMPTS, **FLOAT) == _hf_greedy(path, PROMPTS)
    # int8 activations: q / k / v (Q4_K, Q8_0, Q6_K fused: int8 tiles with float32 pairs) keep
    # float activations; every other layer rounds.
    assert _engine_greedy(path, PROMPTS) == _hf_greedy(
        path, PROMPTS, rounded=lambda name: not name.endswith(("q_proj", "k_proj", "v_proj")))


def test_one_log_line_names_the_dequantized_types_and_their_cost(tmp_path, caplog):
    path = _file(tmp_path, "Q4_K", types={"ffn_down": "Q6_K", "attn_q": "Q8_0"})
    with caplog.at_level(logging.INFO, logger="pagedserve.models.gguf"):
        load_model(path, torch.float32, torch.device("cpu"), gguf_blocks=False)
    lines = [r.getMessage() for r in caplog.records if "dequantized at load" in r.getMessage()]
    assert len(lines) == 1
    # The reference path (gguf_blocks=False) dequantizes every quantized tensor (Q8_0 too).
    assert "Q4_K x12" in lines[0] and "Q6_K x2" in lines[0] and "Q8_0 x2" in lines[0]
    assert "float32" in lines[0] and "MiB" in lines[0] and " s" in lines[0]


def test_a_quantized_file_is_served_from_its_blocks_by_default(tmp_path, caplog):
    """No quantization asked: every linear layer keeps the file's blocks (the GEMV kernel's
    forms where it runs); only the embedding and head are dequantized, and the log says so."""
    path = _file(tmp_path, "Q4_K", types={"ffn_down": "Q6_K", "attn_q": "Q8_0"})
    with caplog.at_level(logging.INFO, logger="pagedserve.models.gguf"):
        model, _ = load_model(path, torch.float32, torch.device("cpu"))
    methods = {p: m.quant_method.name for p, m in model.named_modules() if isinstance(m, LinearBase)}
    if gemv.gemv_ops() is None:  # the K-quants' forms need the kernel
        assert set(methods.values()) <= {"onednn-packed", "unquantized"}
        return
    assert methods["model.layers.0.self_attn.qkv_proj"] == "gguf-int8"  # Q8_0 + Q4_K fused
    # K-quants alone: 4- / 6-bit tiles with the file's super-block parameters
    assert methods["model.layers.0.mlp.gate_up_proj"] == "gguf-bits"
    assert methods["model.layers.0.mlp.down_proj"] == "gguf-bits"  # Q6_K in 6-bit tiles
    # The (untied) Q4_K head too, from its blocks, with no float copy left.
    assert model.lm_head.quant_method.name == "gguf-bits" and not hasattr(model.lm_head, "weight")
    lines = [r.getMessage() for r in caplog.records if "dequantized at load" in r.getMessage()]
    assert len(lines) == 1 and "Q4_K x2" in lines[0] and "Q6_K" not in lines[0]


def test_native_types_keep_their_blocks_beside_dequantized_ones(tmp_path, caplog):
    """quantization='gguf': Q8_0 layers keep the int8-block kernel, Q3_K layers (no exact
    integer form here) load dense, and only the dequantized types are named in the log line."""
    path = _file(tmp_path, "Q3_K", types={"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0"})
    config = load_gguf_config(path)
    raw = dict(iter_gguf_tensors(path, config, torch.float32, keep_quantized=True))
    assert isinstance(raw["model.layers.0.self_attn.q_proj.weight"], GGUFQuantizedTensor)
    assert isinstance(raw["model.layers.0.mlp.up_proj.weight"], torch.Tensor)
    with caplog.at_level(logging.INFO, logger="pagedserve.models.gguf"):
        model, _ = load_model(path, torch.float32, torch.device("cpu"), QuantizationConfig("gguf"))
    methods = {p: m.quant_method.name for p, m in model.named_modules() if isinstance(m, LinearBase)}
    assert methods["model.layers.0.self_attn.qkv_proj"] == "gguf-int8"
    assert methods["model.layers.0.mlp.gate_up_proj"] in {"onednn-packed", "unquantized"}
    lines = [r.getMessage() for r in caplog.records if "dequantized at load" in r.getMessage()]
    assert len(lines) == 1 and "Q3_K" in lines[0] and "Q8_0" not in lines[0]
    assert _engine_greedy(path, PROMPTS[:1], **FLOAT) == _hf_greedy(path, PROMPTS[:1])


def test_quantization_none_dequantizes_the_file_at_load(tmp_path):
    """quantization='none' (the benchmark report's bf16 / float32 levels on a GGUF file): no
    layer keeps the file's blocks, and the engine equals transformers on the dequantized
    weights with float activations (the default would round them to int8 and differ)."""
    path = _file(tmp_path, "Q4_K", types={"ffn_down": "Q6_K"})
    llm = LLM(str(path), **ENGINE, quantization="none")
    model = llm.llm_engine.runner.model
    methods = {m.quant_method.name for m in model.modules() if isinstance(m, LinearBase)}
    assert methods <= {"onednn-packed", "unquantized"}, methods
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _hf_greedy(path, PROMPTS)
    llm.llm_engine.assert_no_leaks()
    with pytest.raises(ValueError, match="quantization_activations"):
        LLM(str(path), **ENGINE, quantization="none", quantization_activations="int8")
