"""Weight-only int8: symmetric, one float32 scale per output channel.

    W (out, in) float  ->  q (out, in) int8 in [-127, 127],  scale (out,) float32
    W ~= q * scale[:, None]

Arithmetic of `apply`, the same on every path, so the batch size never changes the numerics
beyond float summation order:

    y = float(bf16( bf16(x) @ q^T )) * scale  (+ bias)

The activations go to bfloat16 because bf16 pairs are what the fast CPU instructions
multiply; int8 values are exact in bfloat16, the products are summed in float32 and the sum
is rounded to bfloat16 once. The scale is applied afterwards in float32.

Paths (the first that applies):
  * "cpp": csrc/int8_linear_cpu.cpp on CPUs with AVX512-BF16, when out % 16 == 0 and
    in % 2 == 0. The weight is stored tiled for `vdpbf16ps` (`qweight_packed`, same bytes as
    q); each block of rows converts it int8 -> bf16 once in cache. On this 2-core Zen 4 it
    runs 768x4096 at 64 / 346 / 412 GFLOP/s for 1 / 16 / 64 rows, where oneDNN's prepacked
    fp32 GEMM gives ~25 / 185 / 202: memory-bound decode reads a quarter of the fp32 bytes,
    and compute-bound prefill does two multiply-adds per lane per instruction.
  * "torch" (no such CPU, odd shapes, other devices): rows <= kernel_max_rows (16) go to
    `aten._weight_int8pack_mm`, more rows to the exact int8 -> bf16 conversion and a bf16
    GEMM (at 16 rows the former ran 133 GFLOP/s vs 79, at 32 rows 133 vs 195).
  * "gemv" (no AVX512-BF16, but the AVX2 decode GEMV kernel of quantization/gemv.py runs):
    the same pair tiles as "cpp"; rows <= kernel_max_rows (16) through the GEMV kernel in one
    call (the weight streamed at memory speed, 1.5-2x `_weight_int8pack_mm` at 1-8 rows),
    more rows through the bf16 GEMM on tiles unpacked and converted chunk by chunk.
`benchmarks/quantization.py --kernels` compares all of them; `benchmarks/gemv_micro.py` the
GEMV kernel against the others at decode sizes. On the "cpp" path one-row calls go to the
GEMV kernel too (a one-row product is bound by memory, not by the multiply-adds).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve import cpp_build
from pagedserve.quantization import gemv as gemv_kernel
from pagedserve.quantization.base import LinearMethod, add_bias

logger = logging.getLogger(__name__)

COMPUTE_DTYPE = torch.bfloat16
TILE = 16  # output channels per tile of `qweight_packed` (kTile in the C++ source)


@functools.lru_cache(maxsize=1)  # a no-argument cache: ~50 ns on the per-layer hot path
def cpp_ops() -> Any:
    """The C++ int8 ops, or None when they cannot run here (no compiler, no AVX512-BF16)."""
    return cpp_build.load(cpp_build.INT8).ops


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) -> (qweight int8 (out, in), scale float32 (out,)), W ~= q * scale."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    # An all-zero row keeps scale 0 and q 0; dividing by `tiny` instead of 0 avoids NaN.
    q = torch.round(w / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None])
    return q.clamp_(-127, 127).to(torch.int8), scale


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(out, in) float32 weight the int8 layer represents."""
    return qweight.float() * scale[:, None]


