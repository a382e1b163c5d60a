"""Weight-only int8: symmetric, one float32 scale per output channel.

    W (out, in) float  ->  qweight (out, in) int8 in [-127, 127],  scale (out,) float32
    W ~= qweight * scale[:, None]

Arithmetic of `apply` (both paths compute the same quantity, so the batch size never
changes the numerics beyond float summation order):

    y = float(bf16( bf16(x) @ qweight^T )) * scale  (+ bias)

The activations go to bfloat16 because that is the dtype of torch's fast CPU kernels
(`_weight_int8pack_mm` with float32 activations is a slow reference loop, ~10x slower);
int8 values are exact in bfloat16, the products are summed in float32 and the sum is
rounded to bfloat16 once. The scale is applied afterwards in float32, so it is never
rounded to bfloat16.

  * rows <= kernel_max_rows (16): `aten._weight_int8pack_mm`, which reads the int8 weight
    directly (half the bytes of bf16, a quarter of fp32: small batches are memory-bound).
  * more rows (prefill, big batches): the int8 -> bf16 conversion (exact), then oneDNN's
    bf16 GEMM, which is fast on AVX512-BF16 where the int8 kernel's compute is not.
The crossover (16-32 rows on this AVX512-BF16 CPU: at 16 rows the kernel runs 768x4096 at
133 GFLOP/s vs 79 for convert + GEMM; at 32 rows 133 vs 195, timing the layer's `apply`);
`benchmarks/quantization.py --kernels` compares the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.quantization.base import LinearMethod, add_bias

COMPUTE_DTYPE = torch.bfloat16


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


class Int8LinearMethod(LinearMethod):
    """Per-output-channel int8 weights, quantized at load time; see the module docstring.

    Layer tensors after `process_weights_after_loading`:
        qweight      (out, in) int8
        weight_scale (out,)    float32
    """

    name = "int8"

    def __init__(self, kernel_max_rows: int = 16) -> None:
        self.kernel_max_rows = kernel_max_rows

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scale = quantize_int8(layer.weight)
        del layer.weight
        layer.register_buffer("qweight", qweight)
        layer.register_buffer("weight_scale", scale)
        # The kernel multiplies by a per-channel scale in the activation dtype; ones keep
        # its output the raw integer dot product, scaled afterwards in float32.
        layer.register_buffer(
            "_kernel_ones",
            torch.ones(qweight.shape[0], dtype=COMPUTE_DTYPE, device=qweight.device),
            persistent=False,
        )

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        return [layer.qweight, layer.weight_scale, layer._kernel_ones]

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        qweight = layer.qweight
        x2 = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()
        if x2.shape[0] <= self.kernel_max_rows and x2.device.type == "cpu":
            acc = torch.ops.aten._weight_int8pack_mm(x2, qweight, layer._kernel_ones)
        else:
            # int8 -> bf16 is exact; converted in ~4 MiB chunks of output rows (cache-sized,
            # recycled by the allocator rather than page-faulted on every call).
            step = max(1, (1 << 21) // qweight.shape[1])
            parts = [F.linear(x2, w.to(COMPUTE_DTYPE)) for w in qweight.split(step)]
            acc = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        y = add_bias(acc * layer.weight_scale, layer)  # float32
        return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
