"""Weight-only linear quantization (int8, int4) applied at load time, and the int8 KV cache.

    base.py          the per-layer interface: LinearMethod (create_weights / process / apply)
    int8_grouped.py  int8 with a float16 scale per 32 input columns (llama.cpp's Q8_0): the
                     default int8
    int8.py          per-output-channel symmetric int8 (group_size -1), own AVX512-BF16
                     kernel or torch's CPU int8 kernel, bf16 activations
    int4.py          group-wise affine int4 (a scale and a zero per group, like Q4_1),
                     the decode GEMV kernel (AVX2) or torch's CPU int4 kernel + bf16 GEMM
    gguf_blocks.py   "gguf": a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks loaded as they are into
                     the int8 (group 32) / int4 methods
    kv_int8.py       int8 K/V rows with a per-token-per-head float32 scale

The loader (models/loader.py) attaches a method to every linear layer of the base model
before loading, and quantizes each layer as soon as its last shard is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedserve.quantization.base import LinearMethod, UnquantizedLinearMethod

QUANTIZATION_METHODS = ("int8", "int4", "gguf")
GROUP_SIZES = (32, 64, 128, 256)
PER_CHANNEL = -1  # int8 only: one scale per output channel
# group_size None picks these; BENCHMARKS.md ("Real-text quality") shows why int8 uses 32.
DEFAULT_GROUP_SIZES = {"int8": 32, "int4": 32, "gguf": 32}  # gguf: the file's blocks of 32
ACTIVATIONS = ("auto", "int8", "none")
# What "auto" means for group-wise int8. Weight-only until the 50k-token quality run of int8
# activations (benchmarks/quality.py, configs int8-a8 vs fp32) shows perplexity within +0.5%
# of fp32's (issue 18's bound); "int8" reads the weights ~2x faster at batch 1 on AVX2.
DEFAULT_INT8_ACTIVATIONS = "none"


@dataclass(frozen=True)
class QuantizationConfig:
    """What to quantize and how.

    Args:
        method: "int8" (symmetric, group-wise or per output channel), "int4" (group-wise,
            affine), or "gguf" (a GGUF file's quantized blocks as they are: the file decides
            each layer's format; models/loader.py).
        group_size: group along the input dim: 32, 64, 128 or 256; for int8 also -1 (one
            scale per output channel). None: the method's default (32 for both).
        quantize_lm_head: also quantize the LM head (embeddings always stay full precision;
            a tied head gets its own quantized copy). With "gguf" the head becomes group-wise
            int8 in blocks of 32 from its loaded values: exactly the file's numbers when the
            file stores it (or the tied token embedding) as Q8_0, as llama.cpp serves it.
        activations: group-wise int8 only: "int8" rounds a decode step's activations to
            int8 per block of 32 (the `gemv_int8_q8` kernel; W8A8 dynamic), "none" keeps them
            float (weight-only); "auto": DEFAULT_INT8_ACTIVATIONS. Prefill steps round x the
            same way before their GEMM; layers the kernel cannot take stay weight-only.
    """

    method: str
    group_size: int | None = None
    quantize_lm_head: bool = False
    activations: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None; "
                f"got {self.method!r}"
            )
        if self.method == "gguf" and self.group_size is not None:
            raise ValueError("quantization_group_size cannot be set with quantization='gguf' "
                             "(the file's blocks of 32 are served as they are)")
        if self.activations not in ACTIVATIONS:
            raise ValueError(f"quantization_activations must be one of {', '.join(ACTIVATIONS)}, "
                             f"got {self.activations!r}")
        if self.activations == "int8" and (self.method != "int8" or self.group_size == PER_CHANNEL):
            raise ValueError("quantization_activations='int8' applies to group-wise quantization='int8' only")
        allowed = GROUP_SIZES + ((PER_CHANNEL,) if self.method == "int8" else ())
        if self.group_size is not None and self.group_size not in allowed:
            raise ValueError(
                f"quantization_group_size for {self.method} must be one of {allowed}, got {self.group_size}"
            )

    @property
    def effective_group_size(self) -> int:
        return self.group_size if self.group_size is not None else DEFAULT_GROUP_SIZES[self.method]

    def linear_method(self) -> LinearMethod:
        """A fresh method object (methods are stateless; one is shared by all layers).
        "gguf" has none: the loader picks one per layer from the file's tensor types."""
        if self.method == "gguf":
            raise ValueError("quantization='gguf' has a method per layer (models/loader.py)")
        group = self.effective_group_size
        if self.method == "int8" and group == PER_CHANNEL:
            from pagedserve.quantization.int8 import Int8LinearMethod

            return Int8LinearMethod()
        if self.method == "int8":
            from pagedserve.quantization.int8_grouped import Int8GroupedLinearMethod

            activations = DEFAULT_INT8_ACTIVATIONS if self.activations == "auto" else self.activations
            return Int8GroupedLinearMethod(group, activations=activations)
        from pagedserve.quantization.int4 import Int4LinearMethod

        return Int4LinearMethod(group)


__all__ = ["LinearMethod", "QuantizationConfig", "UnquantizedLinearMethod", "QUANTIZATION_METHODS"]


def __getattr__(name: str) -> Any:
    # The methods (torch) load on first use, so that `QuantizationConfig`, which config.py
    # and through it core/ import, does not pull torch in.
    if name in ("LinearMethod", "UnquantizedLinearMethod"):
        from pagedserve.quantization import base

        return getattr(base, name)
    raise AttributeError(f"module 'pagedserve.quantization' has no attribute {name!r}")
