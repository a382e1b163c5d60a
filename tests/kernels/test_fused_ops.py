"""The C++ fused elementwise ops equal the torch code they replace (the layers' fallback).

Same formula, same dtype steps: float32 results agree to float rounding (sums of squares and
exp are evaluated in another order / polynomial), bfloat16 results to one bf16 unit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.models.layers import fused_ops
from pagedserve.models.layers.activation import SiluAndMul
from pagedserve.models.layers.layernorm import RMSNorm
from pagedserve.models.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(not fused_ops.available(), reason="C++ fused ops did not build here")

TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=2**-7, atol=2**-7)}


def _with_torch(monkeypatch, fn):
    """fn() run with PAGEDSERVE_FUSED_OPS=torch: layers it builds keep the torch code."""
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "torch")
    try:
        return fn()
    finally:
        monkeypatch.delenv("PAGEDSERVE_FUSED_OPS")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_residual_add(monkeypatch, dtype, rows) -> None:
    g = torch.Generator().manual_seed(rows)
    norm = RMSNorm(200, eps=1e-5).to(dtype)
    reference = _with_torch(monkeypatch, lambda: RMSNorm(200, eps=1e-5).to(dtype))
    norm.weight.data = reference.weight.data = torch.randn(200, generator=g).to(dtype)
    x = (torch.randn(rows, 200, generator=g) * 3).to(dtype)
    residual = torch.randn(rows, 200, generator=g).to(dtype)
    assert fused_ops.for_tensor(norm.fused, x) is not None and reference.fused is None
    got, got_sum = norm(x, residual)
    want, want_sum = reference(x, residual)
    assert torch.equal(got_sum, want_sum)  # one rounded add either way
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(norm(x), reference(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(monkeypatch, dtype) -> None:
    # 100 columns a half: 12 vectors of 8 and a scalar tail of 4.
    x = (torch.randn(33, 2 * 100, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # clamped exp range, zero
    got = SiluAndMul()(x)
    want = _with_torch(monkeypatch, SiluAndMul)(x)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(got.float(), (F.silu(x[:, :100].double()) * x[:, 100:].double()).float(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    if dtype == torch.bfloat16:  # rounded to bf16 where torch rounds (silu, then the product):
        # only the exp's last bits differ, so few elements at most one bf16 step apart (without
        # the rounding of silu's result about a quarter of them differ)
        step = torch.ldexp(torch.ones_like(want.float()), torch.frexp(want.float()).exponent - 8)
        assert ((got.float() - want.float()).abs() <= step).all()
        assert (got != want).float().mean() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_on_a_strided_view(monkeypatch, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(9, 6 * 64, generator=g).to(dtype)
    qk = qkv[:, : 4 * 64].view(9, 4, 64)  # q and k heads of a fused qkv row: row-strided
    angles = torch.randn(9, 32, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = apply_rotary(qk, cos, sin, fused_ops.resolve())
    want = apply_rotary(qk, cos, sin, None)
    assert got.is_contiguous() and got.shape == (9, 4, 64)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_env_forces_torch_and_rejects_bad_values(monkeypatch) -> None:
    x = torch.randn(2, 8)
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "torch")
    assert fused_ops.resolve() is None and RMSNorm(8).fused is None and SiluAndMul().fused is None
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "fast")
    with pytest.raises(ValueError, match="PAGEDSERVE_FUSED_OPS"):
        RMSNorm(8)
    monkeypatch.delenv("PAGEDSERVE_FUSED_OPS")
    ops = fused_ops.resolve()
    assert fused_ops.for_tensor(ops, x) is ops
    assert fused_ops.for_tensor(ops, x.double()) is None  # float32 / bfloat16 only
    with torch.device("meta"):  # a layer built for another device never takes the CPU ops
        assert RMSNorm(8).fused is None


def test_choice_is_made_when_the_layer_is_built(monkeypatch) -> None:
    """The environment is read when the model is built, not on every call."""
    x = torch.randn(3, 8)
    norm = RMSNorm(8)
    monkeypatch.setenv("PAGEDSERVE_FUSED_OPS", "fast")  # a bad value, read by nothing now
    assert torch.equal(norm(x), norm(x)) and norm.fused is not None


def test_engine_holds_the_ops_before_its_first_request(model_path) -> None:
    """The kernel is built / loaded while the engine is constructed (before a server reports
    ready), never on the first request: every fusing layer already holds the ops."""
    from pagedserve import LLM
    from pagedserve.models.llama import LlamaAttention

    llm = LLM(model_path("llama-gqa"), dtype="float32", max_model_len=64)
    layers = [m for m in llm.llm_engine.runner.model.modules()
              if isinstance(m, RMSNorm | SiluAndMul | LlamaAttention)]
    assert layers and all(m.fused is not None for m in layers)
