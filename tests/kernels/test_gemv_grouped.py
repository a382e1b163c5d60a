"""The group-wise int8 / int4 decode GEMV ops (csrc/gemv_cpu.cpp) and their use by the
int8-grouped and int4 methods.

Oracles: F.linear in float64 with the dequantized weight (q * scale, (q - 8) * scale + zero,
computed independently of the kernels' tile layouts); the kernel's products are those exact
values in float32, so the only error is float32 summation (fp32 x) or one bf16 rounding of the
output (bf16 x). The engine with the kernel (decode steps) against the same engine with
PAGEDSERVE_GEMV=off (the torch path at every batch size): greedy tokens equal, sampled-token
logprobs within float32 noise.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemv_cases import BF16_ULP, BareLinear, gen, group_for, weights, with_op_cases
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.quantization import gemv
from pagedserve.quantization.int4 import Int4LinearMethod, dequantize_int4, quantize_int4
from pagedserve.quantization.int8_grouped import (
    Int8GroupedLinearMethod,
    dequantize_int8_grouped,
    quantize_int8_grouped,
)

pytestmark = pytest.mark.skipif(gemv.gemv_ops() is None, reason="GEMV kernel unavailable (no AVX2/FMA or no compiler)")


def _check(got: torch.Tensor, x: torch.Tensor, dq: torch.Tensor, bias: torch.Tensor | None) -> None:
    want = F.linear(x.double(), dq.double(), None if bias is None else bias.double())
    assert got.dtype == x.dtype and got.shape == want.shape
    magnitude = F.linear(x.double().abs(), dq.double().abs()) + (0 if bias is None else bias.double().abs())
    if x.dtype == torch.float32:
        bound = 1e-5 * magnitude
    else:  # float32 sums of exact products, rounded once to bf16
        bound = want.abs() * BF16_ULP + 1e-5 * magnitude
    assert ((got.double() - want).abs() <= bound + 1e-6).all()


def test_channel_tiles_round_trip_and_layout() -> None:
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=gen(0))
    scale = torch.rand(32, 2, generator=gen(1)).half()
    tiles, scales = gemv.pack_int8_grouped(q, scale)
    assert tiles.shape == (2, 64, 16) and scales.shape == (2, 2, 16)
    assert tiles[1, 40, 3] == q[16 + 3, 40] and scales[1, 1, 3] == scale[19, 1]
    back_q, back_scale = gemv.unpack_int8_grouped(tiles, scales)
    assert torch.equal(back_q, q) and torch.equal(back_scale, scale)
    q4 = torch.randint(0, 16, (32, 64), dtype=torch.uint8, generator=gen(2))
    s4, z4 = torch.rand(2, 32, generator=gen(3)).bfloat16(), torch.randn(2, 32, generator=gen(4)).bfloat16()
    tiles4, sz = gemv.pack_int4_grouped(q4, s4, z4)
    assert tiles4.shape == (2, 64, 8) and sz.shape == (2, 2, 2, 16)
    assert tiles4[1, 40, 3] == q4[19, 40] | (q4[27, 40] << 4)
    assert sz[1, 1, 0, 3] == s4[1, 19] and sz[1, 1, 1, 3] == z4[1, 19]
    back = gemv.unpack_int4_grouped(tiles4, sz)
    assert all(torch.equal(a, b) for a, b in zip(back, (q4, s4, z4), strict=True))


@with_op_cases
def test_int8_grouped_op_equals_dequantized_reference(
    x_dtype: torch.dtype, rows: int, shape: tuple[int, int], with_bias: bool
) -> None:
    (n, k), group = shape, group_for(shape)
    q, scale = quantize_int8_grouped(weights(n, k, rows + n), group)
    x = torch.randn(rows, k, generator=gen(rows)).to(x_dtype)
    bias = torch.randn(n, generator=gen(7)) if with_bias else None
    got = gemv.int8_grouped(x, *gemv.pack_int8_grouped(q, scale), bias)
    _check(got, x, dequantize_int8_grouped(q, scale), bias)


@with_op_cases
def test_int4_grouped_op_equals_dequantized_reference(
    x_dtype: torch.dtype, rows: int, shape: tuple[int, int], with_bias: bool
) -> None:
    (n, k), group = shape, group_for(shape)
    q, scale, zero = quantize_int4(weights(n, k, rows + n), group)
    x = torch.randn(rows, k, generator=gen(rows)).to(x_dtype)
    bias = torch.randn(n, generator=gen(7)) if with_bias else None
    got = gemv.int4_grouped(x, *gemv.pack_int4_grouped(q, scale, zero), bias)
    _check(got, x, dequantize_int4(q, scale, zero, group), bias)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_int4_op_takes_ggufs_float16_d_and_m(rows: int) -> None:
    """float16 parameters mean GGUF's W = q * d + m (Q4_1 as stored), not (q - 8) * s + z."""
    n, k = 48, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen(rows))
    d = (torch.rand(k // 32, n, generator=gen(1)) * 0.01).half()
    m = (torch.randn(k // 32, n, generator=gen(2)) * 0.05).half()
    x = torch.randn(rows, k, generator=gen(3))
    dq = q.float() * d.float().t().repeat_interleave(32, 1) + m.float().t().repeat_interleave(32, 1)
    _check(gemv.int4_grouped(x, *gemv.pack_int4_grouped(q, d, m), None), x, dq, None)
    with pytest.raises(ValueError, match="both"):
        gemv.pack_int4_grouped(q, d, m.bfloat16())


def test_grouped_ops_refuse_bad_input() -> None:
    tiles, scales = gemv.pack_int8_grouped(*quantize_int8_grouped(torch.randn(16, 64), 32))
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        gemv.int8_grouped(torch.randn(33, 64), tiles, scales, None)
    with pytest.raises(RuntimeError, match="channel tiles"):
        gemv.int8_grouped(torch.randn(1, 32), tiles, scales, None)
    with pytest.raises(RuntimeError, match="float16"):
        gemv.int8_grouped(torch.randn(1, 64), tiles, scales.float(), None)
    tiles4, sz = gemv.pack_int4_grouped(*quantize_int4(torch.randn(16, 64), 32))
    with pytest.raises(RuntimeError, match="bias"):
        gemv.int4_grouped(torch.randn(1, 64), tiles4, sz, torch.randn(15))
    with pytest.raises(RuntimeError, match="multiple of 32"):  # 64 columns in 4 groups of 16
        gemv.int4_grouped(torch.randn(1, 64), tiles4, torch.zeros(1, 4, 2, 16, dtype=torch.bfloat16), None)


@pytest.mark.parametrize("method_name", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 32, 33, 100, 128, 129])
def test_methods_keep_one_tiled_copy_and_match_the_reference(method_name: str, rows: int, monkeypatch) -> None:
    """<= 32 rows (gemv.MAX_ROWS): one kernel call; up to gemv.CHUNKED_MAX_ROWS: the kernel
    32 rows a call; more: the GEMM on weights dequantized from the tiles. The layer holds only the tiles (no second copy); with
    PAGEDSERVE_GEMV=off the same method keeps the untiled layout and gives the same values."""
    w, bias = weights(96, 256, 0), torch.randn(96, generator=gen(1))
    layer = BareLinear(w, bias)
    method = Int8GroupedLinearMethod(32) if method_name == "int8" else Int4LinearMethod(32)
    method.process_weights_after_loading(layer)
    buffers = {name for name, _ in layer.named_buffers()}
    assert buffers == ({"qweight_tiles", "scale_tiles"} if method_name == "int8" else {"qweight_tiles", "scales_zeros_tiles"})
    if method_name == "int8":
        q, scale = quantize_int8_grouped(w, 32)
        dq = dequantize_int8_grouped(q, scale)
        assert method.weight_bytes(layer) == 96 * 256 + 96 * 8 * 2
    else:
        q, scale, zero = quantize_int4(w, 32)
        dq = dequantize_int4(q, scale, zero, 32)
        assert method.weight_bytes(layer) == 96 * 128 + 96 * 8 * 2 * 2
    assert torch.equal(method.dequantized_weight(layer), dq)
    x = torch.randn(rows, 256, generator=gen(rows))
    got = method.apply(layer, x)
    _check(got, x, dq, bias)
    if rows <= gemv.CHUNKED_MAX_ROWS:  # the kernel itself gave it, 32 rows a call
        tensors = method.weight_tensors(layer)
        op = gemv.int8_grouped if method_name == "int8" else gemv.int4_grouped
        want = torch.cat([op(part, *tensors, bias) for part in x.split(gemv.MAX_ROWS)])
        assert torch.equal(got, want)
    monkeypatch.setenv("PAGEDSERVE_GEMV", "off")
    off = BareLinear(w, bias)
    method.process_weights_after_loading(off)
    assert not hasattr(off, "qweight_tiles")


@pytest.mark.parametrize("method_name", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_keep_their_output_dtype(method_name: str, dtype: torch.dtype) -> None:
    """bf16 x goes through the kernel; float16 x (which it does not take) through the torch
    path on the same tiles."""
    layer = BareLinear(weights(64, 128, 2).to(dtype), torch.randn(64).to(dtype))
    method = Int8GroupedLinearMethod(32) if method_name == "int8" else Int4LinearMethod(32)
    method.process_weights_after_loading(layer)
    assert hasattr(layer, "qweight_tiles")
    for rows in (1, 12, 40):
        x = torch.randn(rows, 128, generator=gen(rows)).to(dtype)
        got = method.apply(layer, x)
        assert got.dtype == dtype and got.shape == (rows, 64)
        want = F.linear(x.float(), method.dequantized_weight(layer), layer.bias.float())
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    assert method.apply(layer, torch.randn(3, 2, 128).to(dtype)).shape == (3, 2, 64)


def _engine_run(path: str, quantization: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    extra = {"quantization_activations": "none"} if quantization == "int8" else {}  # weight-only kernel
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
              quantization=quantization, seed=0, **extra)
    params = SamplingParams(temperature=0, max_tokens=16, min_tokens=16, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids,
         [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)])
        for o in outs
    ]


def test_engine_int8_kernel_on_equals_off(model_path, monkeypatch) -> None:
    """Decode steps (3 sequences: <= 8 rows) through the kernel vs the torch path: the same
    weights and float32 products, so greedy tokens are equal and logprobs within float noise."""
    path = model_path("llama-gqa")
    prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(3)]
    on = _engine_run(path, "int8", prompts)
    monkeypatch.setenv("PAGEDSERVE_GEMV", "off")
    off = _engine_run(path, "int8", prompts)
    for (tokens_on, lp_on), (tokens_off, lp_off) in zip(on, off, strict=True):
        assert tokens_on == tokens_off
        assert max(abs(a - b) for a, b in zip(lp_on, lp_off, strict=True)) < 1e-4


def test_engine_int4_kernel_equals_transformers_on_dequantized_weights(model_path) -> None:
    """Prompts of at most 32 tokens, so prefill and decode both run through the kernel (float32
    x): the engine equals transformers (fp32) with every linear weight replaced by its int4
    round trip, token for token, and its logprobs within float noise."""
    from transformers import AutoModelForCausalLM

    path = model_path("llama-gqa")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                q, scale, zero = quantize_int4(module.weight, 32)
                module.weight.copy_(dequantize_int4(q, scale, zero, 32))
    prompts = [list(range(3 + i, 20 + 6 * i)) for i in range(3)]  # 17, 23, 29 tokens
    for prompt, (tokens, logprobs) in zip(prompts, _engine_run(path, "int4", prompts), strict=True):
        ids = torch.tensor([prompt + tokens])
        with torch.inference_mode():
            want = torch.log_softmax(reference(ids).logits[0].float(), -1)
        rows = want[len(prompt) - 1 : -1]
        assert tokens == rows.argmax(-1).tolist()
        got_lp = torch.tensor(logprobs)
        assert (got_lp - rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]).abs().max() < 1e-4
