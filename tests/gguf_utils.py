"""Small Llama-shaped GGUF files the tests write themselves with the `gguf` package."""

from __future__ import annotations

from typing import Any

import numpy as np


def llama_gguf_writer(path: Any, arch: str, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int,
                      vocab: int) -> Any:
    """A GGUFWriter with a Llama-shaped model's metadata (token ids only: no tokenizer);
    the caller adds the tensors and writes the file."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    return writer


# Byte offsets of each block's float16 scales (d, and dmin where there is one) for the types
# `gguf.quants.quantize` cannot produce; the rest of a block (sub-scales, quants, signs, grid
# indices) may be any bytes. Layouts: ggml-common.h (block_q2_K, ..., block_iq4_xs).
_F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
               "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,),
               "IQ1_S": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,)}
# Types with no float16 scale field: IQ1_M spreads its float16 d over the top nibbles of four
# uint16 sub-scales (bytes 48..55); NVFP4 has four unsigned E4M3 scales (bytes 0..3).
_SPECIAL = ("IQ1_M", "NVFP4")


def quantizable_types() -> list[str]:
    """Every quantized type a test can write: those `gguf.quants.quantize` produces, and those
    whose blocks `random_blocks` builds."""
    import gguf

    types = list(_F16_SCALES) + list(_SPECIAL)
    probe = np.zeros((1, 256), dtype=np.float32)
    for qtype in gguf.GGMLQuantizationType:
        if qtype.name in ("F32", "F16") or qtype.name in types:
            continue
        try:
            gguf.quants.quantize(probe, qtype)
        except NotImplementedError:
            continue
        types.append(qtype.name)
    return types


def quantized(weights: np.ndarray, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """`weights` (rows, cols) in GGUF type `qtype`, as bytes for `GGUFWriter.add_tensor(...,
    raw_dtype=...)`: quantized by gguf where it can; otherwise random blocks whose dequantized
    values have about the standard deviation of `weights` (they are not `weights`)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in _F16_SCALES and qtype not in _SPECIAL:
        return gguf.quants.quantize(weights.astype(np.float32), kind)
    return random_blocks(qtype, weights.shape, float(weights.std()), rng)


def random_blocks(qtype: str, shape: tuple[int, ...], std: float, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` for a (rows, cols) tensor whose values have about `std`
    (each block's scale drawn in [0.5, 1.5] times the scale that gives it)."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    spread = rng.uniform(0.5, 1.5, size=len(blocks)).astype(np.float32)
    _set_scales(blocks, qtype, spread)
    unit = float(gguf.quants.dequantize(blocks, kind).std())
    _set_scales(blocks, qtype, spread * std / unit)
    return blocks.reshape(rows, cols // block_size * type_size)


def _set_scales(blocks: np.ndarray, qtype: str, scales: np.ndarray) -> None:
    import gguf

    if qtype == "NVFP4":
        blocks[:, :4] = gguf.quants.NVFP4.fp32_to_ue4m3(2 * scales)[:, None]  # decoded x 0.5
        return
    bits = scales.astype(np.float16).view(np.uint16)
    if qtype == "IQ1_M":
        sub = blocks[:, 48:56].copy().view(np.uint16)  # (n, 4)
        for i in range(4):  # d's bits 4i..4i+3 are the top nibble of sub-scale i
            nibble = ((bits >> (4 * i)) & 0xF).astype(np.uint16)
            sub[:, i] = (sub[:, i] & 0x0FFF) | (nibble << 12)
        blocks[:, 48:56] = sub.view(np.uint8)
        return
    for offset in _F16_SCALES[qtype]:
        blocks[:, offset:offset + 2] = bits.view(np.uint8).reshape(-1, 2)
