"""Weight-only linear quantization (int8, int4) applied at load time, and the int8 KV cache.

    base.py     the per-layer interface: LinearMethod (create_weights / process / apply)
    int8.py     per-output-channel symmetric int8, torch's CPU int8 kernel + bf16 GEMM
    int4.py     group-wise affine int4, torch's CPU int4 kernel + bf16 GEMM
    kv_int8.py  int8 K/V rows with a per-token-per-head float32 scale

The loader (models/loader.py) attaches a method to every linear layer of the base model
before loading, and quantizes each layer as soon as its last shard is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.quantization.base import LinearMethod, UnquantizedLinearMethod

QUANTIZATION_METHODS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class QuantizationConfig:
    """What to quantize and how.

    Args:
        method: "int8" (per output channel, symmetric) or "int4" (group-wise, affine).
        group_size: int4 group along the input dim (32, 64, 128 or 256).
        quantize_lm_head: also quantize the LM head (embeddings always stay full precision;
            a tied head gets its own quantized copy).
    """

    method: str
    group_size: int = 128
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None; "
                f"got {self.method!r}"
            )
        if self.group_size not in GROUP_SIZES:
            raise ValueError(
                f"quantization_group_size must be one of {GROUP_SIZES}, got {self.group_size}"
            )

    def linear_method(self) -> LinearMethod:
        """A fresh method object (methods are stateless; one is shared by all layers)."""
        if self.method == "int8":
            from pagedserve.quantization.int8 import Int8LinearMethod

            return Int8LinearMethod()
        from pagedserve.quantization.int4 import Int4LinearMethod

        return Int4LinearMethod(self.group_size)


__all__ = ["LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "QUANTIZATION_METHODS"]
