"""Weight-only int8, group-wise: a scale per `group_size` consecutive input columns (Q8_0).

    W (out, in) float, groups of g consecutive input columns (g = 32 by default):
        q (out, in) int8 in [-127, 127],  scale (out, in / g) float16
        W[n, k] ~= q[n, k] * scale[n, k // g]

Why groups: one scale per output channel (int8.py) must cover the channel's largest weight,
so a single outlier coarsens the step of every other weight in the row; on SmolLM2-135M that
cost 0.56 greedy agreement with fp32. llama.cpp's Q8_0 (a float16 scale per 32 weights)
agrees 1.00 with its f32 on the same weights. This is the same format, so a GGUF's Q8_0
blocks load as they are (`gguf_blocks.from_gguf_q8_0`). q is fitted against the float16-rounded scale,
so storing the scale in float16 adds no error. Cost: 8.5 bits per weight.

Paths of `apply` (the same values: x times the exact q * scale, summed in float32; only the
summation order differs, and for a bf16 model the torch path rounds q * scale to bf16):
  * at most 32 rows (gemv.MAX_ROWS: decode steps), where the decode GEMV kernel runs
    (quantization/gemv.py, `gemv_int8_grouped`): the weight streams once at 1 byte + 1/16 per
    weight, the products and sums in float32, the result rounded once to x's dtype.
    The layer then keeps its weights only as the kernel's channel tiles (no second copy);
  * with int8 activations (`activations="int8"`, QuantizationConfig.activations), the same
    row counts run `gemv_int8_q8` instead: x rounded to int8 per block of 32 (llama.cpp's
    q8_0 activations), exact int8 x int8 block dot products, one float multiply-add per block
    (about half the AVX2 instructions per weight of converting every weight to float); the
    layer then keeps its weights as the kernel's quad tiles (`gemv.pack_int8_quads`), and
    the GEMM path below (prefill; PAGEDSERVE_GEMV=off) multiplies x rounded the same way
    (`gemv.q8_round_trip`), so every row count computes one function;
  * 33 to gemv.CHUNKED_MAX_ROWS (128) rows: the same kernel, 32 rows a call (1.2-2.2x faster
    than dequantizing blocks for the GEMM below on SmolLM2's layers, 2 AVX2 cores);
  * more rows, or no kernel (PAGEDSERVE_GEMV=off, out % 16 != 0): y = x @ (q * scale)^T in
    the activation dtype (float32 for a float32 model: the weights are the only thing
    rounded), one block of output rows at a time (the block's dequantized copy, ~4 MiB,
    stays in cache and is recycled by the allocator).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import GROUP_SIZES, QUANTIZATION_ACTIVATIONS
from pagedserve.quantization import gemv
from pagedserve.quantization.base import LinearCall, LinearMethod, add_bias, linear_call
from pagedserve.quantization.packed import onednn_packs

SCALE_DTYPE = torch.float16
# int8: rounded per block of 32 in decode steps; none: weight-only ("auto" is resolved above us).
ACTIVATIONS = tuple(a for a in QUANTIZATION_ACTIVATIONS if a != "auto")
_BLOCK_ELEMS = 1 << 20  # dequantized weights per block of output rows


def quantize_int8_grouped(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W (out, in) -> (q int8 (out, in), scale float16 (out, in / g)), W ~= q * scale."""
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    scale = (w.abs().amax(dim=-1) / 127.0).to(SCALE_DTYPE)
    # An all-zero group keeps scale 0 and q 0; dividing by `tiny` instead of 0 avoids NaN.
    divisor = scale.float().clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    q = torch.round(w / divisor).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out_features, in_features), scale


