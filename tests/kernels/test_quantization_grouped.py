"""Group-wise int8 (Q8_0-like, the default int8) against a dense reference, and GGUF's
Q8_0 / Q4_0 / Q4_1 blocks loaded into the int8 / int4 methods without requantizing.

Oracles: the dequantized weight is within half a step of the original, per group; a layer's
output equals F.linear with the dequantized weight (float32, only the summation order
differs); GGUF Q8_0 blocks written by the `gguf` package load without requantizing and give
gguf's own dequantization; the engine equals transformers with every linear layer's weight
replaced by its dequantized copy, token for token.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve import LLM, SamplingParams
from pagedserve.models.layers.linear import LinearBase
from pagedserve.models.loader import load_model
from pagedserve.quantization import QuantizationConfig, gemv
from pagedserve.quantization.gguf_blocks import from_gguf_q4_0, from_gguf_q4_1, from_gguf_q8_0
from pagedserve.quantization.int4 import (
    Int4LinearMethod,
    _packed_block_n,
    dequantize_int4,
)
from pagedserve.quantization.int8_grouped import (
    Int8GroupedLinearMethod,
    dequantize_int8_grouped,
    quantize_int8_grouped,
)
from pagedserve.quantization.packed import onednn_packs

from hf_reference import make_prompts


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.output_size, self.input_size = weight.shape
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self.bias = bias


def _weights(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) / math.sqrt(in_features)
    w[3] = 0.0  # an all-zero row must not produce NaN
    w[5, 7] = 40 * w.abs().max()  # an outlier coarsens only its own group
    return w


@pytest.mark.parametrize("group", [32, 128])
def test_round_trip_within_half_a_step_per_group(group: int) -> None:
    w = _weights(96, 256)
    q, scale = quantize_int8_grouped(w, group)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    assert scale.dtype == torch.float16 and scale.shape == (96, 256 // group)
    back = dequantize_int8_grouped(q, scale)
    step = scale.float().repeat_interleave(group, dim=1)
    assert ((back - w).abs() <= step / 2 * (1 + 1e-3) + 1e-12).all()
    assert not back[3].any()
    # The outlier's group has a coarse step; the rest of its row keeps a fine one.
    assert scale[5, 0] > 20 * scale[5, 1]


def test_groups_beat_one_scale_per_channel_on_outliers() -> None:
    from pagedserve.quantization.int8 import dequantize_int8, quantize_int8

    w = _weights(96, 256)
    grouped = (dequantize_int8_grouped(*quantize_int8_grouped(w, 32)) - w)[5].pow(2).sum()
    channel = (dequantize_int8(*quantize_int8(w)) - w)[5].pow(2).sum()
    assert grouped < channel / 5  # the outlier group still has its coarse step


# 1-32: one kernel call; 33-128: the kernel 32 rows a call; 200: dequantized blocks + GEMM
@pytest.mark.parametrize("rows", [1, 17, 33, 128, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_equals_dense_reference(rows: int, dtype: torch.dtype) -> None:
    w, bias = _weights(192, 256), torch.randn(192)
    layer = _Linear(w.to(dtype), bias.to(dtype))
    method = Int8GroupedLinearMethod(32)
    method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight")
    q, scale = quantize_int8_grouped(w.to(dtype), 32)
    stored_q, stored_scale = method.int_weight(layer)
    assert torch.equal(stored_q, q) and torch.equal(stored_scale, scale)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = method.apply(layer, x)
    assert got.dtype == dtype and got.shape == (rows, 192)
    want = F.linear(x.float(), dequantize_int8_grouped(q, scale).to(dtype).float(), bias.to(dtype).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert method.apply(layer, x.reshape(1, rows, 256)).shape == (1, rows, 192)


def test_gguf_q8_0_blocks_load_without_requantizing() -> None:
    from gguf import GGMLQuantizationType, quants

    w = _weights(64, 128).numpy()
    raw = quants.quantize(w, GGMLQuantizationType.Q8_0)  # (64, 128 / 32 * 34) uint8
    q, scale = from_gguf_q8_0(torch.from_numpy(raw), (64, 128))
    want = quants.dequantize(raw, GGMLQuantizationType.Q8_0)
    assert np.array_equal(dequantize_int8_grouped(q, scale).numpy(), want)
    layer = _Linear(torch.zeros(64, 128))
    method = Int8GroupedLinearMethod(32)
    del layer.weight
    method.set_quantized(layer, q, scale)
    x = torch.randn(3, 128)
    torch.testing.assert_close(method.apply(layer, x), F.linear(x, torch.from_numpy(want)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_load_into_int4_without_requantizing(kind: str) -> None:
    from gguf import GGMLQuantizationType, quants

    qtype = getattr(GGMLQuantizationType, kind)
    w = _weights(64, 128).numpy()
    raw = quants.quantize(w, qtype)
    q, scale, zero = (from_gguf_q4_0 if kind == "Q4_0" else from_gguf_q4_1)(torch.from_numpy(raw), (64, 128))
    want = torch.from_numpy(quants.dequantize(raw, qtype))
    assert torch.equal(dequantize_int4(q, scale, zero, 32), want)  # same values, float32 scales
    layer = _Linear(torch.zeros(64, 128))
    del layer.weight
    Int4LinearMethod(32).set_quantized(layer, q, scale, zero, 32)
    # The stored q is gguf's, bit for bit; only scale / zero are rounded to bfloat16.
    if hasattr(layer, "qweight_tiles") or _packed_block_n() is not None:
        stored, stored_scale, stored_zero = Int4LinearMethod(32).int_weight(layer)
        assert torch.equal(stored, q)
        assert torch.equal(stored_scale, scale.bfloat16()) and torch.equal(stored_zero, zero.bfloat16())
    x = torch.randn(3, 128)
    got = Int4LinearMethod(32).apply(layer, x)
    want_y = F.linear(x, want)
    assert ((got - want_y).abs() <= 2e-2 * want_y.abs().max()).all()


def test_int8_defaults_to_groups_of_32_and_per_channel_stays_available(model_path) -> None:
    path = model_path("llama-gqa")
    model, _ = load_model(path, torch.float32, torch.device("cpu"), QuantizationConfig("int8"))
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert {m.quant_method.name for m in layers} == {"int8-grouped"}
    assert all(m.quant_method.int_weight(m)[1].shape[1] == m.input_size // 32 for m in layers)
    channel, _ = load_model(path, torch.float32, torch.device("cpu"), QuantizationConfig("int8", -1))
    assert {m.quant_method.name for m in channel.modules() if isinstance(m, LinearBase)} == {"int8"}
    with pytest.raises(ValueError, match="group_size"):
        QuantizationConfig("int4", -1)


def _dequantized_reference(path: str) -> nn.Module:
    """transformers' model with every linear weight (not the LM head) replaced by its
    group-wise int8 round trip."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                module.weight.copy_(dequantize_int8_grouped(*quantize_int8_grouped(module.weight, 32)))
    return model


