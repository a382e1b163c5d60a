"""`quantization="gguf"`: a GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights served as they are.

Oracles: gguf's own dequantization of the file's blocks (through transformers' GGUF loader,
which calls `gguf.quants.dequantize`); transformers loading the same file (fp32); transformers
with every linear weight replaced by the values our layers hold (the file's, except for Q4_*
on a CPU without the GEMV kernel, whose int4 layout keeps scale / zero in bf16).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_utils import llama_gguf_writer
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.models.layers.linear import LinearBase
from pagedserve.models.loader import load_model
from pagedserve.quantization import QuantizationConfig, gemv

gguf = pytest.importorskip("gguf")

LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 2, 64, 128, 4, 2, 256
PARTS = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj",
         "ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
ENGINE = {"dtype": "float32", "skip_tokenizer_init": True, "kv_cache_memory_bytes": 4 << 20}


def write_gguf(path, linear_type: str, types: dict[tuple[int, str], str] | None = None,
               output_type: str = "F16") -> None:
    """A random 2-layer Llama GGUF: every linear weight `linear_type` unless `types` says
    otherwise for (layer, part); F32 norms, Q8_0 embedding, an `output_type` output head."""
    rng = np.random.default_rng(1)
    writer = llama_gguf_writer(path, "llama", LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB)

    def add(name: str, shape: tuple[int, ...], qtype: str, scale: float = 0.08, offset: float = 0.0) -> None:
        w = (rng.standard_normal(shape) * scale + offset).astype(np.float32)
        if qtype == "F32":
            writer.add_tensor(name, w)
        elif qtype == "F16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            data = gguf.quants.quantize(w, kind)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    kv = HIDDEN // HEADS * KV_HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    add("token_embd.weight", (VOCAB, HIDDEN), "Q8_0", scale=0.5)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), "F32", offset=1.0)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), "F32", offset=1.0)
        for part, shape in shapes.items():
            add(f"blk.{i}.{part}.weight", shape, (types or {}).get((i, part), linear_type))
    add("output_norm.weight", (HIDDEN,), "F32", offset=1.0)
    add("output.weight", (VOCAB, HIDDEN), output_type, scale=0.5)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf-quantized")
    files = {}
    for kind in ("Q8_0", "Q4_0", "Q4_1"):
        files[kind] = folder / kind / "tiny.gguf"  # one file per folder (transformers' loader)
        files[kind].parent.mkdir()
        write_gguf(files[kind], kind)
    return files


def _gguf_weights(path) -> dict[str, torch.Tensor]:
    """HF name -> gguf's own float32 dequantization, q/k rows in HF order (transformers')."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return {name: p.detach() for name, p in reference.named_parameters()}


def _our_layers(path) -> dict[str, tuple[str, torch.Tensor]]:
    """HF name -> (method name, float32 weight our layer holds), fused layers split by shard."""
    model, _ = load_model(path, torch.float32, torch.device("cpu"), _gguf_config())
    out = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        method = module.quant_method
        weight = method.dequantized_weight(module) if hasattr(method, "dequantized_weight") else None
        shards = module.shard_ids or [None]
        for shard in shards:
            name = prefix
            if shard is not None:
                theirs = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj"}[shard]
                name = prefix.replace("qkv_proj", theirs).replace("gate_up_proj", theirs)
            rows = module.shard_slice(shard) if shard is not None else slice(None)
            out[f"{name}.weight"] = (method.name, None if weight is None else weight[rows])
    return out


def _gguf_config():
    from pagedserve.quantization import QuantizationConfig

    return QuantizationConfig("gguf")


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_layers_hold_the_files_values(gguf_files, kind: str):
    """Q8_0: int8 q and float16 scales as stored, bit for bit. Q4_0 / Q4_1: where the GEMV
    kernel runs, q, d and m as stored (W = q d + m, as gguf computes it), bit for bit; else
    (torch's int4 kernel) scale d and zero m + 8 d rounded to bf16 (2^-9 relative each), so
    W moves by at most (|q - 8| |d| + |m + 8 d|) 2^-8 <= (16 d + |min|) 2^-8 per block."""
    want = _gguf_weights(gguf_files[kind])
    ours = _our_layers(gguf_files[kind])
    assert len(ours) == LAYERS * len(PARTS)
    exact = kind == "Q8_0" or gemv.gemv_ops() is not None
    for name, (method, weight) in ours.items():
        assert method == ("gguf-int8" if kind == "Q8_0" else "gguf-q4")
        w = want[name]
        if exact:
            assert torch.equal(weight, w), name
            continue
        groups = w.view(w.shape[0], -1, 32)
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
        bound = (16 * (hi - lo) / 15 + lo.abs()) * 2**-8
        assert ((weight - w).view_as(groups).abs() <= bound + 1e-12).all(), name


