"""Weight-only int4: group-wise along the input dim, affine (a scale and a zero per group).

    W (out, in) float, groups of `group_size` consecutive input columns:
        q (out, in) in [0, 15]
        W[n, k] ~= (q[n, k] - 8) * scale[k // g, n] + zero[k // g, n]
    (affine: the 16 levels span each group's range, [min, max] shrunk by the clip ratio of
    least squared error; for the same 4 bits this is more accurate than symmetric [-8, 7]
    around 0, and the kernel applies the zero for free.)

Storage (the layout of torch's CPU kernel `aten._weight_int4pack_mm_for_cpu`):
    qweight       (out, in / 2) uint8, two 4-bit values per byte, packed by
                  `aten._convert_weight_to_int4pack_for_cpu` (see `_unpack_blocks`)
    scales_zeros  (in / g, out, 2) bfloat16: [..., 0] scale, [..., 1] zero
The kernel takes scales/zeros in the activation dtype, bfloat16; quantization already uses
the bf16-rounded scale and zero, so the stored values are the ones q was fitted against.

`apply` where the decode GEMV kernel runs (AVX2/FMA; quantization/gemv.py, `gemv_int4_grouped`):
the layer keeps its weights only as the kernel's channel tiles (`qweight_tiles` (out/16, in, 8)
uint8, `scales_zeros_tiles` (out/16, in/g, 2, 16) bfloat16, the same numbers), and
  * rows <= 32 (gemv.MAX_ROWS): the kernel, one call: x as it is (float32 for a float32 model), float32
    products of x and the exact (q - 8) * scale + zero, float32 sums, one rounding to x's dtype;
  * 33 to gemv.CHUNKED_MAX_ROWS (128) rows: the same kernel, 32 rows a call (1.8-3.6x faster
    than dequantizing for the GEMM below on SmolLM2's layers, 2 AVX2 cores; 1.35x at 256);
  * more rows: the weight dequantized block by block, and the GEMM: in float32 for a float32
    model; for a bfloat16 model in bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16
    / AMX), else in float32 (a bf16 GEMM without native support runs ~6x slower than fp32's).
Otherwise (PAGEDSERVE_GEMV=off, no AVX2), with x cast to bfloat16 like the int8 method (the
kernels' dtype):
  * rows <= kernel_max_rows (64): the kernel (reads 4-bit weights: decode is memory-bound);
  * more rows: unpack the weight to bf16 (two passes, ~0.5 ns per weight on one core, in
    ~4 MiB chunks of output rows) and run oneDNN's bf16 GEMM, faster than the kernel's (or
    fp32's) compute from ~96 rows on (benchmarks/quantization.py --kernels). Only when the
    unpacking matches this CPU's packed layout (checked once per process); the unpacked
    weight is rounded to bf16 once (~2^-9 relative, far below the int4 step).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.config import GROUP_SIZES
from pagedserve.dtypes import cpu_has_native_bf16
from pagedserve.quantization import gemv
from pagedserve.quantization.base import LinearCall, LinearMethod, add_bias, linear_call

logger = logging.getLogger(__name__)

COMPUTE_DTYPE = torch.bfloat16
KERNEL_GROUP_SIZES = GROUP_SIZES


def int4_group_size(input_size: int, group_size: int) -> int | None:
    """The group size used for a layer with `input_size` columns, or None if int4 cannot apply.

    A layer narrower than `group_size` uses one group per row (if the kernel supports it).
    """
    g = min(group_size, input_size)
    return g if g in KERNEL_GROUP_SIZES and input_size % g == 0 else None


# Range shrink factors tried per group (1.0 = plain min/max); see `quantize_int4`.
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def quantize_int4(
    weight: torch.Tensor, group_size: int, clip_ratios: tuple[float, ...] = CLIP_RATIOS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W (out, in) -> (q uint8 (out, in) in [0, 15], scale, zero (in / g, out) bfloat16).

    Per group, the range [min, max] is shrunk by each of `clip_ratios` and the one with the
    smallest squared error kept: clipping a group's few extreme values buys a finer step for
    all the others (Gaussian weights, group 128: 10% lower squared error than plain min/max,
    which stays a candidate, so no group gets worse on this measure).
    """
    out_features, in_features = weight.shape
    w = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    best = None
    for ratio in clip_ratios:
        q, scale, zero = _fit_int4(w, lo * ratio, hi * ratio)
        err = (_dequant(q, scale, zero) - w).pow(2).sum(dim=-1)
        if best is None:
            best = (err, q, scale, zero)
            continue
        better = err < best[0]
        best = (
            torch.where(better, err, best[0]),
            torch.where(better[..., None], q, best[1]),
            torch.where(better, scale, best[2]),
            torch.where(better, zero, best[3]),
        )
    assert best is not None
    _, q, scale, zero = best
    return q.reshape(out_features, in_features), scale.t().contiguous(), zero.t().contiguous()


