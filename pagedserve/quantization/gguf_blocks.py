"""GGUF's quantized blocks -> this package's int8 / int4 layouts, without requantizing.

The seam for serving a user's quantized GGUF file as it is: the GGUF loader hands over a
tensor's raw bytes (uint8) and its (out, in) shape; these functions return the values the
matching LinearMethod installs with its `set_quantized`:

    Q8_0  blocks of 32: float16 d, 32 x int8 q          w = d * q
          -> Int8GroupedLinearMethod (group 32): exactly the same numbers
    Q4_0  blocks of 32: float16 d, 16 bytes of nibbles  w = d * (q - 8)
    Q4_1  blocks of 32: float16 d, float16 m, 16 bytes  w = d * q + m
          -> Int4LinearMethod (group 32): where the decode GEMV kernel runs, q, d and m
             as stored (float16 d, m; Q4_0: m = -8 d), the same numbers
             (`gguf_q4_values`, `set_quantized_gguf`); for torch's int4 kernel
             w = (q - 8) * scale + zero, so scale = d and zero = m + 8 d (Q4_0: zero = 0),
             stored in bfloat16 (its dtype), a 2^-9 relative rounding of d and m.

Nibble order inside a block (ggml): byte j holds q[j] in its low nibble and q[j + 16] in its
high nibble.

`--quantization gguf` (models/loader.py) gives each linear layer whose tensors are all Q8_0
`GGUFInt8Method`, all Q4_0 / Q4_1 `GGUFInt4Method` (`gguf_method`): these take the raw blocks
through the layer's weight loader and install the decoded values above. A layer with a float
tensor (F32 / F16 / BF16), or with int8 and int4 shards mixed (e.g. q Q8_0, k Q4_1, fused into
one qkv_proj), loads dequantized like the embedding and the LM head.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator

import torch
from torch import nn

from pagedserve.quantization import gemv
from pagedserve.quantization.base import LinearCall, LinearMethod, add_bias, linear_call
from pagedserve.quantization.gguf_decode import (
    BLOCKS,
    FOUR_BIT,
    HALF_SCALES,
    K_TYPES,
    Decoded,
    KParts,
    decode,
    k_parts,
)
from pagedserve.quantization.int4 import Int4LinearMethod
from pagedserve.quantization.int8_grouped import Int8GroupedLinearMethod
from pagedserve.quantization.selector import DEFAULT_GGUF_ACTIVATIONS

BLOCK = 32


def _blocks(raw: torch.Tensor, shape: tuple[int, int], block_bytes: int) -> torch.Tensor:
    out_features, in_features = shape
    if in_features % BLOCK:
        raise ValueError(f"GGUF block tensors need in_features % {BLOCK} == 0, got {shape}")
    return raw.reshape(-1).view(torch.uint8).reshape(out_features, in_features // BLOCK, block_bytes)


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as float32 (out, in / 32)."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(blocks: torch.Tensor, offset: int, shape: tuple[int, int]) -> torch.Tensor:
    packed = blocks[..., offset : offset + BLOCK // 2].contiguous()  # vectorized ops below
    return torch.cat((packed & 15, packed >> 4), dim=-1).reshape(shape)


def from_gguf_q8_0(raw: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 bytes -> (q int8 (out, in), scale float16 (out, in / 32)) for Int8GroupedLinearMethod."""
    blocks = _blocks(raw, shape, 2 + BLOCK)
    scale = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1)
    q = blocks[..., 2:].contiguous().view(torch.int8).reshape(shape)
    return q, scale


