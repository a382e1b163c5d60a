"""Decode-sized linear layers (at most MAX_ROWS = 32 rows) through pagedserve/csrc/gemv_cpu.cpp.

Why: a batch-1 decode step reads every weight once, so it is bound by memory bandwidth,
and oneDNN's prepacked GEMM (blocked for ~64 rows) reads a one-row product at well under
what the machine streams (the issue-18 profile: 88% of a SmolLM2 bf16 token in it, ~20 GB/s).
The C++ kernel streams the weight once, front to back per thread, doing every row's
multiply-adds on each weight vector while it is in registers (a few rows) or in the caches
(more rows, in register blocks, the next tile streaming meanwhile).

Layout of full-precision and per-channel int8 weights ("pair tiles", the one
`int8.pack_for_cpp` already uses for int8):

    W (out, in)  ->  (out/16, in/2, 16, 2):  tile[t, p, j, e] = W[16 t + j, 2 p + e]

A layer the kernel can take (out % 16 == 0, in even, CPU) keeps such a copy of its weight
beside the GEMM path's own (`gemv_weight`; for int8 on AVX512-BF16 CPUs the C++ GEMM's
`qweight_packed` already is one). That costs one more copy of full-precision weights
(`PAGEDSERVE_GEMV=off` saves it, and uses the GEMM at every batch size).
`benchmarks/gemv_micro.py` times this kernel against the GEMM path, alternating.

Group-wise int8 / int4 weights (a scale per group of input columns) use "channel tiles"
instead, where one k of 16 output channels is contiguous, so a group's 16 scales multiply
whole vectors of partial sums (see the C++ source):

    int8  q (out, in)        -> (out/16, in, 16) int8:   tile[t, k, j] = q[16 t + j, k]
          scale (out, in/g)  -> (out/16, in/g, 16) float16 (or float32, or float32
                                (out/16, in/g, 2, 16) scale and level 0: GGUF's K-quants)
    int4  q (out, in) 0..15  -> (out/16, in, 8) uint8:   byte j = q[16t + j, k] | q[16t + 8 + j, k] << 4
          scale, zero (in/g, out) -> (out/16, in/g, 2, 16) bfloat16 (or GGUF's d, m in float16)
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pagedserve import cpp_build, envs

TILE = 16
# Rows up to which the kernel is used (its build refuses more). A decode step this small reads
# every weight once and multiplies all its rows while the weight is in the caches; past ~32
# rows a blocked GEMM (oneDNN) multiplies faster than the kernel's register tiles.
MAX_ROWS = 32
# Rows up to which a layer whose other path converts its whole weight every call still runs
# the kernel, MAX_ROWS at a time (`in_chunks`): bfloat16 on a CPU without oneDNN's bf16 GEMM
# (AVX2; the weight widened to float32) and the group-wise int8 / int4 methods (dequantized).
# The 125M model's 48 bf16 linears (benchmarks/gemv_rows.py, 2 AVX2 cores): 32-row chunks vs
# the widened GEMM 84 vs 176 ms at 48 rows, 152 vs 224 at 96, 201 vs 269 at 128, 525 vs 483
# at 256 (the GEMM's blocking wins there); int8 / int4 on SmolLM2's layers 1.2-3.6x faster up
# to 128 rows. float32 (oneDNN's packed GEMM, no conversion) stops at MAX_ROWS.
CHUNKED_MAX_ROWS = 128
# Activation dtypes the ops take (a float16 model's layers use their torch paths).
X_DTYPES = (torch.float32, torch.bfloat16)


@functools.lru_cache(maxsize=1)  # a no-argument cache: ~50 ns on the per-layer hot path
def _ops() -> Any:
    return cpp_build.load(cpp_build.GEMV).ops


def gemv_ops() -> Any:
    """The C++ ops, or None when they are off (`PAGEDSERVE_GEMV=off`) or cannot run here
    (no compiler, no AVX2/FMA: the layers use the GEMM path). Asked while weights are
    processed at load, so the environment is read then, never per call.

    Raises:
        KernelUnavailable: PAGEDSERVE_GEMV=cpp and the kernel is unavailable.
    """
    return cpp_build.resolve(cpp_build.GEMV, envs.gemv())


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel can hold this (out, in) weight (and is in use)."""
    out_features, in_features = weight.shape
    return (
        weight.device.type == "cpu"
        and out_features % TILE == 0
        and in_features % 2 == 0
        and gemv_ops() is not None
    )