def _fit_int4(
    w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups w (out, G, g), range [lo, hi] (out, G) -> q uint8, scale / zero bf16 (out, G)."""
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(COMPUTE_DTYPE)
    zero = (lo + 8 * scale.float()).to(COMPUTE_DTYPE)  # level 0 of the group sits at `lo`
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None] + 8)
    return q.clamp_(0, 15).to(torch.uint8), scale, zero


def _dequant(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (q.float() - 8) * scale.float()[..., None] + zero.float()[..., None]


def dequantize_int4(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """(out, in) float32 weight from unpacked q and (in / g, out) scale/zero."""
    s = scale.float().t().repeat_interleave(group_size, dim=1)
    z = zero.float().t().repeat_interleave(group_size, dim=1)
    return (q.float() - 8) * s + z


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q (out, in) uint8 in [0, 15] -> the CPU kernel's packed (out, in / 2) uint8."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)


def _unpack_blocks(packed: torch.Tensor, block_n: int, transpose: bool = False) -> torch.Tensor:
    """Packed (N, K / 2) -> q as (N / block_n, K, block_n) uint8: W^T one block at a time;
    with `transpose`, as (K, N / block_n, block_n), i.e. W^T (K, N), contiguous.

    With AVX512 (block_n 64) the packer stores, per block of 64 output rows and per input
    column k, 32 bytes: byte j = q[row j + 32] << 4 | q[row j] (AVX2: 32 rows, 16 bytes).
    So the low nibbles are rows 0..block_n/2-1 and the high nibbles the rest, in order.
    """
    n, half_k = packed.shape
    p = packed.view(n // block_n, 2 * half_k, block_n // 2)
    if transpose:
        p = p.permute(1, 0, 2)
    return torch.cat((p & 15, p >> 4), dim=-1)  # a new contiguous tensor in p's shape order


@functools.cache
def _packed_block_n() -> int | None:
    """The block width `_unpack_blocks` must use on this CPU, or None (unknown layout)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 64), dtype=torch.uint8, generator=g)
    packed = pack_int4(q)
    for block_n in (64, 32):
        unpacked = _unpack_blocks(packed, block_n)  # (N / B, K, B)
        if torch.equal(unpacked.permute(0, 2, 1).reshape(128, 64), q):
            return block_n
    logger.warning("unknown int4 packed layout: int4 layers use the kernel at every batch size")
    return None


