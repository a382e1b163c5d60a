"""The decode GEMV kernel (csrc/gemv_cpu.cpp) against dense references, and its dispatch.

  * gemv_dense equals F.linear in float64 within float32 (or one bf16 rounding) error, for
    every row count it takes, with and without a bias, K with an odd number of pairs;
  * gemv_int8 equals the int8 method's reference arithmetic (float(bf16(bf16(x) q^T)) *
    scale + bias) up to the float32 summation order;
  * the linear methods send <= 8 rows to it and more to their GEMM, and the loader's
    weights are one GEMV copy more than with PAGEDSERVE_GEMV=off, no more.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.layers.linear import LinearBase
from pagedserve.models.loader import load_model, weight_bytes
from pagedserve.quantization import gemv
from pagedserve.quantization.int8 import Int8LinearMethod, pack_for_cpp, quantize_int8

pytestmark = pytest.mark.skipif(gemv.gemv_ops() is None, reason="GEMV kernel unavailable (no AVX2/FMA or no compiler)")

BF16_ULP = 2.0**-7  # one bf16 unit in the last place, relative (worst case)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_tiles_round_trip_and_layout() -> None:
    w = torch.arange(32 * 6, dtype=torch.float32).view(32, 6)
    tiles = gemv.pack_tiles(w)
    assert tiles.shape == (2, 3, 16, 2)
    assert tiles[1, 2, 5, 1] == w[16 + 5, 2 * 2 + 1]
    assert torch.equal(gemv.unpack_tiles(tiles), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 19, 32])
@pytest.mark.parametrize("shape", [(48, 64), (96, 70), (16, 2)])  # 70: an odd number of pairs
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_equals_f_linear(dtype: torch.dtype, rows: int, shape: tuple[int, int], with_bias: bool) -> None:
    n, k = shape
    g = _gen(rows * 1000 + n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    got = gemv.dense(x, gemv.pack_tiles(w), bias)
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    if dtype == torch.float32:
        bound = 1e-5 * (x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.abs().double()))
    else:  # float32 sums rounded once to bf16
        bound = want.abs() * BF16_ULP + 1e-4 * (x.double().abs() @ w.double().abs().t())
    assert ((got.double() - want).abs() <= bound + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_keeps_nan_and_inf_rows_apart(dtype: torch.dtype) -> None:
    """A NaN / inf in one row's input makes that row NaN / inf, as F.linear does (the vector
    bf16 store keeps a NaN a NaN), and leaves the other rows alone."""
    w = torch.rand(32, 16, generator=_gen(5)).to(dtype)  # positive: the inf row stays +inf
    x = torch.rand(3, 16, generator=_gen(6)).to(dtype)
    x[0, 3], x[2, 7] = float("nan"), float("inf")
    got, want = gemv.dense(x, gemv.pack_tiles(w), None), F.linear(x.float(), w.float())
    assert torch.isnan(got[0]).all() and torch.isposinf(got[2]).all()
    torch.testing.assert_close(got[1].float(), want[1], rtol=BF16_ULP, atol=1e-5)


def test_dense_keeps_leading_dims() -> None:
    w, x = torch.randn(32, 8), torch.randn(2, 3, 8)
    got = gemv.dense(x, gemv.pack_tiles(w), None)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8, 14, 32])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_int8_equals_reference_arithmetic(rows: int, x_dtype: torch.dtype) -> None:
    g = _gen(rows)
    w, bias = torch.randn(192, 256, generator=g), torch.randn(192, generator=g)
    q, scale = quantize_int8(w)
    x = torch.randn(rows, 256, generator=g).to(x_dtype)
    got = gemv.int8(x, pack_for_cpp(q), scale, bias)
    acc = F.linear(x.bfloat16().float(), q.float()).bfloat16().float()
    want = acc * scale + bias
    assert got.dtype == torch.float32
    # Same products; the float32 summation order can flip the bf16 rounding of a sum by one unit.
    assert (((got - want).abs()) <= (want - bias).abs() * BF16_ULP + 1e-6).all()
    assert (got == want).float().mean() > 0.99


def test_python_row_limit_is_the_builds() -> None:
    assert gemv.gemv_ops().max_rows() == gemv.MAX_ROWS


def test_refuses_more_rows_and_bad_layout() -> None:
    w = gemv.pack_tiles(torch.randn(16, 8))
    with pytest.raises(RuntimeError, match="at most 32 rows"):
        gemv.dense(torch.randn(33, 8), w, None)
    with pytest.raises(RuntimeError, match="pair tiles"):
        gemv.dense(torch.randn(1, 10), w, None)


class _Linear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias


@pytest.mark.parametrize("rows", [0, 1, 8, 9, 16, 17, 40])
def test_int8_method_keeps_one_copy_and_same_arithmetic(rows: int) -> None:
    """Pair tiles only (no second copy); <= 16 rows through the GEMV in one call ("gemv"
    path), more through the bf16 GEMM on unpacked tiles: the same arithmetic everywhere."""
    w, bias = torch.randn(64, 96, generator=_gen(1)), torch.randn(64, generator=_gen(2))
    layer = _Linear(w, bias)
    method = Int8LinearMethod()
    method.process_weights_after_loading(layer)
    assert layer.int8_path in ("cpp", "gemv")
    q, scale = quantize_int8(w)
    assert torch.equal(gemv.unpack_tiles(layer.qweight_packed), q)
    assert method.weight_bytes(layer) == 64 * 96 + 64 * 4
    x = torch.randn(rows, 96, generator=_gen(3))
    want = F.linear(x.bfloat16().float(), q.float()).bfloat16().float() * scale + bias
    got = method.apply(layer, x)
    assert got.shape == (rows, 64)
    assert ((got - want).abs() <= (want - bias).abs() * BF16_ULP + 1e-6).all()
    off = _Linear(w, bias)
    Int8LinearMethod(gemv=False).process_weights_after_loading(off)
    assert off.int8_path in ("cpp", "torch") and not getattr(off, "gemv_one_row", False)


def test_loader_adds_one_gemv_copy_and_same_logits(model_path, monkeypatch) -> None:
    path = model_path("llama-gqa")
    with_gemv, _ = load_model(path, torch.float32, torch.device("cpu"))
    monkeypatch.setenv("PAGEDSERVE_GEMV", "off")
    without, _ = load_model(path, torch.float32, torch.device("cpu"))
    layers = [m for m in with_gemv.modules() if isinstance(m, LinearBase)]
    assert layers and all(hasattr(m, "gemv_weight") for m in layers)
    copies = sum(m.gemv_weight.numel() * m.gemv_weight.element_size() for m in with_gemv.modules()
                 if hasattr(m, "gemv_weight"))
    assert weight_bytes(with_gemv) == weight_bytes(without) + copies
    hidden = torch.randn(3, with_gemv.config.hidden_size, generator=_gen(4))
    torch.testing.assert_close(with_gemv.compute_logits(hidden), without.compute_logits(hidden), rtol=1e-5, atol=1e-4)