def takes_grouped(q: torch.Tensor) -> bool:
    """Whether the group-wise ops can take this (out, in) quantized weight (and are in use);
    its groups must be multiples of 32 columns, which every group size of the methods is."""
    return q.device.type == "cpu" and q.shape[0] % TILE == 0 and gemv_ops() is not None


def pack_tiles(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (out/16, in/2, 16, 2), any dtype: tiles of 16 channels, k-pair by k-pair."""
    out_features, in_features = weight.shape
    tiles = weight.detach().view(out_features // TILE, TILE, in_features // 2, 2)
    return tiles.permute(0, 2, 1, 3).contiguous()


def unpack_tiles(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_tiles`."""
    num_tiles, pairs = tiles.shape[:2]
    return tiles.permute(0, 2, 1, 3).reshape(num_tiles * TILE, pairs * 2)


def rows_of(x: torch.Tensor) -> int:
    """Rows of x (..., in) as a matrix."""
    return x.shape[0] if x.dim() == 2 else (x.numel() // x.shape[-1] if x.shape[-1] else 0)


def in_chunks(op: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
    """op(x, *args) for x (..., in) of any rows, calling op on MAX_ROWS rows at a time (each
    call streams the weight once; past MAX_ROWS a chunk is compute-bound, so the extra passes
    cost little). The C++ decoder loop splits the same way."""
    x2 = x.reshape(-1, x.shape[-1])
    parts = [op(part, *args) for part in x2.split(MAX_ROWS)]
    y = parts[0] if len(parts) == 1 else torch.cat(parts)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def dense(x: torch.Tensor, tiles: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., in) float32/bf16 -> x W^T + b (..., out) in x.dtype; at most MAX_ROWS rows.
    (The op flattens x itself: no Python reshape around the hot call.)"""
    return _ops().gemv_dense(x, tiles, bias)


def int8(
    x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (..., in) -> float(bf16(bf16(x) q^T)) * scale + bias (..., out) float32; at most
    MAX_ROWS rows."""
    return _ops().gemv_int8(x, tiles, scale, bias)


def pack_int8_grouped(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q (out, in) int8, scale (out, in / g) -> channel tiles (out/16, in, 16) and scales
    (out/16, in / g, 16), the layout of `int8_grouped`."""
    out_features, in_features = q.shape
    tiles = q.view(out_features // TILE, TILE, in_features).transpose(1, 2).contiguous()
    scales = scale.view(out_features // TILE, TILE, -1).transpose(1, 2).contiguous()
    return tiles, scales


def unpack_int8_grouped(tiles: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `pack_int8_grouped`: (q (out, in), scale (out, in / g))."""
    num_tiles, in_features = tiles.shape[:2]
    q = tiles.transpose(1, 2).reshape(num_tiles * TILE, in_features)
    return q, scales.transpose(1, 2).reshape(num_tiles * TILE, -1)


def int8_grouped(
    x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (..., in) float32/bf16 -> x (q * scale)^T + b (..., out) in x.dtype, float32
    products and sums; at most MAX_ROWS rows. `scales`: (out/16, in / g, 16) float16 or
    float32, or (out/16, in / g, 2, 16) float32 (scale, level 0) of W = q * scale + level0."""
    return _ops().gemv_int8_grouped(x, tiles, scales, bias)


def pack_affine_params(scale: torch.Tensor, level0: torch.Tensor) -> torch.Tensor:
    """scale, level 0 (out, in / g) -> (out/16, in / g, 2, 16) float32: the (s, l0) pairs of
    W = q * s + l0 that the channel-tile ops take."""
    out_features = scale.shape[0]
    params = torch.stack((scale, level0), dim=1).float()  # (out, 2, in / g)
    return params.view(out_features // TILE, TILE, 2, -1).permute(0, 3, 2, 1).contiguous()


def pack_int8_affine(
    q: torch.Tensor, scale: torch.Tensor, level0: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (out, in) int8, scale and level 0 (out, in / g) float32 of W = q * scale + level0 (a
    GGUF file's Q5_1 / Q5_K, or Q4_K fused beside int8 shards) -> channel tiles (out/16, in, 16)
    and (out/16, in / g, 2, 16) float32 parameters, the affine form of `int8_grouped`."""
    out_features, in_features = q.shape
    tiles = q.view(out_features // TILE, TILE, in_features).transpose(1, 2).contiguous()
    return tiles, pack_affine_params(scale, level0)


def pack_int8_quads(q: torch.Tensor) -> torch.Tensor:
    """q (out, in) int8 -> quad tiles (out/16, in/4, 16, 4), the layout of `int8_q8`: 16
    channels x 4 consecutive input columns per 64 bytes (its scales: `pack_int8_grouped`'s)."""
    out_features, in_features = q.shape
    return q.view(out_features // TILE, TILE, in_features // 4, 4).transpose(1, 2).contiguous()


def unpack_int8_quads(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int8_quads`: q (out, in)."""
    num_tiles, quads = tiles.shape[:2]
    return tiles.transpose(1, 2).reshape(num_tiles * TILE, quads * 4)


def int8_q8(
    x: torch.Tensor, tiles: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (..., in) float32/bf16 -> y (..., out) in x.dtype with x quantized per row and block
    of 32 columns to int8 (scale absmax / 127, as llama.cpp's q8_0), exact int8 x int8 block
    dot products, then y = sum_blocks dot * scale_w * scale_x (+ b); at most MAX_ROWS rows.
    `quantize_rows_q8` is the same activation rounding in torch."""
    return _ops().gemv_int8_q8(x, tiles, scales, bias)


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation rounding of `int8_q8`, in torch: x (M, K) float -> (xq (M, K) int8,
    d (M, K/32) float32), x ~= xq * d per block of 32; d = absmax / 127, xq = round-half-even
    of x * (1 / d) (0 for an all-zero block)."""
    blocks = x.float().reshape(x.shape[0], x.shape[1] // 32, 32)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))
    xq = torch.round(blocks * inv[..., None]).to(torch.int8)
    return xq.reshape(x.shape), d


def q8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x (..., in) rounded as `int8_q8` rounds it (per row, blocks of 32), back in x.dtype: what
    the GEMM path multiplies when a layer's activations are int8, so that a prefill of many
    rows computes the function a decode step does."""
    flat = x.reshape(-1, x.shape[-1])
    xq, d = quantize_rows_q8(flat)
    return (xq.float().view(flat.shape[0], flat.shape[1] // 32, 32) * d[..., None]).reshape(x.shape).to(x.dtype)


def pack_int4_grouped(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (out, in) uint8 in [0, 15], per-group parameters (in / g, out) -> channel tiles
    (out/16, in, 8) uint8 (two channels per byte) and (out/16, in / g, 2, 16) parameters.

    The parameters' dtype says their meaning to the kernel: bfloat16 (scale, zero) of
    W = (q - 8) * scale + zero (`quantize_int4`), or float16 / float32 (d, m) of W = q * d + m
    (a GGUF file's Q4_1 / Q4_0 blocks as stored; Q4_K's d * sc and -dmin * m in float32)."""
    if scale.dtype not in (torch.bfloat16, torch.float16, torch.float32) or zero.dtype != scale.dtype:
        raise ValueError("int4 group parameters must be both bfloat16 (scale, zero) or both "
                         "float16 / float32 (d, m)")
    out_features, in_features = q.shape
    halves = q.contiguous().view(out_features // TILE, 2, TILE // 2, in_features)  # (T, 2, 8, in)
    # Both nibbles on contiguous rows first, then one transposing copy of the packed bytes.
    tiles = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2).contiguous()  # (T, in, 8)
    sz = torch.stack((scale.t(), zero.t()), dim=1)  # (out, 2, in / g)
    sz = sz.view(out_features // TILE, TILE, 2, -1).permute(0, 3, 2, 1)
    return tiles, sz.contiguous()


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q (out, in) uint8 in [0, 2^bits), bits 4, 5 or 6 -> channel tiles (out/16, in, 8 + 2 (bits - 4))
    uint8: per k, `pack_int4_grouped`'s 8 bytes of low nibbles, then the 16 channels' high
    bits (bits - 4 each, channel j's at bit (bits - 4) j) as one little-endian word."""
    out_features, in_features = q.shape
    halves = (q & 15).contiguous().view(out_features // TILE, 2, TILE // 2, in_features)
    low = (halves[:, 0] | (halves[:, 1] << 4)).transpose(1, 2)  # (T, in, 8)
    high_bits = bits - 4
    if high_bits == 0:
        return low.contiguous()
    high = (q >> 4).to(torch.int64).view(out_features // TILE, TILE, in_features).transpose(1, 2)
    shifts = torch.arange(TILE, dtype=torch.int64) * high_bits
    word = (high << shifts).sum(dim=-1)  # (T, in): < 2^32
    word_bytes = torch.stack([(word >> (8 * b)) & 255 for b in range(2 * high_bits)], dim=-1)
    return torch.cat((low, word_bytes.to(torch.uint8)), dim=-1).contiguous()


def unpack_bits(tiles: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_bits`: q (out, in) uint8 (the width from the tiles' bytes per k)."""
    num_tiles, in_features, nbytes = tiles.shape
    high_bits = (nbytes - 8) // 2
    t = torch.cat((tiles[..., :8] & 15, tiles[..., :8] >> 4), dim=-1)  # (T, in, 16)
    if high_bits:
        word = torch.zeros(num_tiles, in_features, dtype=torch.int64)
        for b in range(2 * high_bits):
            word |= tiles[..., 8 + b].to(torch.int64) << (8 * b)
        shifts = torch.arange(TILE, dtype=torch.int64) * high_bits
        t = t | (((word[..., None] >> shifts) & ((1 << high_bits) - 1)) << 4).to(torch.uint8)
    return t.transpose(1, 2).reshape(num_tiles * TILE, in_features)


def pack_bit_quads(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q (out, in) uint8 in [0, 2^bits), bits 4, 5 or 6 -> bit quads (out/16, in/32, 256 + 64 (bits - 4))
    uint8, the layout of `bits_q8` (csrc/gemv_cpu.cpp's BitQuads): per tile and block of 32 k,
    the low nibbles of octet o (k 8o..8o+7) and half h (channels 8h..8h+7) as 32 bytes,
    byte 4 j + e = Q[8h+j, 8o+e] | Q[8h+j, 8o+4+e] << 4; then the high bits (see the C++)."""
    out_features, in_features = q.shape
    # (T, half, j, block, octet, lo/hi, e)
    v = q.contiguous().view(out_features // TILE, 2, TILE // 2, in_features // 32, 4, 2, 4)
    v = v.permute(0, 3, 4, 1, 2, 6, 5)  # (T, block, octet, half, j, e, lo/hi)
    low = v & 15
    parts = [(low[..., 0] | (low[..., 1] << 4)).reshape(*v.shape[:2], 256)]
    high = v >> 4
    if bits == 5:  # per half: bit 2 o (+ 1 for the hi k) over the 4 octets
        shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1, 1, 1, 1) + torch.tensor(
            [0, 1], dtype=torch.uint8)
        field = (high << shifts).sum(dim=2, dtype=torch.uint8)  # (T, block, half, j, e, 2)
        parts.append(field.sum(dim=-1, dtype=torch.uint8).reshape(*v.shape[:2], 64))
    elif bits == 6:  # per octet pair and half: 2-bit fields at bits 0, 2 (octet 2P) and 4, 6 (2P + 1)
        pairs = high.reshape(*v.shape[:2], 2, 2, 2, TILE // 2, 4, 2)  # (T, block, P, o%2, half, j, e, lo/hi)
        shifts = (4 * torch.arange(2, dtype=torch.uint8)).view(1, 1, 1, 2, 1, 1, 1, 1) + torch.tensor(
            [0, 2], dtype=torch.uint8)
        field = (pairs << shifts).sum(dim=(3, 7), dtype=torch.uint8)  # (T, block, P, half, j, e)
        parts.append(field.reshape(*v.shape[:2], 128))
    elif bits != 4:
        raise ValueError(f"bit quads hold 4, 5 or 6 bits, got {bits}")
    return torch.cat(parts, dim=-1).contiguous()


def unpack_bit_quads(quads: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_bit_quads`: q (out, in) uint8 (the width from the bytes per block)."""
    num_tiles, blocks, nbytes = quads.shape
    nib = quads[..., :256].reshape(num_tiles, blocks, 4, 2, TILE // 2, 4)  # (T, block, octet, half, j, e)
    q = torch.stack((nib & 15, nib >> 4), dim=-1)  # (..., lo/hi)
    if nbytes == 320:
        hb = quads[..., 256:].reshape(num_tiles, blocks, 1, 2, TILE // 2, 4, 1)
        shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1, 1, 1, 1) + torch.tensor(
            [0, 1], dtype=torch.uint8)
        q = q | (((hb >> shifts) & 1) << 4)
    elif nbytes == 384:
        hb = quads[..., 256:].reshape(num_tiles, blocks, 2, 1, 2, TILE // 2, 4, 1)
        shifts = (4 * torch.arange(2, dtype=torch.uint8)).view(1, 1, 1, 2, 1, 1, 1, 1) + torch.tensor(
            [0, 2], dtype=torch.uint8)
        q = q | ((((hb >> shifts) & 3) << 4).reshape(q.shape))
    # (T, block, octet, half, j, e, lo/hi) -> (T, half, j, block, octet, lo/hi, e)
    return q.permute(0, 3, 4, 1, 2, 6, 5).reshape(num_tiles * TILE, blocks * 32)


def bits_q8(
    x: torch.Tensor, quads: torch.Tensor, params: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (..., in) float32/bf16 -> x W^T + b (..., out) in x.dtype, x rounded per row and block of
    32 to int8 (`quantize_rows_q8`), W the 4 / 5 / 6-bit weights of `pack_bit_quads` with any
    parameter form of `int4_grouped` (groups of 16 or 32): exact integer sums per group, one
    float multiply-add per group and channel. Any number of rows (prefill too)."""
    return _ops().gemv_bits_q8(x, quads, params, bias)


def bits_q8_parts(
    x: torch.Tensor, quads: list[torch.Tensor], params: list[torch.Tensor], bias: torch.Tensor | None
) -> torch.Tensor:
    """`bits_q8` of a layer stored in parts (each its own bits and parameter form): their outputs
    side by side, x rounded to int8 once. A fused layer whose shards have different GGUF types
    keeps each in the file's bytes."""
    return _ops().gemv_bits_q8_parts(x, quads, params, bias)


def unpack_int4_grouped(
    tiles: torch.Tensor, sz: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_int4_grouped`: (q (out, in) uint8, the two parameters (in / g, out))."""
    num_tiles, in_features = tiles.shape[:2]
    t = torch.cat((tiles & 15, tiles >> 4), dim=-1)  # (T, in, 16)
    q = t.transpose(1, 2).reshape(num_tiles * TILE, in_features)
    scale_zero = sz.permute(0, 3, 2, 1).reshape(num_tiles * TILE, 2, -1)  # (out, 2, in / g)
    return q, scale_zero[:, 0].t().contiguous(), scale_zero[:, 1].t().contiguous()


def int4_grouped(
    x: torch.Tensor, tiles: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x (..., in) float32/bf16 -> x W^T + b (..., out) in x.dtype, W = (q - 8) * scale + zero
    (bf16 parameters) or q * d + m (fp16 / fp32), float32 products and sums; at most MAX_ROWS
    rows. With `pack_bits` tiles of 5 / 6 bits, (d, m) pairs or (out/16, in / g, 16) scales
    alone of W = (q - 2^(bits-1)) * scale (a GGUF file's Q5_0 / Q6_K)."""
    return _ops().gemv_int4_grouped(x, tiles, scales_zeros, bias)


def dequant_tiles(tiles: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """W^T (in, out) float32 of channel tiles (int8 with float16 scales or (s, l0) pairs; 4 / 5
    / 6-bit with their pairs or centered scales), the exact weights: the GEMM path of a GGUF
    layer's prefill (one C++ pass, where the torch unpacking took longer than the GEMM)."""
    return _ops().gemv_dequant_tiles(tiles, params)

