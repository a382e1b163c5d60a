"""Shape-only (fake) implementations of the package's C++ ops, so dynamo can trace through
them as opaque calls (`torch.library.register_fake`); inductor then calls the real kernels.

Each fake mirrors its kernel's output: a new contiguous tensor (pagedserve/csrc/*.cpp
allocate every output with `at::empty`). Registered once per op library, after it is loaded.
"""

from __future__ import annotations

import torch

from pagedserve import cpp_build


def _rows_out(x: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    # gemv ops: x (..., in) -> (..., n)
    return x.new_empty((*x.shape[:-1], n), dtype=dtype)


def _fused(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::rms_norm")
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake(f"{ns}::add_rms_norm")
    def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    @torch.library.register_fake(f"{ns}::silu_and_mul")
    def _(x: torch.Tensor) -> torch.Tensor:
        return x.new_empty((x.shape[0], x.shape[1] // 2))

    @torch.library.register_fake(f"{ns}::rotary")
    def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x.new_empty(x.shape)


def _gemv(ns: str) -> None:
    @torch.library.register_fake(f"{ns}::gemv_dense")
    def _(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # w: pair tiles (out/16, in/2, 16, 2)
        return _rows_out(x, w.shape[0] * w.shape[2], x.dtype)

    @torch.library.register_fake(f"{ns}::gemv_int8")
    def _(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_out(x, w.shape[0] * w.shape[2], torch.float32)

    # Group-wise ops (quantization/gemv.py): channel tiles of 16, (out/16, in, 16) int8 and
    # (out/16, in, 8) uint8 (two channels a byte); the output is in x's dtype.
    @torch.library.register_fake(f"{ns}::gemv_int8_grouped")
    def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_out(x, q.shape[0] * 16, x.dtype)

    @torch.library.register_fake(f"{ns}::gemv_int8_q8")  # quad tiles (out/16, in/4, 16, 4)
    def _(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_out(x, q.shape[0] * 16, x.dtype)

    @torch.library.register_fake(f"{ns}::gemv_int4_grouped")
    def _(x: torch.Tensor, q: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _rows_out(x, q.shape[0] * 16, x.dtype)


_REGISTER = {cpp_build.FUSED_OPS: _fused, cpp_build.GEMV: _gemv}


_DONE: set[str] = set()


def register_fakes() -> list[str]:
    """Registers the fakes of every op library this module knows that is loaded in this
    process (and not done yet); returns the namespaces with fakes. A library that is not
    loaded is skipped, not built: the model does not use it, so it is never traced."""
    for kernel, register in _REGISTER.items():
        ns = kernel.namespace
        if ns not in _DONE and _loaded(ns):
            register(ns)
            _DONE.add(ns)
    return sorted(_DONE)


def _loaded(namespace: str) -> bool:
    return any(name.startswith(f"{namespace}::") for name in torch._C._dispatch_get_all_op_names())