def pack_for_cpp(q: torch.Tensor) -> torch.Tensor:
    """(out, in) int8 -> (out/16, in/2, 16, 2): tiles of 16 channels, k-pair by k-pair."""
    out_features, in_features = q.shape
    return q.view(out_features // TILE, TILE, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_from_cpp(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_for_cpp`."""
    tiles, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(tiles * TILE, pairs * 2)


class Int8LinearMethod(LinearMethod):
    """Per-output-channel int8 weights, quantized at load time; see the module docstring.

    Args:
        kernel_max_rows: "torch" / "gemv" paths: most rows sent to `_weight_int8pack_mm` /
            the GEMV kernel.
        kernel: "auto" (the C++ kernels where they run), or force "torch".
        gemv: use the decode GEMV kernel where it runs ("gemv" path, one-row "cpp" calls).

    Layer tensors after `process_weights_after_loading`:
        qweight_packed  (out/16, in/2, 16, 2) int8   ("cpp" and "gemv" paths), or
        qweight         (out, in) int8 + _kernel_ones ("torch" path)
        weight_scale    (out,) float32
    """

    name = "int8"

    def __init__(
        self, kernel_max_rows: int = 16, kernel: Literal["auto", "torch"] = "auto", gemv: bool = True
    ) -> None:
        if kernel not in ("auto", "torch"):
            raise ValueError(f"kernel must be 'auto' or 'torch', got {kernel!r}")
        self.kernel_max_rows = kernel_max_rows
        self.kernel = kernel
        self.gemv = gemv

    def _path(self, weight: torch.Tensor) -> Literal["cpp", "gemv", "torch"]:
        out_features, in_features = weight.shape
        if not (
            self.kernel == "auto"
            and weight.device.type == "cpu"
            and out_features % TILE == 0
            and in_features % 2 == 0
        ):
            return "torch"
        if cpp_ops() is not None:
            return "cpp"
        return "gemv" if self.gemv and gemv_kernel.takes(weight) else "torch"

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scale = quantize_int8(layer.weight)
        path = self._path(layer.weight)
        del layer.weight
        layer.register_buffer("weight_scale", scale)
        layer.int8_path = path
        if path != "torch":
            layer.register_buffer("qweight_packed", pack_for_cpp(qweight))
            layer.gemv_one_row = path == "gemv" or (self.gemv and gemv_kernel.takes(qweight))
            return
        layer.register_buffer("qweight", qweight)
        # torch's kernel multiplies by a per-channel scale in the activation dtype; ones keep
        # its output the raw integer dot product, scaled afterwards in float32.
        layer.register_buffer(
            "_kernel_ones",
            torch.ones(qweight.shape[0], dtype=COMPUTE_DTYPE, device=qweight.device),
            persistent=False,
        )

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        if hasattr(layer, "qweight_packed"):
            return [layer.qweight_packed, layer.weight_scale]
        return [layer.qweight, layer.weight_scale, layer._kernel_ones]

    def int_weight(self, layer: nn.Module) -> torch.Tensor:
        """The (out, in) int8 weight, whichever layout the layer keeps (a copy if packed)."""
        if hasattr(layer, "qweight_packed"):
            return unpack_from_cpp(layer.qweight_packed)
        return layer.qweight

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        path, rows = getattr(layer, "int8_path", "torch"), x2.shape[0]
        bias = getattr(layer, "bias", None)
        bias32 = None if bias is None else bias.float()
        if (rows == 1 and getattr(layer, "gemv_one_row", False)) or (
            path == "gemv" and rows <= self.kernel_max_rows
        ):
            if rows <= gemv_kernel.MAX_ROWS:  # a decode step: one op, x as it is
                y = gemv_kernel.int8(x, layer.qweight_packed, layer.weight_scale, bias32)
                return y if y.dtype == x.dtype else y.to(x.dtype)
            parts = [gemv_kernel.int8(c, layer.qweight_packed, layer.weight_scale, bias32)
                     for c in x2.split(gemv_kernel.MAX_ROWS)]
            return torch.cat(parts).to(x.dtype).reshape(*x.shape[:-1], -1)
        x2 = x2.to(COMPUTE_DTYPE).contiguous()
        if path == "cpp":
            y = cpp_ops().int8_linear(x2, layer.qweight_packed, layer.weight_scale, bias32)
        else:
            y = add_bias(self._torch_acc(layer, x2) * layer.weight_scale, layer)
        return y.to(x.dtype).reshape(*x.shape[:-1], y.shape[-1])

    def _torch_acc(self, layer: nn.Module, x2: torch.Tensor) -> torch.Tensor:
        """bf16(x2 @ q^T) with torch's ops."""
        packed = getattr(layer, "qweight_packed", None)
        if packed is not None:  # "gemv" path, many rows: 16-channel tiles unpacked per chunk
            step = max(1, (1 << 21) // (packed.shape[1] * 2 * TILE))
            parts = [F.linear(x2, unpack_from_cpp(t).to(COMPUTE_DTYPE)) for t in packed.split(step)]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        qweight = layer.qweight
        if x2.shape[0] <= self.kernel_max_rows and x2.device.type == "cpu":
            return torch.ops.aten._weight_int8pack_mm(x2, qweight, layer._kernel_ones)
        # int8 -> bf16 is exact; converted in ~4 MiB chunks of output rows (cache-sized,
        # recycled by the allocator rather than page-faulted on every call).
        step = max(1, (1 << 21) // qweight.shape[1])
        parts = [F.linear(x2, w.to(COMPUTE_DTYPE)) for w in qweight.split(step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
