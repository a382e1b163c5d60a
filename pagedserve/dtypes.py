"""The torch side of the configs' names: which device and dtype a setting means.

`config.py` holds plain strings ("auto", "bfloat16", "cuda:0") so that it, and `core/`
which reads it, import no torch; the engine turns them into torch objects here, once, at
start-up.
"""

from __future__ import annotations

import logging

import torch

from pagedserve import cpp_build
from pagedserve.config import DTYPE_ALIASES, LoRAConfig

logger = logging.getLogger(__name__)


def torch_device(name: str) -> torch.device:
    """`EngineConfig.device`: "auto" is cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def serving_dtype(name: str, device: torch.device, checkpoint: torch.dtype | None = None,
                  dequantized: bool = False) -> torch.dtype:
    """`ModelConfig.dtype` as a torch dtype. "auto" follows the checkpoint, as vLLM does (see `auto_dtype`)."""
    if name == "auto":
        dtype = auto_dtype(device, checkpoint, dequantized)
        logger.info("dtype=auto: serving in %s (checkpoint: %s)", str(dtype).removeprefix("torch."),
                    "quantized, dequantized at load" if dequantized else checkpoint or "unspecified")
        return dtype
    dtype = getattr(torch, DTYPE_ALIASES[name])
    assert isinstance(dtype, torch.dtype)
    return dtype


def auto_dtype(device: torch.device, checkpoint: torch.dtype | None, dequantized: bool) -> torch.dtype:
    """vLLM's dtype="auto": the checkpoint's dtype, but float16 -> bfloat16 on CPU (no fast
    fp16 GEMM there); float32 when the checkpoint says nothing. A quantized checkpoint (a GGUF
    file) computes its activations in float32 on CPU, as llama.cpp does, and bfloat16 on a
    GPU. Never the CPU's instruction set: the same file gives the same tokens on every CPU
    (bf16 activations flipped SmolLM2's near-tie first token on AVX512-BF16 machines)."""
    if dequantized:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if checkpoint is None or checkpoint not in (torch.float32, torch.bfloat16, torch.float16):
        return torch.float32
    if checkpoint == torch.float16 and device.type == "cpu":
        return torch.bfloat16
    return checkpoint


def lora_dtype(config: LoRAConfig, model_dtype: torch.dtype) -> torch.dtype:
    """`LoRAConfig.lora_dtype`: "auto" is the model's dtype."""
    if config.lora_dtype == "auto":
        return model_dtype
    dtype = getattr(torch, config.lora_dtype)
    assert isinstance(dtype, torch.dtype)
    return dtype


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 in /proc/cpuinfo's flags (False where it cannot be read)."""
    flags = cpp_build.cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags
