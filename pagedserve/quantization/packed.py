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
    gemv_weight    W as pair tiles for the decode GEMV kernel (quantization/gemv.py), used
                   for calls of at most gemv.MAX_ROWS (32) rows, where oneDNN reads the weight at a fraction
                   of the memory bandwidth; absent with PAGEDSERVE_GEMV=off or odd shapes
    weight         only where oneDNN cannot pack the dtype (bfloat16 without AVX512-BW /
                   AVX-NE-CONVERT): the dense weight; up to gemv.CHUNKED_MAX_ROWS rows the
                   GEMV kernel runs 32 rows at a time, larger batches widen it to float32 per
                   call for F.linear (no bf16 GEMM instructions there)
The dense `weight` parameter is otherwise deleted, so the oneDNN copy costs no extra memory
(a tied LM head packs its own copy; the embedding keeps the table it looks rows up in); the
GEMV copy is one more copy of the weights, the price of decode speed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quantization import gemv
from pagedserve.quantization.base import LinearCall, LinearMethod, linear_call

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks its blocking from an expected batch; measured flat from 16 to 256 rows here.
_EXPECTED_ROWS = 64
# The buffer of the GEMV kernel's pair tiles (gemv.pack_tiles); MoE stacks it over experts.
GEMV_TILES = "gemv_weight"


def onednn_available() -> bool:
    """Whether this torch build has oneDNN and its prepacked linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


@functools.cache
def _onednn_bf16_supported() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a weight of `dtype` on this CPU (bf16 needs AVX512-BW or
    AVX-NE-CONVERT; the reorder raises without)."""
    if dtype == torch.bfloat16:
        return onednn_available() and _onednn_bf16_supported()
    return dtype == torch.float32 and onednn_available()


class PackedLinearMethod(LinearMethod):
    """x W^T + b with W held in oneDNN's blocked layout; CPU, float32 / bfloat16 only."""

    name = "onednn-packed"

    def supports(self, layer: nn.Module) -> bool:
        weight = getattr(layer, "weight", None)
        # oneDNN's bf16 reorder refuses CPUs without AVX512BW/VL/DQ or AVX-NE-CONVERT; those
        # keep F.linear (and the GEMV for decode rows) rather than failing at load.
        return (
            weight is not None
            and weight.device.type == "cpu"
            and weight.dtype in PACKABLE_DTYPES
            and (onednn_packs(weight.dtype) or gemv.takes(weight))
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        dense = layer.weight.detach()
        if gemv.takes(dense):
            layer.register_buffer(GEMV_TILES, gemv.pack_tiles(dense), persistent=False)
        if not onednn_packs(dense.dtype):
            return  # keeps `weight` for F.linear
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, _EXPECTED_ROWS)
        del layer.weight
        # An opaque tensor cannot be a parameter or buffer (no storage); `weight_tensors`
        # reports it so resident-memory accounting still sees it.
        layer.packed_weight = packed

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        names = ("packed_weight", "weight", GEMV_TILES)
        return [getattr(layer, n) for n in names if getattr(layer, n, None) is not None]

    def weight_bytes(self, layer: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in self.weight_tensors(layer))

    def add_to_weight(self, layer: nn.Module, delta: torch.Tensor) -> None:
        if hasattr(layer, "packed_weight"):
            dense = layer.packed_weight.to_dense()
            dense += delta.to(dense.dtype)
            layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(dense, _EXPECTED_ROWS)
        else:
            layer.weight.data += delta.to(layer.weight.dtype)
            dense = layer.weight.detach()
        if hasattr(layer, GEMV_TILES):
            setattr(layer, GEMV_TILES, gemv.pack_tiles(dense))

    def decode_op(self, layer: nn.Module) -> LinearCall | None:
        tiles = getattr(layer, GEMV_TILES, None)
        return None if tiles is None else linear_call("gemv_dense", tiles, bias=getattr(layer, "bias", None))

    def decode_max_rows(self, layer: nn.Module) -> int:
        # bf16 without oneDNN's bf16 GEMM: the kernel in chunks beats widening the weight.
        if hasattr(layer, GEMV_TILES) and not hasattr(layer, "packed_weight") and \
                layer.weight.dtype == torch.bfloat16:
            return gemv.CHUNKED_MAX_ROWS
        return gemv.MAX_ROWS

    def gemm_op(self, layer: nn.Module) -> LinearCall | None:
        bias, packed = getattr(layer, "bias", None), getattr(layer, "packed_weight", None)
        if packed is not None:
            return linear_call("mkldnn_linear", packed, bias=bias)
        if layer.weight.dtype == torch.bfloat16:
            return linear_call("linear_widened", layer.weight, bias=bias)
        return linear_call("linear", layer.weight, bias=bias)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(layer, "bias", None)
        tiles = getattr(layer, GEMV_TILES, None)
        if tiles is not None:
            rows = gemv.rows_of(x)
            if rows <= gemv.MAX_ROWS:
                return gemv.dense(x, tiles, bias)
            if rows <= self.decode_max_rows(layer):
                return gemv.in_chunks(gemv.dense, x, tiles, bias)
        packed = getattr(layer, "packed_weight", None)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        if layer.weight.dtype == torch.bfloat16:
            # No oneDNN bf16 GEMM on this CPU (AVX2): torch's bf16 F.linear ran a 512-token
            # SmolLM2 prefill at 88 tok/s. The float32 GEMM on the widened weight (exact) is
            # 6x faster; the widening is one pass over the weight, small beside > 32 rows of GEMM.
            b = None if bias is None else bias.float()
            return F.linear(x.float(), layer.weight.float(), b).to(x.dtype)
        return F.linear(x, layer.weight, bias)


PACKED = PackedLinearMethod()