class Int4LinearMethod(LinearMethod):
    """Group-wise int4 weights, quantized at load time; see the module docstring.

    Layer tensors after `process_weights_after_loading`:
        qweight       (out, in / 2) uint8 (kernel layout)
        scales_zeros  (in / group, out, 2) bfloat16
        group_size    int attribute
    """

    name = "int4"
    converts_weight_per_call = True  # dequantized for the GEMM past gemv.CHUNKED_MAX_ROWS

    def __init__(self, group_size: int = 128, kernel_max_rows: int = 64, gemv: bool = True) -> None:
        self.group_size = group_size
        self.kernel_max_rows = kernel_max_rows
        self.gemv = gemv  # False: torch's int4 kernel layout even where the GEMV kernel runs

    def supports(self, layer: nn.Module) -> bool:
        """Whether the kernel accepts this layer's shape (out % 16, a valid group size)."""
        return (
            layer.output_size % 16 == 0
            and int4_group_size(layer.input_size, self.group_size) is not None
        )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        group = int4_group_size(layer.input_size, self.group_size)
        assert group is not None and self.supports(layer)
        q, scale, zero = quantize_int4(layer.weight, group)
        del layer.weight
        self.set_quantized(layer, q, scale, zero, group)

    def set_quantized(
        self,
        layer: nn.Module, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
    ) -> None:
        """Installs already-quantized weights: q (out, in) in [0, 15], scale / zero (in / g, out)
        (from `quantize_int4`, or a GGUF file's blocks via quantization/gguf_blocks.py): as the
        GEMV kernel's channel tiles where it runs, else in torch's int4 kernel layout."""
        layer.group_size = group
        if self.gemv and gemv.takes_grouped(q):
            tiles, sz = gemv.pack_int4_grouped(q, scale.to(COMPUTE_DTYPE), zero.to(COMPUTE_DTYPE))
            layer.register_buffer("qweight_tiles", tiles)
            layer.register_buffer("scales_zeros_tiles", sz)
            return
        layer.register_buffer("qweight", pack_int4(q))
        sz = torch.stack((scale, zero), dim=-1).to(COMPUTE_DTYPE).contiguous()
        layer.register_buffer("scales_zeros", sz)
        layer.group_size = group

    def set_quantized_gguf(self, layer: nn.Module, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """Installs a GGUF file's Q4_1 / Q4_0 values, W = q * d + m with float16 d, m (in / 32,
        out), or Q4_K's with float32 d, m (d * sc, -dmin * m): exactly, as (d, m) channel tiles
        in their dtype, where the GEMV kernel runs; else (float16 only) as bfloat16
        scale = d, zero = m + 8 d (a 2^-9 relative rounding) for torch's kernel."""
        if self.gemv and gemv.takes_grouped(q):
            layer.group_size = 32
            kind = torch.float32 if d.dtype == torch.float32 else torch.float16
            tiles, dm = gemv.pack_int4_grouped(q, d.to(kind), m.to(kind))
            layer.register_buffer("qweight_tiles", tiles)
            layer.register_buffer("scales_zeros_tiles", dm)
            return
        self.set_quantized(layer, q, d.float(), m.float() + 8 * d.float(), 32)

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        if hasattr(layer, "qweight_tiles"):
            return [layer.qweight_tiles, layer.scales_zeros_tiles]
        return [layer.qweight, layer.scales_zeros]

    def int_weight(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q (out, in) uint8 in [0, 15], scale, zero (in / g, out)) as stored (copies),
        whichever layout the layer keeps: bfloat16, or for GGUF values float32 scale = d and
        zero = m + 8 d."""
        if hasattr(layer, "qweight_tiles"):
            q, a, b = gemv.unpack_int4_grouped(layer.qweight_tiles, layer.scales_zeros_tiles)
            if a.dtype in (torch.float16, torch.float32):  # GGUF's (d, m)
                return q, a.float(), b.float() + 8 * a.float()
            return q, a, b
        block_n = _packed_block_n()
        if block_n is None:
            raise NotImplementedError("unknown int4 packed layout on this CPU")
        n, k = layer.qweight.shape[0], layer.qweight.shape[1] * 2
        q = _unpack_blocks(layer.qweight, block_n).permute(0, 2, 1).reshape(n, k)
        sz = layer.scales_zeros
        return q, sz[..., 0].contiguous(), sz[..., 1].contiguous()

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) weight the layer represents: (q - 8) * scale + zero, or for GGUF
        values q * d + m (as gguf computes it), in float32, then `dtype`."""
        sz = getattr(layer, "scales_zeros_tiles", None)
        if sz is not None and sz.dtype in (torch.float16, torch.float32):
            q, d, m = gemv.unpack_int4_grouped(layer.qweight_tiles, sz)
            g = layer.group_size
            w = q.float() * d.float().t().repeat_interleave(g, 1) + m.float().t().repeat_interleave(g, 1)
            return w.to(dtype)
        return dequantize_int4(*self.int_weight(layer), layer.group_size).to(dtype)

    def decode_op(self, layer: nn.Module) -> LinearCall | None:
        tiles = getattr(layer, "qweight_tiles", None)
        if tiles is None:
            return None
        return linear_call(
            "gemv_int4_grouped", tiles, layer.scales_zeros_tiles, bias=getattr(layer, "bias", None))

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        tiles = getattr(layer, "qweight_tiles", None)
        if tiles is not None:
            return self._apply_tiles(layer, x, tiles)
        n = layer.qweight.shape[0]
        x2 = x.reshape(-1, x.shape[-1]).to(COMPUTE_DTYPE).contiguous()
        block_n = _packed_block_n() if x2.shape[0] > self.kernel_max_rows else None
        if block_n is not None and n % block_n == 0:
            rows = _row_chunks(n, x2.shape[1], block_n)
            y = torch.cat([self._dequantized_matmul(layer, x2, r, block_n) for r in rows], dim=1)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2, layer.qweight, layer.group_size, layer.scales_zeros
            )
        y = add_bias(y.to(x.dtype), layer)
        return y.reshape(*x.shape[:-1], n)

    def _apply_tiles(self, layer: nn.Module, x: torch.Tensor, tiles: torch.Tensor) -> torch.Tensor:
        rows, bias, sz = gemv.rows_of(x), getattr(layer, "bias", None), layer.scales_zeros_tiles
        kernel = x.dtype in gemv.X_DTYPES
        if kernel and rows <= gemv.MAX_ROWS:  # a decode step: one op, x as it is
            return gemv.int4_grouped(x, tiles, sz, bias)
        if kernel and rows <= self.decode_max_rows(layer):
            return gemv.in_chunks(gemv.int4_grouped, x, tiles, sz, bias)
        # bf16 products only for a bf16 model (and only where the CPU multiplies bf16 natively):
        # the CPU never lowers a float32 model's precision.
        native = x.dtype == torch.bfloat16 and cpu_has_native_bf16()
        dtype = COMPUTE_DTYPE if native else torch.float32
        x2 = x.reshape(-1, x.shape[-1]).to(dtype)
        parts = [F.linear(x2, w) for w in _tile_blocks(tiles, sz, dtype)]
        y = add_bias((parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)).to(x.dtype), layer)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def _dequantized_matmul(
        layer: nn.Module, x: torch.Tensor, rows: slice, block_n: int
    ) -> torch.Tensor:
        """x (M, K) bf16 @ W[rows]^T with W[rows] unpacked to bf16: (M, len(rows)) bf16."""
        k, g = x.shape[1], layer.group_size
        q = _unpack_blocks(layer.qweight[rows], block_n, transpose=True)  # W^T (K, n) uint8
        n = q.shape[1] * q.shape[2]
        # Scale and the value of level 0 (zero - 8 * scale) as (G, 1, n): one addcmul does
        # the whole dequantization of W^T viewed as (G, g, n). Tiny tensors, built per call.
        sz = layer.scales_zeros[:, rows].float()
        scale = sz[:, None, :, 0].to(COMPUTE_DTYPE)
        level0 = (sz[:, None, :, 1] - 8 * sz[:, None, :, 0]).to(COMPUTE_DTYPE)
        wt = torch.addcmul(level0, q.view(k // g, g, n), scale)  # bf16
        return x @ wt.view(k, n)


def _row_chunks(n: int, k: int, multiple: int, max_elems: int = 1 << 21) -> list[slice]:
    """Output-row ranges whose dequantized bf16 copy stays under ~4 MiB (cache-sized, and
    small enough to be recycled by the allocator instead of page-faulted on every call)."""
    step = max(multiple, max_elems // k // multiple * multiple)
    return [slice(a, min(a + step, n)) for a in range(0, n, step)]


def _tile_blocks(tiles: torch.Tensor, sz: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The weight (q - 8) * scale + zero from channel tiles, (16 T, in) in `dtype` per block of
    T tiles (~4 MiB of float32): one addcmul per block, scale * q + level 0 per group."""
    num_tiles, in_features = tiles.shape[:2]
    groups = sz.shape[1]
    step = max(1, (1 << 20) // (in_features * gemv.TILE))
    for t in range(0, num_tiles, step):
        packed = tiles[t : t + step]
        q = torch.cat((packed & 15, packed >> 4), dim=-1).transpose(1, 2)  # (T, 16, in) view
        q = q.to(torch.float32, memory_format=torch.contiguous_format)
        s = sz[t : t + step].float().permute(0, 3, 1, 2).contiguous()  # (T, 16, G, 2)
        # Level 0 (the weight of q = 0): zero - 8 scale, or GGUF's m (float16 / float32).
        level0 = s[..., 1] if sz.dtype != torch.bfloat16 else s[..., 1] - 8 * s[..., 0]
        scale, level0 = s[..., 0, None], level0[..., None]
        w = torch.addcmul(level0, q.view(q.shape[0], gemv.TILE, groups, -1), scale)
        yield w.reshape(-1, in_features).to(dtype)