def _reference_with(path, weights: dict[str, torch.Tensor] | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    if weights:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name in weights:
                    p.copy_(weights[name])
    return model


def _hf_greedy(model: nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# At most 32 tokens: prefill too runs through the GEMV kernel (float32 x) on every CPU.
PROMPTS = [[5, 9, 33, 120], list(range(3, 30)), [7]]


def _engine_greedy(path, prompts: list[list[int]], **kwargs) -> list[list[int]]:
    llm = LLM(str(path), quantization="gguf", **ENGINE, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_q8_0_greedy_equals_transformers_on_the_file(gguf_files):
    path = gguf_files["Q8_0"]
    reference = _reference_with(path)
    assert _engine_greedy(path, PROMPTS) == [_hf_greedy(reference, p, 12) for p in PROMPTS]


def test_a_q8_0_head_is_served_as_the_files_blocks(tmp_path):
    """quantize_lm_head with gguf: the head in int8 blocks of 32 holds exactly the file's Q8_0
    numbers (requantizing q * d gives q and d back), and serves transformers' tokens."""
    path = tmp_path / "q8head" / "tiny.gguf"
    path.parent.mkdir()
    write_gguf(path, "Q4_1", output_type="Q8_0")
    model, _ = load_model(path, torch.float32, torch.device("cpu"),
                          QuantizationConfig("gguf", quantize_lm_head=True))
    head = model.lm_head
    assert head.quant_method.name == "int8-grouped"
    assert torch.equal(head.quant_method.dequantized_weight(head), _gguf_weights(path)["lm_head.weight"])
    ours = {name: w for name, (_, w) in _our_layers(path).items() if w is not None}
    reference = _reference_with(path, ours)
    assert _engine_greedy(path, PROMPTS, quantize_lm_head=True) == [_hf_greedy(reference, p, 12) for p in PROMPTS]


def test_q4_1_greedy_equals_transformers(gguf_files):
    """Against transformers with the values our layers hold (the file's own where the GEMV
    kernel runs, test above): token for token; where they are the file's, also the
    teacher-forced logprobs of transformers loading the file, within float32 noise."""
    path = gguf_files["Q4_1"]
    ours = {name: w for name, (_, w) in _our_layers(path).items()}
    held = _reference_with(path, ours)
    got = _engine_greedy(path, PROMPTS)
    assert got == [_hf_greedy(held, p, 12) for p in PROMPTS]
    if gemv.gemv_ops() is None:
        return
    exact = _reference_with(path)
    llm = LLM(str(path), quantization="gguf", **ENGINE)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        seq = prompt + tokens
        out = llm.generate({"prompt_token_ids": seq}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        with torch.inference_mode():
            want = torch.log_softmax(exact(torch.tensor([seq])).logits[0], -1)
        diffs = [abs(entry[t].logprob - want[i, t].item())
                 for i, (t, entry) in enumerate(zip(seq[1:], out.prompt_logprobs[1:], strict=True))]
        assert max(diffs) < 1e-4


def test_mixed_file_gets_a_method_per_layer(tmp_path):
    """Per layer, from its tensors' types: all Q8_0 -> int8 blocks; all Q4_0/Q4_1 -> int4
    blocks; Q8_0 and Q4 fused into one layer -> int8 tiles with a level 0 where the GEMV
    kernel runs (else dequantized); a float tensor -> dequantized (packed fp32)."""
    path = tmp_path / "mixed.gguf"
    write_gguf(path, "Q8_0", {(0, "attn_k"): "Q4_1", (0, "ffn_gate"): "Q4_0", (0, "ffn_up"): "Q4_1",
                              (0, "ffn_down"): "F16", (1, "attn_q"): "F32"})
    model, _ = load_model(path, torch.float32, torch.device("cpu"), _gguf_config())
    methods = {prefix: m.quant_method.name for prefix, m in model.named_modules() if isinstance(m, LinearBase)}
    dense = {"onednn-packed", "unquantized"}
    fused = "gguf-int8" if gemv.gemv_ops() is not None else "onednn-packed"
    assert methods["model.layers.0.self_attn.qkv_proj"] in {fused, "unquantized"}  # Q8_0 + Q4_1 + Q8_0
    assert methods["model.layers.0.self_attn.o_proj"] == "gguf-int8"
    assert methods["model.layers.0.mlp.gate_up_proj"] == "gguf-q4"  # Q4_0 + Q4_1
    assert methods["model.layers.0.mlp.down_proj"] in dense  # F16
    assert methods["model.layers.1.self_attn.qkv_proj"] in dense  # F32 + Q8_0
    assert methods["model.layers.1.mlp.gate_up_proj"] == "gguf-int8"
    # And it serves: the same greedy tokens as transformers on the dequantized layers' values.
    ours = {name: w for name, (_, w) in _our_layers(path).items() if w is not None}
    held = _reference_with(path, ours)
    assert _engine_greedy(path, PROMPTS[:1]) == [_hf_greedy(held, PROMPTS[0], 12)]


def test_gguf_quantization_refuses_other_models_and_settings(model_path):
    with pytest.raises(ValueError, match="quantization='gguf'.*not one"):
        LLM(model_path("llama-gqa"), quantization="gguf", **ENGINE)
    with pytest.raises(ValueError, match="quantization_group_size"):
        LLM(model_path("llama-gqa"), quantization="gguf", quantization_group_size=64, **ENGINE)


def test_gguf_quantization_refuses_tensor_parallelism(gguf_files):
    # The file's blocks are loaded whole; refused before any worker process starts.
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(gguf_files["Q8_0"]), quantization="gguf", tensor_parallel_size=2, **ENGINE)
