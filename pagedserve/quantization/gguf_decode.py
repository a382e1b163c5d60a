"""A GGUF tensor's quantized blocks -> integers and per-group float parameters, exactly.

Every type here is, per group of g consecutive input columns of an output row,

    W[n, k] = q[n, k] * s[n, k // g]  (+ l0[n, k // g])

with q a small integer and s, l0 float32 numbers that `gguf.dequantize` itself multiplies and
adds in float32, so q * s (+ l0) computed in float32 is gguf's value bit for bit (q * s is
exact: s has at most 19 significant bits and q at most 8; gguf's `d * q - dm` is q * s + l0
with l0 = -dm, one rounding either way). The GEMV kernels (quantization/gemv.py) multiply x by
q and fold s and l0 in once per group: nothing is requantized.

    type    block  g   q                         s                  l0
    Q8_0    32     32  int8                       d (float16)        -
    Q5_0    32     32  q5 - 16   in [-16, 15]     d (float16)        -
    IQ4_NL  32     32  kvalues[q4] in [-127, 113] d (float16)        -
    Q6_K    256    16  q6 - 32   in [-32, 31]     d * sc (int8 sc)   -
    IQ4_XS  256    32  kvalues[q4]                d * (sc6 - 32)     -
    Q4_0    32     32  q4        in [0, 15]       d                  -8 d
    Q4_1    32     32  q4                         d                  m
    Q5_1    32     32  q5        in [0, 31]       d                  m
    Q4_K    256    32  q4                         d * sc6            -dmin * m6
    Q5_K    256    32  q5                         d * sc6            -dmin * m6

(d, dmin, m: the block's float16 numbers; sc6 / m6: Q4_K's packed 6-bit sub-block scales.)
The unpacking mirrors gguf's own `quants.py` (numpy), so a test against `gguf.dequantize` on
the package's own quantized blocks checks the bit layouts.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

# GGUF type -> (weights per block, bytes per block).
BLOCKS = {
    "Q8_0": (32, 34), "Q5_0": (32, 22), "IQ4_NL": (32, 18), "Q4_0": (32, 18), "Q4_1": (32, 20),
    "Q5_1": (32, 24), "Q6_K": (256, 210), "IQ4_XS": (256, 136), "Q4_K": (256, 144),
    "Q5_K": (256, 176),
}
# Types whose parameters are exact in float16 (the rest need float32: d times a sub-block scale).
HALF_SCALES = ("Q8_0", "Q5_0", "IQ4_NL")
AFFINE = ("Q4_0", "Q4_1", "Q5_1", "Q4_K", "Q5_K")  # with a level 0 (l0)
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")  # q in [0, 15]: int4 channel tiles can hold them
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclasses.dataclass(frozen=True)
class Decoded:
    """One (out, in) weight as W = q * scale (+ level0) per group of `group` columns."""

    q: torch.Tensor  # int16 (out, in)
    scale: torch.Tensor  # float32 (out, in / group)
    level0: torch.Tensor | None  # float32 (out, in / group), or None (0)
    group: int

    def regrouped(self, group: int) -> Decoded:
        """The same weight with the parameters repeated for a smaller group (exact)."""
        if group == self.group:
            return self
        r = self.group // group
        l0 = None if self.level0 is None else self.level0.repeat_interleave(r, dim=1)
        return Decoded(self.q, self.scale.repeat_interleave(r, dim=1), l0, group)

    def dequantize(self) -> torch.Tensor:
        """float32 (out, in): gguf.dequantize's numbers."""
        out, inp = self.q.shape
        w = self.q.float().view(out, -1, self.group) * self.scale[..., None]
        if self.level0 is not None:
            w = w + self.level0[..., None]
        return w.view(out, inp)


def decode(qtype: str, raw: torch.Tensor, shape: tuple[int, int]) -> Decoded:
    """A tensor's raw blocks (uint8, any shape holding out * in / block blocks) -> Decoded.

    Raises:
        ValueError: a type not in BLOCKS, or in_features not a multiple of its block.
    """
    if qtype not in BLOCKS:
        raise ValueError(f"GGUF type {qtype} has no exact integer form here")
    out_features, in_features = shape
    blocks = _block_rows(qtype, raw, shape)
    q, s, l0, group = _DECODERS[qtype](blocks)
    groups = in_features // group
    return Decoded(
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.int16)).reshape(out_features, in_features),
        torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)).reshape(out_features, groups),
        None if l0 is None else torch.from_numpy(np.ascontiguousarray(l0, dtype=np.float32)).reshape(
            out_features, groups),
        group,
    )


_Parts = tuple[np.ndarray, np.ndarray, "np.ndarray | None", int]


def _half(b: np.ndarray) -> np.ndarray:
    return b.copy().view(np.float16).astype(np.float32)[:, 0]


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """(n, 16) bytes -> (n, 32): byte j's low nibble is q[j], its high nibble q[j + 16]."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes, a little-endian uint32 -> (n, 32): bit j."""
    bits = qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)[None, :]
    return (bits & 1).astype(np.uint8)


def _q8_0(b: np.ndarray) -> _Parts:
    return b[:, 2:].copy().view(np.int8), _half(b[:, :2]), None, 32


def _q4_0(b: np.ndarray) -> _Parts:
    d = _half(b[:, :2])
    return _nibbles32(b[:, 2:]), d, -8 * d, 32


def _q4_1(b: np.ndarray) -> _Parts:
    return _nibbles32(b[:, 4:]), _half(b[:, :2]), _half(b[:, 2:4]), 32


