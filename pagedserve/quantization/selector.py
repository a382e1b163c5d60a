"""The layer method a `QuantizationConfig` names (the factory lives here, not in config.py,
so that the config stays free of torch and of the methods it names)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.config import PER_CHANNEL, QuantizationConfig

if TYPE_CHECKING:
    from pagedserve.quantization.base import LinearMethod

# What "auto" means for group-wise int8. Weight-only until the 50k-token quality run of int8
# activations (benchmarks/quality.py, configs int8-a8 vs fp32) shows perplexity within +0.5%
# of fp32's (issue 18's bound); "int8" reads the weights ~2x faster at batch 1 on AVX2.
DEFAULT_INT8_ACTIVATIONS = "none"
# What "auto" means for a GGUF file served from its blocks: int8, as llama.cpp multiplies every
# quantized type (x rounded per block of 32, integer dot products). The K-quant layers then read
# their weights at ~2.5x the rate of the float path (the float path was bound by widening each
# weight to float32, not by memory); BENCHMARKS.md has the perplexity cost on the Qwen files.
DEFAULT_GGUF_ACTIVATIONS = "int8"


def gguf_activations(config: QuantizationConfig | None) -> str:
    """The activations of a GGUF file's layers served from its blocks ("int8" or "none")."""
    if config is None or config.activations == "auto":
        return DEFAULT_GGUF_ACTIVATIONS
    return config.activations


def get_linear_method(config: QuantizationConfig) -> LinearMethod:
    """A fresh method object (methods are stateless; one is shared by all layers).
    "gguf" has none: the loader picks one per layer from the file's tensor types."""
    if config.method == "gguf":
        raise ValueError("quantization='gguf' has a method per layer (models/loader.py)")
    group = config.effective_group_size
    if config.method == "int8" and group == PER_CHANNEL:
        from pagedserve.quantization.int8 import Int8LinearMethod

        return Int8LinearMethod()
    if config.method == "int8":
        from pagedserve.quantization.int8_grouped import Int8GroupedLinearMethod

        activations = DEFAULT_INT8_ACTIVATIONS if config.activations == "auto" else config.activations
        return Int8GroupedLinearMethod(group, activations=activations)
    from pagedserve.quantization.int4 import Int4LinearMethod

    return Int4LinearMethod(group)
