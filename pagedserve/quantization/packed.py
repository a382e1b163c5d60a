"""Full-precision weights prepacked for oneDNN's CPU GEMM (no quantization).

Why: torch's `F.linear` on CPU goes to MKL's sgemm, which is slow for the skinny batches a
decode step makes. On this machine (2-core Zen 4), for (M tokens x 768) @ (768 x N):

    M = 8 / 32 / 64       MKL F.linear   oneDNN, weight prepacked once
    N = 4096 (gate_up)    65 / 128 / 150  185 / 198 / 202 GFLOP/s
    N = 32000 (LM head)   28 /  80 / 109  110 / 194 / 207 GFLOP/s

(`python benchmarks/linear_micro.py` re-measures it.) The weight is reordered once at load
time into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the same
route inductor takes when it freezes a CPU model), and every call is a single
`_linear_pointwise`. The arithmetic is still IEEE fp32 (or bf16): only the summation order
differs from MKL's, so results agree with transformers to float rounding.

Layer tensors after `process_weights_after_loading`:
    packed_weight  opaque oneDNN tensor, (out, in) logically; `.to_dense()` gives W back
The dense `weight` parameter is deleted, so the packed copy costs no extra memory (a tied
LM head packs its own copy; the embedding keeps the table it looks rows up in).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pagedserve.quantization.base import LinearMethod

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks its blocking from an expected batch; measured flat from 16 to 256 rows here.
_EXPECTED_ROWS = 64


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its prepacked linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


@functools.cache
def _bf16_packable() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinearMethod(LinearMethod):
    """x W^T + b with W held in oneDNN's blocked layout; CPU, float32 / bfloat16 only."""

    name = "onednn-packed"

    def supports(self, layer: nn.Module) -> bool:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.device.type != "cpu" or weight.dtype not in PACKABLE_DTYPES:
            return False
        # oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or AVX-NE-CONVERT; without them a bf16
        # layer stays on F.linear.
        return weight.dtype != torch.bfloat16 or _bf16_packable()

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dense = layer.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, _EXPECTED_ROWS)
        del layer.weight
        # An opaque tensor cannot be a parameter or buffer (no storage); `weight_tensors`
        # reports it so resident-memory accounting still sees it.
        layer.packed_weight = packed

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        return [layer.packed_weight]

    def weight_bytes(self, layer: nn.Module) -> int:
        return layer.packed_weight.numel() * layer.packed_weight.element_size()

    def add_to_weight(self, layer: nn.Module, delta: torch.Tensor) -> None:
        dense = layer.packed_weight.to_dense()
        dense += delta.to(dense.dtype)
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(dense, _EXPECTED_ROWS)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, layer.packed_weight, getattr(layer, "bias", None), "none", [], ""
        )


PACKED = PackedLinearMethod()
