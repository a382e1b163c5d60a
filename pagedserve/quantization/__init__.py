"""Weight-only linear quantization (int8, int4) applied at load time, and the int8 KV cache.

    base.py          the per-layer interface: LinearMethod (create_weights / process / apply)
    int8_grouped.py  int8 with a float16 scale per 32 input columns (llama.cpp's Q8_0): the
                     default int8
    int8.py          per-output-channel symmetric int8 (group_size -1), own AVX512-BF16
                     kernel or torch's CPU int8 kernel, bf16 activations
    int4.py          group-wise affine int4 (a scale and a zero per group, like Q4_1),
                     the decode GEMV kernel (AVX2) or torch's CPU int4 kernel + bf16 GEMM
    gguf_decode.py   a GGUF file's quantized blocks -> integers and per-group float parameters,
                     exactly (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)
    gguf_blocks.py   "gguf" (the default for a quantized .gguf file): those numbers served as
                     they are, in int4 / 5- / 6-bit / int8 channel tiles
    kv_int8.py       int8 K/V rows with a per-token-per-head float32 scale

The loader (models/loader.py) attaches a method to every linear layer of the base model
before loading, and quantizes each layer as soon as its last shard is loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The settings are the config's (one home for every setting); re-exported for callers here.
from pagedserve.config import (
    DEFAULT_GROUP_SIZES,
    GROUP_SIZES,
    PER_CHANNEL,
    QUANTIZATION_METHODS,
    QuantizationConfig,
)
from pagedserve.quantization.selector import DEFAULT_INT8_ACTIVATIONS

if TYPE_CHECKING:
    from pagedserve.quantization.base import LinearMethod, UnquantizedLinearMethod

__all__ = [
    "DEFAULT_GROUP_SIZES", "DEFAULT_INT8_ACTIVATIONS", "GROUP_SIZES", "PER_CHANNEL", "QUANTIZATION_METHODS",
    "LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod",
]


def __getattr__(name: str) -> Any:
    # The methods (torch) load on first use, so that importing this package for its
    # settings does not pull torch in.
    if name in ("LinearMethod", "UnquantizedLinearMethod"):
        from pagedserve.quantization import base

        return getattr(base, name)
    raise AttributeError(f"module 'pagedserve.quantization' has no attribute {name!r}")
