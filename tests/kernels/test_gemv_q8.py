"""Group-wise int8 weights x int8 activations (`gemv_int8_q8`, csrc/gemv_cpu.cpp) and the
int8-grouped method with `activations="int8"`.

Oracle: the same activation rounding done in torch (`gemv.quantize_rows_q8`: absmax / 127 per
block of 32, round half to even), then each block's dot product in exact integer arithmetic
(int64) and the blocks summed in float64 with the weight and activation scales. The kernel's
block dot products are exact too (int32), so the only error allowed is float32 rounding of
the per-block scale product and of the sum (fp32 x), or one bf16 rounding of the output.
A kernel that rounded one activation differently from the oracle misses the bound by ~10x.
The engine with int8 activations equals transformers with every linear weight replaced by
its int8 round trip and every linear input (LM head excepted) by its q8 round trip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gemv_cases import BF16_ULP, BareLinear, gen, group_for, weights, with_op_cases
from torch import nn

from pagedserve import LLM, SamplingParams
from pagedserve.config import ModelConfig
from pagedserve.quantization import DEFAULT_INT8_ACTIVATIONS, QuantizationConfig, gemv
from pagedserve.quantization.int8_grouped import (
    Int8GroupedLinearMethod,
    dequantize_int8_grouped,
    quantize_int8_grouped,
)
from pagedserve.quantization.selector import (
    DEFAULT_GGUF_ACTIVATIONS,
    get_linear_method,
    gguf_activations,
)

pytestmark = pytest.mark.skipif(gemv.gemv_ops() is None, reason="GEMV kernel unavailable (no AVX2/FMA or no compiler)")


def _activations(rows: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(rows, k, generator=gen(seed))
    if rows > 1:
        x[1, :32] = 0.0  # an all-zero block: scale 0, xq 0
    if rows > 2:  # scale exactly 1 and ties at .5: round half to even (2.5 -> 2, -3.5 -> -4)
        x[2, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5] * 8)
    return x


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """(y float64, magnitude float64) from the exact integer block dot products."""
    xq, dx = gemv.quantize_rows_q8(x.float())
    m, k = x.shape
    n, groups = scale.shape
    xb = xq.view(m, k // 32, 32).long()
    qb = q.view(n, k // 32, 32).long()
    dots = torch.einsum("mbk,nbk->mnb", xb, qb).double()  # exact
    abs_dots = torch.einsum("mbk,nbk->mnb", xb.abs(), qb.abs()).double()
    sw = scale.double().repeat_interleave(k // groups // 32, dim=1)  # (n, blocks)
    factor = sw[None] * dx.double()[:, None, :]  # (m, n, blocks)
    y = (dots * factor).sum(-1)
    magnitude = (abs_dots * factor.abs()).sum(-1)
    if bias is not None:
        y, magnitude = y + bias.double(), magnitude + bias.double().abs()
    return y, magnitude


def _check(got: torch.Tensor, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    want, magnitude = _reference(x, q, scale, bias)
    assert got.dtype == x.dtype and got.shape == want.shape
    bound = 2e-6 * magnitude if x.dtype == torch.float32 else want.abs() * BF16_ULP + 2e-6 * magnitude
    assert ((got.double() - want).abs() <= bound + 1e-7).all()


def test_quad_tiles_round_trip_and_layout() -> None:
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=gen(0))
    quads = gemv.pack_int8_quads(q)
    assert quads.shape == (2, 16, 16, 4)
    assert quads[1, 10, 3, 2] == q[16 + 3, 4 * 10 + 2]
    assert torch.equal(gemv.unpack_int8_quads(quads), q)


def test_activation_rounding() -> None:
    x = _activations(3, 96, 0)
    xq, d = gemv.quantize_rows_q8(x)
    assert xq.dtype == torch.int8 and d.shape == (3, 3)
    assert xq.abs().max() == 127 and d[1, 0] == 0 and (xq[1, :32] == 0).all()
    assert xq[2, :4].tolist() == [127, 2, -4, 0]
    err = (xq.float().view(3, 3, 32) * d[..., None] - x.view(3, 3, 32)).abs()
    assert (err <= d[..., None] / 2 * (1 + 1e-6)).all()


@with_op_cases
def test_int8_q8_op_equals_integer_reference(
    x_dtype: torch.dtype, rows: int, shape: tuple[int, int], with_bias: bool
) -> None:
    (n, k), group = shape, group_for(shape)
    q, scale = quantize_int8_grouped(weights(n, k, rows + n), group)
    x = _activations(rows, k, rows).to(x_dtype)
    bias = torch.randn(n, generator=gen(7)) if with_bias else None
    _, scales = gemv.pack_int8_grouped(q, scale)
    got = gemv.int8_q8(x, gemv.pack_int8_quads(q), scales, bias)
    _check(got, x, q, scale, bias)


def test_int8_q8_op_refuses_bad_input() -> None:
    q, scale = quantize_int8_grouped(torch.randn(16, 64), 32)
    quads, scales = gemv.pack_int8_quads(q), gemv.pack_int8_grouped(q, scale)[1]
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        gemv.int8_q8(torch.randn(33, 64), quads, scales, None)
    with pytest.raises(RuntimeError, match="quad tiles"):
        gemv.int8_q8(torch.randn(1, 64), gemv.pack_int8_grouped(q, scale)[0], scales, None)
    with pytest.raises(RuntimeError, match="float16"):
        gemv.int8_q8(torch.randn(1, 64), quads, scales.float(), None)


def _q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """The oracle's own round trip (not gemv.q8_round_trip, which the GEMM path uses)."""
    flat = x.reshape(-1, x.shape[-1])
    xq, d = gemv.quantize_rows_q8(flat)
    return (xq.float().view(flat.shape[0], flat.shape[1] // 32, 32) * d[..., None]).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("rows", [1, 8, 9, 32, 33, 128, 129])
def test_method_with_int8_activations(rows: int) -> None:
    """<= 32 rows through the kernel (one call), up to gemv.CHUNKED_MAX_ROWS 32 rows a call;
    more rows: the GEMM on dequantized weights and x rounded as the kernel rounds it. The layer holds only the quad tiles."""
    w, bias = weights(96, 256, 0), torch.randn(96, generator=gen(1))
    layer = BareLinear(w, bias)
    method = Int8GroupedLinearMethod(32, activations="int8")
    method.process_weights_after_loading(layer)
    assert {name for name, _ in layer.named_buffers()} == {"qweight_quads", "scale_tiles"}
    q, scale = quantize_int8_grouped(w, 32)
    assert method.weight_bytes(layer) == 96 * 256 + 96 * 8 * 2
    assert all(torch.equal(a, b) for a, b in zip(method.int_weight(layer), (q, scale), strict=True))
    x = torch.randn(rows, 256, generator=gen(rows))
    got = method.apply(layer, x)
    if rows <= gemv.CHUNKED_MAX_ROWS:
        _check(got, x, q, scale, bias)
        tiles = method.weight_tensors(layer)
        assert torch.equal(got, torch.cat([gemv.int8_q8(p, *tiles, bias) for p in x.split(gemv.MAX_ROWS)]))
    else:
        want = F.linear(_q8_round_trip(x), dequantize_int8_grouped(q, scale), bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Without the kernel (PAGEDSERVE_GEMV=off keeps the untiled layout): the same function.
    off_layer, off = BareLinear(w, bias), Int8GroupedLinearMethod(32, gemv=False, activations="int8")
    off.process_weights_after_loading(off_layer)
    assert not hasattr(off_layer, "qweight_quads")
    _check(off.apply(off_layer, x), x, q, scale, bias)


def test_config_activations_setting() -> None:
    assert get_linear_method(QuantizationConfig("int8")).activations == DEFAULT_INT8_ACTIVATIONS
    assert get_linear_method(QuantizationConfig("int8", activations="int8")).activations == "int8"
    assert get_linear_method(QuantizationConfig("int8", activations="none")).activations == "none"
    with pytest.raises(ValueError, match="group-wise quantization='int8' and to quantization='gguf' only"):
        QuantizationConfig("int4", activations="int8")
    # a GGUF file's activations: "auto" (int8 for its bit-quad layers, llama.cpp's arithmetic), or as chosen
    assert gguf_activations(None) == gguf_activations(QuantizationConfig("gguf")) == "auto"
    assert DEFAULT_GGUF_ACTIVATIONS == "int8"
    assert gguf_activations(QuantizationConfig("gguf", activations="none")) == "none"
    with pytest.raises(ValueError, match="quantization_activations needs quantization="):
        ModelConfig("m.gguf", quantization_activations="none")
    with pytest.raises(ValueError, match="quantization_activations must be one of"):
        QuantizationConfig("int8", activations="fp8")




def test_engine_int8_activations_equal_transformers_with_the_same_rounding(model_path) -> None:
    """Prefill (the GEMM on q8-rounded x) and decode (the q8 kernel): the engine equals transformers (fp32) with int8 round-trip weights and q8 round-trip
    inputs to every linear layer but the LM head, token for token, logprobs within float noise
    (a float-order difference can move one activation across a rounding boundary)."""
    from transformers import AutoModelForCausalLM

    path = model_path("llama-gqa")
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                module.weight.copy_(dequantize_int8_grouped(*quantize_int8_grouped(module.weight, 32)))
                module.register_forward_pre_hook(lambda _m, args: (_q8_round_trip(args[0]),))
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20,
              quantization="int8", quantization_activations="int8", seed=0)
    prompts = [list(range(3 + i, 20 + 6 * i)) for i in range(3)]  # 17, 23, 29 tokens
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=0)
    # One prefill step of 69 rows (the GEMM path on rounded x), then decode steps of 3 (the kernel).
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        logprobs = torch.tensor([lp[t].logprob for t, lp in zip(tokens, out.outputs[0].logprobs, strict=True)])
        with torch.inference_mode():
            want = torch.log_softmax(reference(torch.tensor([prompt + tokens])).logits[0].float(), -1)
        rows = want[len(prompt) - 1 : -1]
        assert tokens == rows.argmax(-1).tolist()
        assert (logprobs - rows.gather(1, torch.tensor(tokens)[:, None])[:, 0]).abs().max() < 5e-3
