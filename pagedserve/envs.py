"""Every environment variable pagedserve reads, in one place, with its type and default.

Read lazily (each accessor reads `os.environ` when called), so tests can set a variable
with `monkeypatch.setenv` after import.

    PAGEDSERVE_ATTENTION_BACKEND   "torch" | "cpp" | unset (auto: cpp on CPU when it builds)
    PAGEDSERVE_CPU_GEMM            "onednn" | "torch" | unset (auto: onednn when torch has it)
                                   how unquantized CPU linear layers multiply (see
                                   quantization/packed.py)
    PAGEDSERVE_FUSED_OPS           "cpp" | "torch" | unset (auto: cpp on CPU when it builds)
                                   RMSNorm, SiLU*mul and rotary as single C++ passes (see
                                   models/layers/fused_ops.py)
    TORCH_EXTENSIONS_DIR           build cache for C++ extensions (torch's own variable);
                                   unset: ~/.cache/pagedserve/torch_extensions
"""

from __future__ import annotations

import os
import pathlib
from typing import Literal

AttentionBackendName = Literal["torch", "cpp"]
_ATTENTION_BACKENDS: tuple[AttentionBackendName, ...] = ("torch", "cpp")


def attention_backend() -> AttentionBackendName | None:
    """The forced attention backend, or None to choose automatically."""
    value = os.environ.get("PAGEDSERVE_ATTENTION_BACKEND", "").strip().lower()
    if not value or value == "auto":
        return None
    for name in _ATTENTION_BACKENDS:
        if value == name:
            return name
    raise ValueError(
        f"PAGEDSERVE_ATTENTION_BACKEND must be one of {', '.join(_ATTENTION_BACKENDS)} "
        f"(or unset / auto); got {value!r}"
    )


CpuGemmName = Literal["onednn", "torch"]
_CPU_GEMMS: tuple[CpuGemmName, ...] = ("onednn", "torch")


def cpu_gemm() -> CpuGemmName | None:
    """The forced CPU GEMM for unquantized linear layers, or None to choose automatically."""
    value = os.environ.get("PAGEDSERVE_CPU_GEMM", "").strip().lower()
    if not value or value == "auto":
        return None
    if value in _CPU_GEMMS:
        return value  # type: ignore[return-value]
    raise ValueError(
        f"PAGEDSERVE_CPU_GEMM must be one of {', '.join(_CPU_GEMMS)} (or unset / auto); "
        f"got {value!r}"
    )


FusedOpsName = Literal["cpp", "torch"]
_FUSED_OPS: tuple[FusedOpsName, ...] = ("cpp", "torch")


def fused_ops() -> FusedOpsName | None:
    """The forced implementation of the fused elementwise ops, or None for automatic."""
    value = os.environ.get("PAGEDSERVE_FUSED_OPS", "").strip().lower()
    if not value or value == "auto":
        return None
    if value in _FUSED_OPS:
        return value  # type: ignore[return-value]
    raise ValueError(
        f"PAGEDSERVE_FUSED_OPS must be one of {', '.join(_FUSED_OPS)} (or unset / auto); got {value!r}"
    )


def torch_extensions_dir() -> pathlib.Path:
    """Where C++ extensions are built and cached between processes."""
    value = os.environ.get("TORCH_EXTENSIONS_DIR")
    if value:
        return pathlib.Path(value).expanduser()
    return pathlib.Path.home() / ".cache" / "pagedserve" / "torch_extensions"
