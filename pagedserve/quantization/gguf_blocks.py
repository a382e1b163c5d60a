"""GGUF's quantized blocks -> this package's int8 / int4 layouts, without requantizing.

The seam for serving a user's quantized GGUF file as it is: the GGUF loader hands over a
tensor's raw bytes (uint8) and its (out, in) shape; these functions return the values the
matching LinearMethod installs with its `set_quantized`:

    Q8_0  blocks of 32: float16 d, 32 x int8 q          w = d * q
          -> Int8GroupedLinearMethod (group 32): exactly the same numbers
    Q4_0  blocks of 32: float16 d, 16 bytes of nibbles  w = d * (q - 8)
    Q4_1  blocks of 32: float16 d, float16 m, 16 bytes  w = d * q + m
          -> Int4LinearMethod (group 32): w = (q - 8) * scale + zero, so scale = d and
             zero = m + 8 d (Q4_0: zero = 0). q is kept as is; scale and zero are stored
             in bfloat16 (the int4 kernel's dtype), a 2^-9 relative rounding of d and m.

Nibble order inside a block (ggml): byte j holds q[j] in its low nibble and q[j + 16] in its
high nibble.
"""

from __future__ import annotations

import torch

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
    packed = blocks[..., offset : offset + BLOCK // 2]
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


def from_gguf_q4_1(raw: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 bytes -> (q uint8 (out, in), scale, zero float32 (in / 32, out)) for Int4LinearMethod."""
    blocks = _blocks(raw, shape, 4 + BLOCK // 2)
    d, m = _half(blocks, 0), _half(blocks, 2)
    return _nibbles(blocks, 4, shape), d.t().contiguous(), (m + 8 * d).t().contiguous()
