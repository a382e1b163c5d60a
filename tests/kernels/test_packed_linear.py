"""The default CPU linear path: oneDNN with weights prepacked at load (quantization/packed.py).

It must be the same arithmetic as F.linear up to float summation order, hold no extra copy
of the weights but the decode GEMV kernel's (none with PAGEDSERVE_GEMV=off), and be
switchable off with PAGEDSERVE_CPU_GEMM=torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.layers.embedding import LMHead
from pagedserve.models.layers.linear import LinearBase, ReplicatedLinear
from pagedserve.models.loader import load_model, weight_bytes
from pagedserve.quantization import gemv
from pagedserve.quantization.packed import PACKED, onednn_available, onednn_packs

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# <= 32: the GEMV kernel; 33-128 bf16 without oneDNN's bf16 GEMM: the kernel 32 rows at a time
@pytest.mark.parametrize("rows", [0, 1, 7, 8, 9, 33, 64, 128, 129, 300])
def test_packed_layer_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    if dtype == torch.bfloat16 and not PACKED.supports(ReplicatedLinear(32, 32).to(dtype)):
        pytest.skip("oneDNN's bf16 reorder needs AVX512BW/VL/DQ or AVX-NE-CONVERT")
    torch.manual_seed(rows)
    layer = ReplicatedLinear(96, 80, bias=True)
    layer.set_quant_method(PACKED)
    weight, bias = torch.randn(80, 96).to(dtype), torch.randn(80).to(dtype)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    layer.bias = nn.Parameter(bias.clone(), requires_grad=False)
    PACKED.process_weights_after_loading(layer)
    if onednn_packs(dtype):
        assert not hasattr(layer, "weight")
        assert torch.equal(layer.packed_weight.to_dense(), weight)
    else:  # bf16 oneDNN cannot pack here: F.linear beyond the GEMV's rows
        assert torch.equal(layer.weight, weight)
    if gemv.gemv_ops() is not None:
        assert torch.equal(gemv.unpack_tiles(layer.gemv_weight), weight)
    x = torch.randn(rows, 96).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=tol, atol=tol)
    # Merging a delta (an adapter) repacks W + delta.
    delta = torch.randn(80, 96).to(dtype)
    PACKED.add_to_weight(layer, delta)
    torch.testing.assert_close(layer(x), F.linear(x, weight + delta, bias), rtol=tol, atol=tol)


def test_bf16_without_onednn_runs_the_kernel_in_chunks_up_to_its_limit() -> None:
    """Where oneDNN has no bf16 GEMM, 33-128 rows run the GEMV kernel 32 rows a call (no
    widening of the weight), more rows the float32 GEMM on the widened weight. (The two paths
    round to the same bf16 values nearly always; the choice is a matter of speed, measured by
    benchmarks/gemv_rows.py, so this checks the split and the results at the limits.)"""
    if onednn_packs(torch.bfloat16) or gemv.gemv_ops() is None:
        pytest.skip("oneDNN packs bf16 here, or the GEMV kernel is off")
    torch.manual_seed(0)
    k, n = 1024, 80
    layer = ReplicatedLinear(k, n, bias=True)
    layer.set_quant_method(PACKED)
    weight, bias = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
    layer.bias = nn.Parameter(bias.clone(), requires_grad=False)
    PACKED.process_weights_after_loading(layer)
    assert PACKED.decode_max_rows(layer) == gemv.CHUNKED_MAX_ROWS
    for rows in (gemv.MAX_ROWS + 1, 70, gemv.CHUNKED_MAX_ROWS, gemv.CHUNKED_MAX_ROWS + 1):
        x = torch.randn(rows, k).to(torch.bfloat16)
        chunked = torch.cat([gemv.dense(p, layer.gemv_weight, bias) for p in x.split(gemv.MAX_ROWS)])
        widened = F.linear(x.float(), weight.float(), bias.float()).to(torch.bfloat16)
        expected = chunked if rows <= gemv.CHUNKED_MAX_ROWS else widened
        assert torch.equal(layer(x), expected), rows
        assert torch.equal(layer(x.view(1, rows, k)), expected.view(1, rows, n)), rows


def test_loader_packs_every_linear_and_the_head_without_growing(model_path, monkeypatch) -> None:
    path = model_path("llama-gqa")
    monkeypatch.setenv("PAGEDSERVE_GEMV", "off")
    packed, _ = load_model(path, torch.float32, torch.device("cpu"))
    assert not any(hasattr(m, "gemv_weight") for m in packed.modules())
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "torch")
    plain, _ = load_model(path, torch.float32, torch.device("cpu"))
    layers = [m for m in packed.modules() if isinstance(m, LinearBase | LMHead)]
    assert layers and all(m.quant_method is PACKED for m in layers)
    assert all(getattr(m, "quant_method", None) is not PACKED for m in plain.modules())
    assert weight_bytes(packed) == weight_bytes(plain)
    hidden = torch.randn(5, plain.config.hidden_size)
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-4)


def test_bad_cpu_gemm_value_is_named(model_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="PAGEDSERVE_CPU_GEMM"):
        load_model(model_path("llama-gqa"), torch.float32, torch.device("cpu"))