def test_engine_equals_transformers_on_dequantized_weights(model_path) -> None:
    path = model_path("llama-gqa")
    prompts = make_prompts(AutoConfig.from_pretrained(path).vocab_size, [1, 5, 33, 100], seed=4)
    reference = _dequantized_reference(path)
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20, quantization="int8",
              quantization_activations="none")  # weight-only: x stays float (test_gemv_q8.py: int8 x)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, prompt in zip(outputs, prompts, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                      min_new_tokens=12, do_sample=False,
                                      pad_token_id=reference.config.pad_token_id)[0, len(prompt):].tolist()
            logprobs = torch.log_softmax(reference(ids).logits[0].float(), -1)
        assert out.outputs[0].token_ids == want
        for position, (token, entry) in enumerate(zip(prompt[1:], out.prompt_logprobs[1:], strict=True)):
            assert abs(entry[token].logprob - logprobs[position, token].item()) < 1e-4


@pytest.mark.skipif(onednn_packs(torch.bfloat16) or gemv.gemv_ops() is None,
                    reason="bf16 prefill keeps torch's bf16 GEMM where oneDNN has one")
def test_bf16_prefill_multiplies_the_exact_weights_in_float32() -> None:
    """Without a bf16 GEMM, > 32 bf16 rows multiply the weights' exact float32 values and round
    once, as the decode GEMV does: the same rows agree to one bf16 rounding at 200 rows and at 8
    (weights rounded to bf16 first, as before, disagreed by several)."""
    w = _weights(192, 256)
    layer = _Linear(w.bfloat16(), None)
    method = Int8GroupedLinearMethod(32)
    method.process_weights_after_loading(layer)
    x = torch.randn(200, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    prefill = method.apply(layer, x)[:8].float()
    decode = method.apply(layer, x[:8]).float()
    one_rounding = torch.ldexp(torch.ones_like(decode), torch.frexp(decode).exponent - 8)
    assert ((prefill - decode).abs() <= one_rounding).all()
