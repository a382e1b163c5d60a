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

import torch
from torch import nn

from pagedserve.quantization import gemv
from pagedserve.quantization.base import LinearMethod
from pagedserve.quantization.gguf_decode import BLOCKS, FOUR_BIT, HALF_SCALES, decode
from pagedserve.quantization.int4 import Int4LinearMethod
from pagedserve.quantization.int8_grouped import Int8GroupedLinearMethod

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
        shards = layer.gguf_shards
        order = list(layer.shard_ids) if getattr(layer, "shard_ids", None) else [None]
        parts = [shards[s] for s in order]
        del layer.weight, layer.gguf_shards
        self._install(layer, parts)  # type: ignore[attr-defined]


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
    channel tiles: q as an int8, s (and l0) per group, float16 where every shard's parameters
    are exact in float16 (Q8_0, Q5_0, IQ4_NL), else float32; groups of 16 with a Q6_K shard
    (the others' parameters repeated). Q8_0 alone also loads without the GEMV kernel (its
    torch path); the other forms need the kernel (`gguf_method`)."""

    name = "gguf-int8"

    def __init__(self) -> None:
        super().__init__(BLOCK)

    def _install(self, layer: nn.Module, parts: list[object]) -> None:
        decoded = [decode(p.qtype, p.blocks, p.shape) for p in parts]  # type: ignore[attr-defined]
        group = min(d.group for d in decoded)
        decoded = [d.regrouped(group) for d in decoded]
        q = torch.cat([d.q for d in decoded]).to(torch.int8)
        scale = torch.cat([d.scale for d in decoded])
        if all(d.level0 is None for d in decoded):
            half = all(p.qtype in HALF_SCALES for p in parts)  # type: ignore[attr-defined]
            if half:  # Q8_0's form: exact in float16, and torch's path without the kernel
                self.set_quantized(layer, q, scale.to(torch.float16))
                return
            tiles, scales = gemv.pack_int8_grouped(q, scale)
        else:
            level0 = torch.cat([d.level0 if d.level0 is not None else torch.zeros_like(d.scale)
                                for d in decoded])
            tiles, scales = gemv.pack_int8_affine(q, scale, level0)
        layer.register_buffer("qweight_tiles", tiles)
        layer.register_buffer("scale_tiles", scales)


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


def gguf_method(qtypes: set[str], kernel: bool) -> LinearMethod | None:
    """The method for a linear layer whose checkpoint tensors have these GGUF types, or None
    (loaded dequantized: a float tensor among them, a type with no exact integer form, or
    a form only the GEMV kernel serves where it cannot take the layer: `kernel` False).

    4-bit types alone go to int4 channel tiles (half the bytes of int8); any other mix of
    quantized types to int8 channel tiles."""
    if not qtypes or not qtypes <= set(TARGETS):
        return None
    if qtypes <= _Q8_ONLY:
        return GGUFInt8Method()
    if qtypes <= _Q4_ONLY:
        return GGUFInt4Method()
    if not kernel:
        return None
    return GGUFInt4Method() if qtypes <= set(FOUR_BIT) else GGUFInt8Method()