def from_gguf_q4_0(raw: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 bytes -> (q uint8 (out, in), scale, zero float32 (in / 32, out)) for Int4LinearMethod."""
    blocks = _blocks(raw, shape, 2 + BLOCK // 2)
    d = _half(blocks, 0)
    return _nibbles(blocks, 2, shape), d.t().contiguous(), torch.zeros_like(d).t().contiguous()


def gguf_q4_values(raw: torch.Tensor, shape: tuple[int, int], qtype: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 / Q4_1 bytes -> (q uint8 (out, in), d, m float16 (in / 32, out)), W = q * d + m
    exactly as stored (Q4_0: m = -8 d, exact in float16) for Int4LinearMethod.set_quantized_gguf."""
    if qtype == "Q4_1":
        blocks = _blocks(raw, shape, 4 + BLOCK // 2)
        d, m = _half(blocks, 0), _half(blocks, 2)
        q = _nibbles(blocks, 4, shape)
    else:
        blocks = _blocks(raw, shape, 2 + BLOCK // 2)
        d = _half(blocks, 0)
        m, q = -8 * d, _nibbles(blocks, 2, shape)
    return q, d.t().to(torch.float16).contiguous(), m.t().to(torch.float16).contiguous()


def from_gguf_q4_1(raw: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 bytes -> (q uint8 (out, in), scale, zero float32 (in / 32, out)) for Int4LinearMethod."""
    blocks = _blocks(raw, shape, 4 + BLOCK // 2)
    d, m = _half(blocks, 0), _half(blocks, 2)
    return _nibbles(blocks, 4, shape), d.t().contiguous(), (m + 8 * d).t().contiguous()


def _exact_gemm(layer: nn.Module, x: torch.Tensor, tiles: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """x (..., in) @ W^T (+ b) for more rows than the GEMV ops take: the layer's exact weights
    in float32 from one C++ pass over its tiles (`gemv.dequant_tiles`), a float32 GEMM, y in
    x's dtype (the torch unpacking of the tiles took longer than the GEMM)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    y = add_bias((x2 @ gemv.dequant_tiles(tiles, params)).to(x.dtype), layer)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---- linear methods that load a GGUF file's blocks ---------------------------------------

# The GGUF types of a linear weight served natively (quantization/gguf_decode.py).
TARGETS = tuple(BLOCKS)
# The two original forms, which also load where the GEMV kernel does not run (torch's kernels).
_Q8_ONLY, _Q4_ONLY = {"Q8_0"}, {"Q4_0", "Q4_1"}


class _GGUFBlocks:
    """Mixin: the weight arrives as `GGUFQuantizedTensor` shards (one per fused projection,
    e.g. q / k / v) and is installed, concatenated along the output rows, with the file's
    numbers (no requantizing).

    `create_weights` registers a placeholder `weight` (no storage) whose loader keeps the
    shards on the layer until `process_weights_after_loading`.
    """

    def create_weights(self, layer: nn.Module) -> None:
        weight = nn.Parameter(torch.empty(0), requires_grad=False)
        weight.weight_loader = functools.partial(_keep_shard, layer)  # type: ignore[attr-defined]
        weight.gguf_blocks = True  # type: ignore[attr-defined]  # the loader hands raw blocks
        layer.weight = weight
        layer.gguf_shards = {}

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not hasattr(layer, "gguf_shards"):
            return  # an LM head: `install_head` installs its blocks after loading
        shards = layer.gguf_shards
        order = list(layer.shard_ids) if getattr(layer, "shard_ids", None) else [None]
        parts = [shards[s] for s in order]
        del layer.weight, layer.gguf_shards
        self._install(layer, parts)  # type: ignore[attr-defined]


def install_head(head: nn.Module, blocks: object, tied: bool) -> None:
    """An LM head whose method is a GGUF one (set before loading, so no full-precision GEMM
    copy was made): install the file's blocks of its weight (`blocks`, the output tensor or
    the tied token embedding), and drop the dense weight unless the embedding shares it."""
    head.quant_method._install(head, [blocks])
    if not tied:
        del head.weight


def _keep_shard(layer: nn.Module, param: torch.Tensor, blocks: object, shard_id: object = None) -> None:
    from pagedserve.models.gguf import GGUFQuantizedTensor

    if not isinstance(blocks, GGUFQuantizedTensor):
        raise ValueError(f"expected GGUF quantized blocks, got {type(blocks).__name__}")
    rows = layer.output_size if shard_id is None else layer.shard_slice(shard_id).stop - layer.shard_slice(shard_id).start
    if blocks.shape != (rows, layer.input_size):
        raise ValueError(f"shape mismatch: parameter {(rows, layer.input_size)}, checkpoint {blocks.shape}")
    layer.gguf_shards[shard_id] = blocks


class GGUFInt8Method(_GGUFBlocks, Int8GroupedLinearMethod):
    """Every type but the 4-bit ones alone (or 4-bit shards fused beside others) as int8
    channel tiles: q as an int8, s per group in float16 where every shard's parameters are
    exact in float16 (Q8_0, Q5_0, IQ4_NL), else float32 (s, l0) pairs; groups of 16 with a Q6_K shard
    (the others' parameters repeated). Q8_0 alone also loads without the GEMV kernel (its
    torch path); the other forms need the kernel (`gguf_method`)."""

    name = "gguf-int8"

    def __init__(self, activations: str = "none") -> None:
        # "int8" takes effect where the parameters are float16 scales (Q8_0's form: the
        # `gemv.int8_q8` kernel); float32 (s, l0) pairs keep float activations.
        super().__init__(BLOCK, activations=activations)

    def _install(self, layer: nn.Module, parts: list[object]) -> None:
        decoded = [decode(p.qtype, p.blocks, p.shape) for p in parts]  # type: ignore[attr-defined]
        group = min(d.group for d in decoded)
        decoded = [d.regrouped(group) for d in decoded]
        q = torch.cat([d.q for d in decoded]).to(torch.int8)
        scale = torch.cat([d.scale for d in decoded])
        if all(p.qtype in HALF_SCALES for p in parts):  # type: ignore[attr-defined]
            # Q8_0's form: exact in float16, and torch's path without the kernel
            self.set_quantized(layer, q, scale.to(torch.float16))
            return
        # float32 parameters come as (s, l0) pairs (l0 = 0 where a shard has none): the op's
        # one float32 form (Q6_K / IQ4_XS beside int8 types are rare in real files).
        level0 = torch.cat([d.level0 if d.level0 is not None else torch.zeros_like(d.scale)
                            for d in decoded])
        tiles, scales = gemv.pack_int8_affine(q, scale, level0)
        layer.register_buffer("qweight_tiles", tiles)
        layer.register_buffer("scale_tiles", scales)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        tiles = getattr(layer, "qweight_tiles", None)
        if tiles is not None and gemv.rows_of(x) > self.decode_max_rows(layer):
            return _exact_gemm(layer, x, tiles, layer.scale_tiles)
        return super().apply(layer, x)


class GGUFInt4Method(_GGUFBlocks, Int4LinearMethod):
    """Q4_0 / Q4_1 / Q4_K blocks as affine int4 (group 32), W = q * d + m: q, d and m as
    stored (float16) for Q4_0 / Q4_1 alone where the GEMV kernel runs (else scale and zero in
    bf16 for torch's kernel, see `set_quantized_gguf`); float32 (s, l0) with a Q4_K shard
    (gguf_decode.py; needs the kernel)."""

    name = "gguf-q4"

    def __init__(self) -> None:
        super().__init__(BLOCK)

    def _install(self, layer: nn.Module, parts: list[object]) -> None:
        if all(p.qtype in _Q4_ONLY for p in parts):  # type: ignore[attr-defined]
            values = [gguf_q4_values(p.blocks, p.shape, p.qtype) for p in parts]  # type: ignore[attr-defined]
            q = torch.cat([v[0] for v in values])
            d = torch.cat([v[1] for v in values], dim=1)
            m = torch.cat([v[2] for v in values], dim=1)
            self.set_quantized_gguf(layer, q, d, m)
            return
        decoded = [decode(p.qtype, p.blocks, p.shape) for p in parts]  # type: ignore[attr-defined]
        q = torch.cat([d.q for d in decoded]).to(torch.uint8)
        s = torch.cat([d.scale for d in decoded]).t().contiguous()
        l0 = torch.cat([d.level0 for d in decoded if d.level0 is not None]).t().contiguous()
        self.set_quantized_gguf(layer, q, s, l0)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        tiles = getattr(layer, "qweight_tiles", None)
        if tiles is not None and gemv.rows_of(x) > self.decode_max_rows(layer):
            return _exact_gemm(layer, x, tiles, layer.scales_zeros_tiles)
        return super().apply(layer, x)


# Types of at most 6 bits that `GGUFBitsMethod` holds in 5- or 6-bit tiles; CENTERED ones are
# decoded as q - CENTERED[type] (gguf_decode), stored as q - center + 2^(bits-1) >= 0.
BITS_TYPES = {"Q5_0", "Q6_K", "Q5_1", "Q5_K", "Q4_K", "Q4_0", "Q4_1"}
CENTERED = {"Q5_0": 16, "Q6_K": 32}


class GGUFBitsMethod(_GGUFBlocks, LinearMethod):
    """Q5_0 / Q6_K (and the affine 4- and 5-bit types beside them) in the file's own number of
    bits: `gemv.pack_bits` channel tiles of 5 bits (6 with a Q6_K shard), so a decode step
    reads ~as many bytes as llama.cpp does (Q5_0: 0.69 bytes a weight, where int8 tiles read
    1.06), and the `gemv_int4_grouped` op multiplies them.

    Parameters: Q5_0 alone: its float16 d per 32, W = (q - 16) d ("centered": the kernel adds
    -16 d times the group's sum of x); Q6_K: float32 d * sc per 16 (its shards set groups of 16
    for all), W = (q - 32) s; a shard with a level 0 (Q5_1, Q5_K, Q4_K): float32 (s, l0) pairs
    for all, a centered shard's l0 = -2^(bits-1) s (exact).

    K-quants alone (Q4_K / Q5_K / Q6_K, any mix; Q4_K in 4-bit tiles): the file's own
    parameters per super-block of 256 (`pack_superblock_params`; Q4_K / Q5_K alone packed in
    6 bits as the file packs them: `pack_packed_superblock_params`), multiplied out by the kernel.

    int8 activations: a fused layer whose shards have different types holds each run of shards
    of one type in its own bits and parameters (`bit_parts` parts, qweight_quads_i /
    scale_tiles_i, one `gemv_bits_q8_parts` call), so a K-quant layer holds exactly the file's
    bytes.

    Layer tensors: qweight_tiles (out/16, in, 8, 10 or 12) uint8 or qweight_quads (out/16, in/32,
    256, 320 or 384) uint8; scale_tiles (out/16, in / g, 16) float16 / float32, (out/16, in / g,
    2, 16) float32, or uint8 super-block parameters (out/16, in / 256, B). Needs the GEMV kernel
    (`gguf_method`).
    """

    name = "gguf-bits"
    converts_weight_per_call = True  # dequantized for the GEMM past gemv.CHUNKED_MAX_ROWS

    def __init__(self, activations: str = "none") -> None:
        # "int8": x rounded to int8 per block of 32 and the weights kept as integers
        # (`gemv.bits_q8` on `pack_bit_quads`, llama.cpp's K-quant x q8 dot products) at every
        # row count; "none": float32 x times the weights widened to float32 (channel tiles).
        self.activations = activations

    def _install(self, layer: nn.Module, parts: list[object]) -> None:
        # int8 activations: each run of shards of one type in its own bits and parameters (a
        # Q4_K_M qkv's q, k in Q4_K's 4.5 bits a weight and v in Q6_K's 6.56, where one layout
        # for all stored q and k in 6 bits with per-16 parameters: 2.82 against the file's
        # 1.87 MB a layer of the 1.5B), multiplied by one `gemv_bits_q8_parts` call.
        # (Every type here has groups of 16 or 32, so every part can be bit quads.)
        runs = [parts]
        if self.activations == "int8":
            runs = [list(run) for _, run in itertools.groupby(parts, key=lambda p: p.qtype)]  # type: ignore[attr-defined]
        laid = [self._layout(run) for run in runs]
        if len(laid) > 1:
            for i, (q, bits, _, params) in enumerate(laid):
                layer.register_buffer(f"qweight_quads_{i}", gemv.pack_bit_quads(q, bits))
                layer.register_buffer(f"scale_tiles_{i}", params)
            layer.bit_parts = len(laid)
            return
        q, bits, group, params = laid[0]
        if self.activations == "int8" and group in (16, 32):
            layer.register_buffer("qweight_quads", gemv.pack_bit_quads(q, bits))
        else:
            layer.register_buffer("qweight_tiles", gemv.pack_bits(q, bits))
        layer.register_buffer("scale_tiles", params)

    def _layout(self, parts: list[object]) -> tuple[torch.Tensor, int, int, torch.Tensor]:
        """Shards -> (q (out, in) uint8, bits, group, parameters) of one layout for them all."""
        qtypes = [p.qtype for p in parts]  # type: ignore[attr-defined]
        decoded = [decode(p.qtype, p.blocks, p.shape) for p in parts]  # type: ignore[attr-defined]
        if set(qtypes) <= set(K_TYPES):
            return self._superblocks(parts, decoded)
        bits = 6 if "Q6_K" in qtypes else 5
        center = 1 << (bits - 1)
        group = min(d.group for d in decoded)
        decoded = [d.regrouped(group) for d in decoded]
        q = torch.cat([d.q + (center if t in CENTERED else 0) for t, d in zip(qtypes, decoded, strict=True)])
        scale = torch.cat([d.scale for d in decoded])
        if all(t in CENTERED for t in qtypes):
            half = all(t in HALF_SCALES for t in qtypes)
            params = scale.to(torch.float16 if half else torch.float32)
            out_features = params.shape[0]
            params = params.view(out_features // gemv.TILE, gemv.TILE, -1).transpose(1, 2).contiguous()
        else:
            level0 = torch.cat([d.level0 if d.level0 is not None else -center * d.scale for d in decoded])
            params = gemv.pack_affine_params(scale, level0)
        return q.to(torch.uint8), bits, group, params

    def _superblocks(self, parts: list[object], decoded: list[Decoded]) -> tuple[torch.Tensor, int, int, torch.Tensor]:
        """K-quants alone (Q4_K / Q5_K / Q6_K, any mix): the widest type's bits and the file's
        own parameters per super-block (`pack_superblock_params`), ~the file's bytes; Q4_K /
        Q5_K alone in their packed 6-bit form, the file's bytes exactly."""
        qtypes = [p.qtype for p in parts]  # type: ignore[attr-defined]
        bits = 6 if "Q6_K" in qtypes else 5 if "Q5_K" in qtypes else 4
        center = 1 << (bits - 1)
        kparts = [k_parts(p.qtype, p.blocks, p.shape) for p in parts]  # type: ignore[attr-defined]
        group = min(k.group for k in kparts)
        kparts = [k.regrouped(group) for k in kparts]
        q = torch.cat([d.q + (center if t in CENTERED else 0) for t, d in zip(qtypes, decoded, strict=True)])
        merged = KParts(torch.cat([k.d for k in kparts]), torch.cat([k.dmin for k in kparts]),
                        torch.cat([k.sc for k in kparts]), torch.cat([k.m for k in kparts]), group)
        if not any(t in CENTERED for t in qtypes) and group == 32:
            return q.to(torch.uint8), bits, group, pack_packed_superblock_params(merged)
        centers = None
        if not all(t in CENTERED for t in qtypes):  # affine: Q6_K shards keep their center per channel
            centers = torch.cat([torch.full((k.sc.shape[0],), center if t in CENTERED else 0, dtype=torch.uint8)
                                 for t, k in zip(qtypes, kparts, strict=True)])
        return q.to(torch.uint8), bits, group, pack_superblock_params(merged, centers)

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        return [t for q, params in _quad_parts(layer) for t in (q, params)]

    def decode_op(self, layer: nn.Module) -> LinearCall | None:
        call = self.gemm_op(layer)
        if call is not None:
            return call
        return linear_call("gemv_int4_grouped", layer.qweight_tiles, layer.scale_tiles,
                           bias=getattr(layer, "bias", None))

    def dequantized_weight(self, layer: nn.Module, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The (out, in) weight: gguf.dequantize's numbers (in float32, then `dtype`)."""
        return torch.cat([w for q, params in _quad_parts(layer) for w in _bits_blocks(q, params, dtype)])

    def decode_max_rows(self, layer: nn.Module) -> int:
        # int8 activations: past gemv.MAX_ROWS the same kernel on all rows at once (`gemm_op`),
        # not in 32-row calls: each call streams the weight again, and 32 rows make worse
        # register blocks (12 + 12 + 8) than the whole step (a batch-48 decode: 12 x 4).
        if _has_quads(layer):
            return gemv.MAX_ROWS
        return super().decode_max_rows(layer)

    def gemm_op(self, layer: nn.Module) -> LinearCall | None:
        if not _has_quads(layer):
            return None
        bias = getattr(layer, "bias", None)
        parts = _quad_parts(layer)
        if len(parts) == 1:
            return linear_call("gemv_bits_q8", *parts[0], bias=bias)
        return linear_call("gemv_bits_q8_parts", *[q for q, _ in parts], *[p for _, p in parts], bias=bias)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(layer, "bias", None)
        if _has_quads(layer):
            parts = _quad_parts(layer)
            if x.dtype in gemv.X_DTYPES:  # every row count: a prefill too (see gemv.bits_q8)
                if len(parts) == 1:
                    return gemv.bits_q8(x, *parts[0], bias)
                return gemv.bits_q8_parts(x, [q for q, _ in parts], [p for _, p in parts], bias)
            x2 = gemv.q8_round_trip(x.reshape(-1, x.shape[-1])).float()  # float16: the same function
            y = add_bias((x2 @ self.dequantized_weight(layer).t()).to(x.dtype), layer)
            return y.reshape(*x.shape[:-1], y.shape[-1])
        tiles, params = layer.qweight_tiles, layer.scale_tiles
        if x.dtype in gemv.X_DTYPES:
            rows = gemv.rows_of(x)
            if rows <= gemv.MAX_ROWS:  # a decode step: one op, x as it is
                return gemv.int4_grouped(x, tiles, params, bias)
            if rows <= self.decode_max_rows(layer):
                return gemv.in_chunks(gemv.int4_grouped, x, tiles, params, bias)
        return _exact_gemm(layer, x, tiles, params)


def _has_quads(layer: nn.Module) -> bool:
    return hasattr(layer, "qweight_quads") or hasattr(layer, "bit_parts")


def _quad_parts(layer: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A `GGUFBitsMethod` layer's (weight, parameters) per part, in output order: one pair
    (bit quads or channel tiles), or its parts' (`bit_parts`)."""
    parts = getattr(layer, "bit_parts", 0)
    if parts:
        return [(getattr(layer, f"qweight_quads_{i}"), getattr(layer, f"scale_tiles_{i}")) for i in range(parts)]
    quads = getattr(layer, "qweight_quads", None)
    return [(quads if quads is not None else layer.qweight_tiles, layer.scale_tiles)]  # type: ignore[list-item]


def _bits_blocks(tiles: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The weight of bit quads or channel tiles `tiles` with `params`, (16 T, in) in `dtype` per
    block of T tiles (~4 MiB of float32): (q - center) * s, or q * s + l0 (q * s exact, one
    rounding: gguf's)."""
    quads = tiles.dim() == 3 and tiles.shape[2] >= 256
    unpack = gemv.unpack_bit_quads if quads else gemv.unpack_bits
    num_tiles = tiles.shape[0]
    in_features = tiles.shape[1] * 32 if quads else tiles.shape[1]
    bits = 4 + (tiles.shape[2] - 256) // 64 if quads else 4 + (tiles.shape[2] - 8) // 2
    center = 1 << (bits - 1)
    if params.dtype == torch.uint8:
        params = superblock_params_as_float(params, center)
    groups = params.shape[1]
    step = max(1, (1 << 20) // (in_features * gemv.TILE))
    for t in range(0, num_tiles, step):
        q = unpack(tiles[t : t + step]).float()  # (16 T, in)
        p = params[t : t + step].float()
        rows = q.shape[0]
        q = q.view(rows, groups, in_features // groups)
        if p.dim() == 3:  # (T, G, 16) scales of q - center
            w = (q - center) * p.transpose(1, 2).reshape(rows, groups)[..., None]
        else:
            s = p[:, :, 0].transpose(1, 2).reshape(rows, groups)
            w = q * s[..., None] + p[:, :, 1].transpose(1, 2).reshape(rows, groups)[..., None]
        yield w.view(rows, in_features).to(dtype)


# ---- K-quants' parameters in the file's bytes ("super-block parameters", csrc/gemv_cpu.cpp's
# KParams): float32 (s, l0) pairs per channel and group cost 8 bytes a 32 weights (Q4_K: 2 bits a
# weight beside the file's 0.5), and a decode step read 1.6-1.8x the file's bytes; these are
# 0.56-0.66 bits a weight, and the kernel multiplies s = d * sc and dm = dmin * m out in float32
# per group, the same single roundings gguf.dequantize makes.

# bytes before the groups in a super-block: affine d, dmin (float16), center (uint8); centered d
_AFFINE_HEAD, _CENTERED_HEAD = 80, 32


def _by_tile(x: torch.Tensor) -> torch.Tensor:
    """(out, S, G, b) uint8 -> (out / 16, S, G * 16 * b): the 16 channels of a tile contiguous."""
    out_features, supers, groups, nbytes = x.shape
    tiles = x.view(out_features // gemv.TILE, gemv.TILE, supers, groups, nbytes).permute(0, 2, 3, 1, 4)
    return tiles.reshape(out_features // gemv.TILE, supers, groups * gemv.TILE * nbytes)


def _halves_by_tile(x: torch.Tensor) -> torch.Tensor:
    """float16 (out, S) -> (out / 16, S, 32): a tile's 16 channels' values, per super-block."""
    out_features, supers = x.shape
    return _by_tile(x.contiguous().view(torch.uint8).view(out_features, supers, 1, 2))


def pack_superblock_params(k: KParts, centers: torch.Tensor | None) -> torch.Tensor:
    """K-quant parameters (out rows) -> uint8 (out / 16, in / 256, B) per tile and super-block:
    centered (`centers` None: every shard Q6_K, W = (q - 2^(bits-1)) d sc), B = 32 + 16 G:
    d float16[16], then per group sc int8[16]; else B = 80 + 32 G: d, dmin float16[16], the
    channels' centers uint8[16] (32 for a Q6_K shard, 0 for Q4_K / Q5_K), then per group
    sc int8[16], m int8[16]: W = q d sc - center d sc - dmin m (G = 256 / group)."""
    out_features, supers = k.d.shape
    groups = k.sc.shape[1] // supers
    sc = k.sc.view(torch.uint8).view(out_features, supers, groups, 1)
    if centers is None:
        return torch.cat((_halves_by_tile(k.d), _by_tile(sc)), dim=-1).contiguous()
    c = centers.view(out_features, 1, 1, 1).expand(out_features, supers, 1, 1)
    pairs = torch.cat((sc, k.m.view(torch.uint8).view(out_features, supers, groups, 1)), dim=-1)
    pairs = pairs.view(out_features // gemv.TILE, gemv.TILE, supers, groups, 2).permute(0, 2, 3, 4, 1)
    pairs = pairs.reshape(out_features // gemv.TILE, supers, groups * 2 * gemv.TILE)
    return torch.cat((_halves_by_tile(k.d), _halves_by_tile(k.dmin), _by_tile(c), pairs), dim=-1).contiguous()


# Q4_K / Q5_K alone (csrc's KPackedParams): d, dmin and the 6-bit sc, m planes, 256 bytes a tile
# and super-block, 16 a channel: the file's own bytes (the affine form's center byte and whole
# bytes for sc and m made it 21).
PACKED_SUPER_BYTES = 256


def _six_bit_planes(v: torch.Tensor) -> torch.Tensor:
    """(out, S, 8) values in [0, 64) -> (out / 16, S, 96): the low nibbles per group pair
    (group 2i low, 2i + 1 high), then the high 2 bits per 4 groups (group g at bits 2 (g % 4))."""
    out_features, supers, _ = v.shape
    v = v.to(torch.uint8)
    low = (v[..., 0::2] & 15) | ((v[..., 1::2] & 15) << 4)  # (out, S, 4)
    high = (v >> 4).view(out_features, supers, 2, 4) << (2 * torch.arange(4, dtype=torch.uint8))
    high = high.sum(dim=-1, dtype=torch.uint8)  # (out, S, 2)
    return torch.cat((_by_tile(low[..., None]), _by_tile(high[..., None])), dim=-1)


def pack_packed_superblock_params(k: KParts) -> torch.Tensor:
    """Q4_K / Q5_K parameters (groups of 32) -> uint8 (out / 16, in / 256, 256): per tile and
    super-block d, dmin float16[16], then sc's and m's 6-bit planes (`_six_bit_planes`)."""
    out_features, supers = k.d.shape
    if k.group != 32 or k.sc.shape[1] != supers * 8:
        raise ValueError(f"the packed form holds groups of 32, got {k.group}")
    sc, m = (x.view(torch.uint8).view(out_features, supers, 8) for x in (k.sc, k.m))
    return torch.cat((_halves_by_tile(k.d), _halves_by_tile(k.dmin), _six_bit_planes(sc), _six_bit_planes(m)),
                     dim=-1).contiguous()


def _unpack_six_bit_planes(planes: torch.Tensor) -> torch.Tensor:
    """(T, S, 96) -> (T, S, 8, 16) values: the inverse of `_six_bit_planes`."""
    num_tiles, supers, _ = planes.shape
    low = planes[..., :64].reshape(num_tiles, supers, 4, gemv.TILE)
    high = planes[..., 64:].reshape(num_tiles, supers, 2, 1, gemv.TILE)
    low = torch.stack((low & 15, low >> 4), dim=3).reshape(num_tiles, supers, 8, gemv.TILE)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)
    high = ((high >> shifts) & 3).reshape(num_tiles, supers, 8, gemv.TILE)
    return low | (high << 4)


def superblock_params_as_float(params: torch.Tensor, center: int) -> torch.Tensor:
    """`pack_superblock_params`' bytes -> the float32 forms the kernel computes from them:
    (T, in / group, 16) scales of q - center (centered), or (T, in / group, 2, 16) (s, l0)."""
    num_tiles, supers, nbytes = params.shape

    def halves(at: int) -> torch.Tensor:  # (T, S, 1, 16)
        return params[..., at : at + 32].contiguous().view(torch.float16).float()[:, :, None, :]

    d = halves(0)
    if nbytes == PACKED_SUPER_BYTES:  # Q4_K / Q5_K: l0 = -(dmin * m), no center
        s = d * _unpack_six_bit_planes(params[..., 64:160]).float()
        level0 = -(halves(32) * _unpack_six_bit_planes(params[..., 160:]).float())
        return torch.stack((s, level0), dim=3).reshape(num_tiles, supers * 8, 2, gemv.TILE)
    affine = nbytes >= 112 and (nbytes - _AFFINE_HEAD) % 32 == 0
    head = _AFFINE_HEAD if affine else _CENTERED_HEAD
    groups = (nbytes - head) // (32 if affine else 16)
    body = params[..., head:].contiguous().view(torch.int8).view(num_tiles, supers, groups, -1, gemv.TILE)
    s = d * body[:, :, :, 0].float()  # (T, S, G, 16): float32(d) * sc, gguf's rounding
    if not affine:
        return s.reshape(num_tiles, supers * groups, gemv.TILE)
    dmin = halves(32)
    c = params[..., 64:80].float()[:, :, None, :]
    level0 = -(dmin * body[:, :, :, 1].float()) - c * s
    return torch.stack((s, level0), dim=3).reshape(num_tiles, supers * groups, 2, gemv.TILE)


def gguf_method(qtypes: set[str], kernel: bool, activations: str = "none") -> LinearMethod | None:
    """The method for a linear layer whose checkpoint tensors have these GGUF types, or None
    (loaded dequantized: a float tensor among them, a type with no exact integer form, or
    a form only the GEMV kernel serves where it cannot take the layer: `kernel` False).

    4-bit types alone go to int4 channel tiles (half the bytes of int8); Q5_0 / Q6_K (and
    4- / 5-bit types beside them) to 5- / 6-bit tiles; any other mix (Q8_0, IQ4_*) to int8.
    `activations` "auto" (quantization.selector.DEFAULT_GGUF_ACTIVATIONS): int8 for the bit
    tiles (held as bit quads), float for the int8 / int4 layouts; "int8" / "none": all."""
    if not qtypes or not qtypes <= set(TARGETS):
        return None
    bits_activations = DEFAULT_GGUF_ACTIVATIONS if activations == "auto" else activations
    activations = "none" if activations == "auto" else activations
    if qtypes <= _Q8_ONLY:
        return GGUFInt8Method(activations)
    if qtypes <= _Q4_ONLY:
        return GGUFInt4Method()
    if not kernel:
        return None
    if qtypes <= set(K_TYPES):  # the file's parameter bytes (super-block parameters)
        return GGUFBitsMethod(bits_activations)
    if qtypes <= set(FOUR_BIT) and bits_activations == "none":
        return GGUFInt4Method()
    return GGUFBitsMethod(bits_activations) if qtypes <= BITS_TYPES else GGUFInt8Method(activations)