def _q5_0(b: np.ndarray) -> _Parts:
    q = _nibbles32(b[:, 6:]) | (_high_bits32(b[:, 2:6]) << 4)
    return q.astype(np.int16) - 16, _half(b[:, :2]), None, 32


def _q5_1(b: np.ndarray) -> _Parts:
    q = _nibbles32(b[:, 8:]) | (_high_bits32(b[:, 4:8]) << 4)
    return q, _half(b[:, :2]), _half(b[:, 2:4]), 32


def _iq4_nl(b: np.ndarray) -> _Parts:
    values = np.array(IQ4_KVALUES, dtype=np.int16)
    return values[_nibbles32(b[:, 2:])], _half(b[:, :2]), None, 32


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (gguf's get_scale_min)."""
    n = scales.shape[0]
    d, m, m_d = (scales.reshape(n, 3, 4)[:, i] for i in range(3))
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_params(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: (s, l0) per sub-block of 32, (n, 8) float32 as gguf computes them."""
    d, dmin = _half(b[:, :2])[:, None], _half(b[:, 2:4])[:, None]
    sc, mn = _k_scale_min(b[:, 4:16])
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 128) -> (n, 8, 32): sub-block 2c takes chunk c's low nibbles, 2c + 1 its high."""
    chunks = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(-1, 8, 32)


def _q4_k(b: np.ndarray) -> _Parts:
    s, l0 = _k_params(b)
    return _k_low_nibbles(b[:, 16:]), s, l0, 32


def _q5_k(b: np.ndarray) -> _Parts:
    s, l0 = _k_params(b)
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return _k_low_nibbles(b[:, 48:]) | ((qh & 1) << 4), s, l0, 32


def _q6_k(b: np.ndarray) -> _Parts:
    low = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((low & 0x0F).reshape(-1, 8, 32) | ((high & 0x03).reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    return q, _half(b[:, 208:210])[:, None] * sc, None, 16


def _iq4_xs(b: np.ndarray) -> _Parts:
    d = _half(b[:, :2])[:, None]
    scales_h = b[:, 2:4].copy().view(np.uint16) >> np.arange(0, 16, 2, dtype=np.uint16)[None, :]
    scales_l = b[:, 4:8].reshape(-1, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)
    sc = ((scales_l.reshape(-1, 8) & 0x0F) | ((scales_h.astype(np.uint8) & 0x03) << 4)).astype(np.int16) - 32
    qs = b[:, 8:].reshape(-1, 8, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    values = np.array(IQ4_KVALUES, dtype=np.int16)
    return values[(qs & 0x0F).reshape(-1, 8, 32)], d * sc.astype(np.float32), None, 32


# ---- K-quants' parameters as the file holds them (integers and float16) ----------------------

K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # super-blocks of 256 whose s / l0 come from integers


@dataclasses.dataclass(frozen=True)
class KParts:
    """A K-quant tensor's parameters before gguf multiplies them: per super-block of 256 float16
    d and dmin, per group of `group` an integer scale sc and min m, so that gguf's
    s = float32(d) * sc and l0 = -(float32(dmin) * m) (Q6_K: dmin = m = 0, and its q is
    centered: see `decode`)."""

    d: torch.Tensor  # float16 (out, in / 256)
    dmin: torch.Tensor  # float16 (out, in / 256)
    sc: torch.Tensor  # int8 (out, in / group)
    m: torch.Tensor  # int8 (out, in / group), 0..63
    group: int

    def regrouped(self, group: int) -> KParts:
        """The same parameters for a smaller group (repeated: exact)."""
        r = self.group // group
        return KParts(self.d, self.dmin, self.sc.repeat_interleave(r, dim=1),
                      self.m.repeat_interleave(r, dim=1), group)


def k_parts(qtype: str, raw: torch.Tensor, shape: tuple[int, int]) -> KParts:
    """A K-quant tensor's raw blocks -> its KParts (the integers `decode` multiplies out)."""
    if qtype not in K_TYPES:
        raise ValueError(f"{qtype} is not a K-quant with integer sub-block scales")
    out_features, in_features = shape
    b = _block_rows(qtype, raw, shape)
    if qtype == "Q6_K":
        d = b[:, 208:210].copy().view(np.float16)[:, 0]
        dmin = np.zeros_like(d)
        sc = b[:, 192:208].copy().view(np.int8)
        mn = np.zeros_like(sc)
        group = 16
    else:
        d, dmin = b[:, 0:2].copy().view(np.float16)[:, 0], b[:, 2:4].copy().view(np.float16)[:, 0]
        sc6, m6 = _k_scale_min(b[:, 4:16])
        sc, mn = sc6.astype(np.int8), m6.astype(np.int8)
        group = 32
    blocks = in_features // BLOCKS[qtype][0]
    return KParts(
        torch.from_numpy(np.ascontiguousarray(d)).reshape(out_features, blocks),
        torch.from_numpy(np.ascontiguousarray(dmin)).reshape(out_features, blocks),
        torch.from_numpy(np.ascontiguousarray(sc)).reshape(out_features, -1),
        torch.from_numpy(np.ascontiguousarray(mn)).reshape(out_features, -1),
        group,
    )


_DECODERS = {
    "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
    "IQ4_NL": _iq4_nl, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "IQ4_XS": _iq4_xs,
}


def _block_rows(qtype: str, raw: torch.Tensor, shape: tuple[int, int]) -> np.ndarray:
    """The tensor's raw bytes as one row per block; in_features must hold whole blocks."""
    per_block, nbytes = BLOCKS[qtype]
    if shape[1] % per_block:
        raise ValueError(f"GGUF {qtype} needs in_features % {per_block} == 0, got {shape}")
    return raw.reshape(-1).numpy().view(np.uint8).reshape(-1, nbytes)