def dequantize_int8_grouped(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(out, in) weight in `dtype` (q * scale computed in float32, rounded once)."""
    out_features, in_features = q.shape
    groups = scale.shape[1]
    w = q.view(out_features, groups, in_features // groups).float() * scale.float()[..., None]
    return w.view(out_features, in_features).to(dtype)


class Int8GroupedLinearMethod(LinearMethod):
    """Group-wise int8 weights, quantized at load time; see the module docstring.

    Layer tensors after `process_weights_after_loading` (or `set_quantized`):
        qweight_tiles  (out/16, in, 16) int8          where the GEMV kernel takes the layer
        scale_tiles    (out/16, in / group, 16) float16 (a GGUF file's K-quants: float32, or
                       (out/16, in / group, 2, 16) float32 scale and level 0; gguf_blocks.py)
    or, with int8 activations, where the kernel takes the layer
        qweight_quads  (out/16, in/4, 16, 4) int8
        scale_tiles    (out/16, in / group, 16) float16
    or else
        qweight        (out, in) int8
        weight_scale   (out, in / group) float16
    """

    name = "int8-grouped"
    converts_weight_per_call = True  # dequantized for the GEMM past gemv.CHUNKED_MAX_ROWS

    def __init__(self, group_size: int = 32, gemv: bool = True, activations: str = "none") -> None:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"int8 group size must be one of {GROUP_SIZES}, got {group_size}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"int8 activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.group_size = group_size
        self.gemv = gemv  # False: the torch path at every batch size (benchmarks compare)
        self.activations = activations

    def supports(self, layer: nn.Module) -> bool:
        return layer.input_size % self.group_size == 0

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = quantize_int8_grouped(layer.weight, self.group_size)
        del layer.weight
        self.set_quantized(layer, q, scale)

    def set_quantized(self, layer: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
        """Installs already-quantized weights (from `quantize_int8_grouped` or a GGUF file):
        as the GEMV kernel's channel tiles where it takes them, else as they are."""
        scale = scale.to(SCALE_DTYPE)
        if self.gemv and gemv.takes_grouped(q):
            tiles, scales = gemv.pack_int8_grouped(q, scale)
            if self.activations == "int8":
                # The scales' layout is the same; only q is regrouped (4 k per channel).
                layer.register_buffer("qweight_quads", gemv.pack_int8_quads(q))
                layer.register_buffer("scale_tiles", scales)
                return
            layer.register_buffer("qweight_tiles", tiles)
            layer.register_buffer("scale_tiles", scales)
            return
        layer.register_buffer("qweight", q.contiguous())
        layer.register_buffer("weight_scale", scale.contiguous())

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        if hasattr(layer, "qweight_tiles"):
            return [layer.qweight_tiles, layer.scale_tiles]
        if hasattr(layer, "qweight_quads"):
            return [layer.qweight_quads, layer.scale_tiles]
        return [layer.qweight, layer.weight_scale]

    def int_weight(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """(q (out, in) int8, scale (out, in / group) float16 or float32), whichever layout the
        layer keeps (copies if tiled); not for a GGUF K-quant's affine (scale, level 0) tiles."""
        scales = getattr(layer, "scale_tiles", None)
        if scales is not None and scales.dim() == 4:
            raise ValueError("affine GGUF tiles have a level 0: use dequantized_weight")
        if hasattr(layer, "qweight_tiles"):
            return gemv.unpack_int8_grouped(layer.qweight_tiles, layer.scale_tiles)
        if hasattr(layer, "qweight_quads"):
            tiles = layer.qweight_quads
            num_tiles = tiles.shape[0]
            scale = layer.scale_tiles.transpose(1, 2).reshape(num_tiles * gemv.TILE, -1)
            return gemv.unpack_int8_quads(tiles), scale
        return layer.qweight, layer.weight_scale

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if hasattr(layer, "qweight_tiles") or hasattr(layer, "qweight_quads"):
            return torch.cat(list(_tile_blocks(layer, dtype)))
        return dequantize_int8_grouped(*self.int_weight(layer), dtype)

    def decode_op(self, layer: nn.Module) -> LinearCall | None:
        tiles, op = getattr(layer, "qweight_tiles", None), "gemv_int8_grouped"
        if tiles is None:
            tiles, op = getattr(layer, "qweight_quads", None), "gemv_int8_q8"
        if tiles is None:
            return None
        return linear_call(op, tiles, layer.scale_tiles, bias=getattr(layer, "bias", None))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        tiles = getattr(layer, "qweight_tiles", None)
        op = gemv.int8_grouped
        if tiles is None:
            tiles, op = getattr(layer, "qweight_quads", None), gemv.int8_q8
        if tiles is not None and x.dtype in gemv.X_DTYPES:
            rows, bias = gemv.rows_of(x), getattr(layer, "bias", None)
            if rows <= gemv.MAX_ROWS:  # a decode step: one op, x as it is
                return op(x, tiles, layer.scale_tiles, bias)
            if rows <= self.decode_max_rows(layer):
                return gemv.in_chunks(op, x, tiles, layer.scale_tiles, bias)
        x2 = x.reshape(-1, x.shape[-1])
        if self.activations == "int8":  # the kernel's rounding: one function at every row count
            x2 = gemv.q8_round_trip(x2)
        # bf16 activations on a CPU without oneDNN's bf16 GEMM (AVX2): torch's bf16 F.linear ran
        # a 512-token SmolLM2 prefill at 74 tok/s; float32 GEMMs on float32 blocks (the weights'
        # exact values, as the GEMV kernel uses them) and one rounding of the result to bf16.
        compute = torch.float32 if x.dtype == torch.bfloat16 and not onednn_packs(torch.bfloat16) else x.dtype
        blocks = _tile_blocks(layer, compute) if tiles is not None else _row_blocks(layer, compute)
        x2 = x2.to(compute)
        parts = [F.linear(x2, w) for w in blocks]
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return add_bias(y.to(x.dtype), layer).reshape(*x.shape[:-1], y.shape[-1])


def _row_blocks(layer: nn.Module, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The dequantized weight of an untiled layer, ~_BLOCK_ELEMS at a time: (rows, in)."""
    q, scale = layer.qweight, layer.weight_scale
    step = max(1, _BLOCK_ELEMS // q.shape[1])
    for r in range(0, q.shape[0], step):
        yield dequantize_int8_grouped(q[r : r + step], scale[r : r + step], dtype)


def _tile_blocks(layer: nn.Module, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The same from channel tiles: (16 T, in) per block of T tiles; the conversion to float
    writes (T, 16, in) order, so the multiply by the scales (and the add of a GGUF K-quant's
    level 0, `gemv.pack_int8_affine`) are the only other passes."""
    scales = layer.scale_tiles  # (T, G, 16), or (T, G, 2, 16): scale, level 0
    num_tiles, groups, tile = scales.shape[0], scales.shape[1], scales.shape[-1]
    quads = getattr(layer, "qweight_quads", None)
    tiles = quads if quads is not None else layer.qweight_tiles
    in_features = tiles.shape[1] * (4 if quads is not None else 1)
    step = max(1, _BLOCK_ELEMS // (in_features * tile))
    for t in range(0, num_tiles, step):
        q = tiles[t : t + step].transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        q = q.view(q.shape[0], tile, in_features)  # quads (T, 16, in/4, 4) -> (T, 16, in)
        s = scales[t : t + step].float()
        level0 = s[:, :, 1].transpose(1, 2) if s.dim() == 4 else None  # (T, 16, G)
        s = (s[:, :, 0] if s.dim() == 4 else s).transpose(1, 2)  # (T, 16, G)
        w = q.view(q.shape[0], tile, groups, in_features // groups) * s[..., None]
        if level0 is not None:  # q * s is exact: one rounding, as gguf's d * q - dm
            w += level0[..., None]
        yield w.view(-1, in_features).to(dtype)
