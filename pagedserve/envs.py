"""Every environment variable pagedserve reads, in one place, with its type and default.

Read lazily (each accessor reads `os.environ` when called), so tests can set a variable
with `monkeypatch.setenv` after import. The kernel choices below are asked once, while an
engine is built (the attention backend, each layer, each weight), never per call: changing
one affects engines built afterwards. A choice forced to "cpp" whose kernel cannot be built
fails the engine's construction (`cpp_build.KernelUnavailable`); unset, a fallback is logged.

    PAGEDSERVE_ATTENTION_BACKEND   "torch" | "cpp" | unset (auto: cpp on CPU when it builds)
    PAGEDSERVE_CPU_GEMM            "onednn" | "torch" | unset (auto: onednn when torch has it)
                                   how unquantized CPU linear layers multiply (see
                                   quantization/packed.py)
    PAGEDSERVE_FUSED_OPS           "cpp" | "torch" | unset (auto: cpp on CPU when it builds)
                                   RMSNorm, SiLU*mul and rotary as single C++ passes (see
                                   models/layers/fused_ops.py)
    PAGEDSERVE_GEMV                "cpp" | "off" | unset (auto: cpp on CPU when it builds)
                                   decode-sized (<= 32 rows) linear layers through the C++
                                   GEMV kernel, which keeps one more copy of the weights
                                   (see quantization/gemv.py)
    PAGEDSERVE_DECODER_LOOP        "cpp" | "off" | unset (auto: cpp where the model and its
                                   kernels allow): a Llama-family model's decoder layers in
                                   one C++ call a step (see models/decoder_loop.py)
    PAGEDSERVE_ISA                 "native" | "avx2" | "portable" | unset (auto: native): the
                                   instruction set the C++ kernels are built for (see
                                   cpp_build.ISA_VARIANTS); one the CPU cannot run is refused
                                   with the CPU flags it lacks
    PAGEDSERVE_HUGE_PAGES          "on" | "off" | unset (auto: on where Linux offers
                                   transparent huge pages): CPU weights and KV cache in 2 MiB
                                   pages (see worker/huge_pages.py)
    PAGEDSERVE_TP_TIMEOUT_S        seconds (default 120): tensor parallelism's start-up and
                                   collective timeout; a rank that stops answering fails the
                                   step after this long (a rank that dies fails it at once)
    LRU_CACHE_CAPACITY,            PyTorch's and oneDNN's per-shape primitive caches; `pagedserve`
    ONEDNN_PRIMITIVE_CACHE_CAPACITY  sets both to 64 unless exported (see bound_native_caches)
    PAGEDSERVE_CACHE_DIR           where models, adapters and kernels are cached (default
                                   ~/.cache/pagedserve)
    VLLM_API_KEY,                  the server's key when --api-key is not given (vLLM's
    PAGEDSERVE_API_KEY             variable first); also the key `pagedserve chat` sends
    TORCH_EXTENSIONS_DIR           build cache for C++ extensions (torch's own variable);
                                   unset: ~/.cache/pagedserve/torch_extensions
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator
from typing import Literal, get_args


def _choice(variable: str, options: tuple[str, ...]) -> str | None:
    """A forced choice among `options` (case-insensitive), or None when unset / "auto".

    Raises:
        ValueError: any other value; the message names the variable and the options.
    """
    value = os.environ.get(variable, "").strip().lower()
    if not value or value == "auto":
        return None
    if value in options:
        return value
    raise ValueError(f"{variable} must be one of {', '.join(options)} (or unset / auto); got {value!r}")


AttentionBackendName = Literal["torch", "cpp"]
_ATTENTION_BACKENDS: tuple[AttentionBackendName, ...] = get_args(AttentionBackendName)


def attention_backend() -> AttentionBackendName | None:
    """The forced attention backend, or None to choose automatically."""
    return _choice("PAGEDSERVE_ATTENTION_BACKEND", _ATTENTION_BACKENDS)  # type: ignore[return-value]


CpuGemmName = Literal["onednn", "torch"]
_CPU_GEMMS: tuple[CpuGemmName, ...] = get_args(CpuGemmName)


def cpu_gemm() -> CpuGemmName | None:
    """The forced CPU GEMM for unquantized linear layers, or None to choose automatically."""
    return _choice("PAGEDSERVE_CPU_GEMM", _CPU_GEMMS)  # type: ignore[return-value]


FusedOpsName = Literal["cpp", "torch"]
_FUSED_OPS: tuple[FusedOpsName, ...] = get_args(FusedOpsName)


def fused_ops() -> FusedOpsName | None:
    """The forced implementation of the fused elementwise ops, or None for automatic."""
    return _choice("PAGEDSERVE_FUSED_OPS", _FUSED_OPS)  # type: ignore[return-value]


GemvName = Literal["cpp", "off"]
_GEMV: tuple[GemvName, ...] = get_args(GemvName)


def gemv() -> GemvName | None:
    """Whether decode-sized linear layers use the C++ GEMV kernel ("off", forced "cpp"), or
    None for automatic."""
    return _choice("PAGEDSERVE_GEMV", _GEMV)  # type: ignore[return-value]


DecoderLoopName = Literal["cpp", "off"]
_DECODER_LOOP: tuple[DecoderLoopName, ...] = get_args(DecoderLoopName)


def decoder_loop() -> DecoderLoopName | None:
    """Whether steps run the decoder layers in one C++ call ("off", forced "cpp"), or
    None for automatic."""
    return _choice("PAGEDSERVE_DECODER_LOOP", _DECODER_LOOP)  # type: ignore[return-value]


IsaName = Literal["native", "avx2", "portable"]
ISAS: tuple[IsaName, ...] = get_args(IsaName)


def isa() -> IsaName:
    """The instruction set the C++ kernels are built for (default "native": -march=native)."""
    return _choice("PAGEDSERVE_ISA", ISAS) or "native"  # type: ignore[return-value]


HugePagesName = Literal["on", "off"]
_HUGE_PAGES: tuple[HugePagesName, ...] = get_args(HugePagesName)


def huge_pages() -> HugePagesName | None:
    """Whether CPU weights and KV cache go in transparent huge pages ("off"; "on" and None:
    where the OS offers them)."""
    return _choice("PAGEDSERVE_HUGE_PAGES", _HUGE_PAGES)  # type: ignore[return-value]


def tp_timeout_s() -> float:
    value = os.environ.get("PAGEDSERVE_TP_TIMEOUT_S", "").strip()
    try:
        seconds = float(value) if value else 120.0
    except ValueError:
        raise ValueError(f"PAGEDSERVE_TP_TIMEOUT_S must be a number of seconds; got {value!r}") from None
    if seconds <= 0:
        raise ValueError(f"PAGEDSERVE_TP_TIMEOUT_S must be > 0; got {value!r}")
    return seconds


@contextlib.contextmanager
def overridden(values: dict[str, str]) -> Iterator[None]:
    """Sets environment variables for the block (an engine built inside reads them, as the
    benchmarks' per-variant engines do), restoring the old values after."""
    old = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def cache_dir() -> pathlib.Path:
    """``$PAGEDSERVE_CACHE_DIR`` if set, else ``~/.cache/pagedserve``."""
    value = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return pathlib.Path(value).expanduser() if value else pathlib.Path.home() / ".cache" / "pagedserve"


def api_key() -> str | None:
    """The API key from the environment ($VLLM_API_KEY, else $PAGEDSERVE_API_KEY), or None."""
    for variable in ("VLLM_API_KEY", "PAGEDSERVE_API_KEY"):
        if os.environ.get(variable):
            return os.environ[variable]
    return None


def torch_extensions_dir() -> pathlib.Path:
    """Where C++ extensions are built and cached between processes."""
    value = os.environ.get("TORCH_EXTENSIONS_DIR")
    if value:
        return pathlib.Path(value).expanduser()
    return pathlib.Path.home() / ".cache" / "pagedserve" / "torch_extensions"


# PyTorch keeps one oneDNN primitive (and its prepacked-weight reorder) per distinct input
# shape, up to 1024 by default. A server sees a new token count almost every step, so the cache
# grew by ~140 MiB in 40 s of mixed traffic (the soak test) before reaching that bound.
NATIVE_CACHE_CAPACITY = "64"


def bound_native_caches() -> None:
    """Caps PyTorch's / oneDNN's per-shape primitive caches for a long-running server.

    Must run before torch creates its first oneDNN primitive (the CLI calls it first thing).
    A value the user exported is kept.
    """
    os.environ.setdefault("LRU_CACHE_CAPACITY", NATIVE_CACHE_CAPACITY)
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", NATIVE_CACHE_CAPACITY)
