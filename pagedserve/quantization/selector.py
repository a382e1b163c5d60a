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
# What "auto" means for a GGUF file served from its blocks: int8 activations for the layers held
# in bit quads (Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 and their mixes: `gemv_bits_q8`, llama.cpp's
# arithmetic), whose float path was bound by widening every weight to float32 (~2.5x slower);
# float activations for the int8 / int4 layouts (Q8_0, IQ4_*, Q4_0 / Q4_1 alone), whose float
# kernels already stream at memory speed. Rounding those too changed SmolLM2's near-tie first
# token ("The" by 0.08 nats) through its Q8_0 head. "int8" rounds every layer that can be;
# "none" none. BENCHMARKS.md (session 18) has the perplexity cost on the Qwen files.
DEFAULT_GGUF_ACTIVATIONS = "int8"


def gguf_activations(config: QuantizationConfig | None) -> str:
    """A GGUF file's activations setting: "auto" (see DEFAULT_GGUF_ACTIVATIONS), "int8" or "none"."""
    return "auto" if config is None else config.activations


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
