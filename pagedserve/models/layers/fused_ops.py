"""The decoder's elementwise steps as single C++ passes on CPU (pagedserve/csrc/fused_ops_cpu.cpp).

RMSNorm (with its residual add), SiLU * up and rotary are 5-9 torch ops each; fused, each is
one read and one write of the activations. Each layer calls `resolve()` once, when the model
is built (which builds or loads the kernel then, never on a request), and keeps the answer:
the op namespace, or None for the torch code, which stays the reference (tests compare the
two). At run time `for_tensor(ops, x)` only checks that `x` is a CPU float32 / bfloat16 tensor.
`PAGEDSERVE_FUSED_OPS=torch` forces the torch code, `=cpp` makes a failed build an error.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve import cpp_build, envs

_DTYPES = (torch.float32, torch.bfloat16)


def resolve() -> Any:
    """The fused ops a layer built now should use (honours PAGEDSERVE_FUSED_OPS), or None.

    Raises:
        KernelUnavailable: PAGEDSERVE_FUSED_OPS=cpp and the kernel cannot be built.
        ValueError: PAGEDSERVE_FUSED_OPS has another value.
    """
    # A layer built for another device (the loader's `with torch.device(...)`) never runs them.
    if torch.empty(0).device.type != "cpu":
        return None
    return cpp_build.resolve(cpp_build.FUSED_OPS, envs.fused_ops())


def available() -> bool:
    """Whether layers built now use the C++ ops."""
    return resolve() is not None


def for_tensor(ops: Any, x: torch.Tensor) -> Any:
    """`ops` if they should handle `x` (a CPU float32 / bfloat16 tensor), else None."""
    if ops is None or x.device.type != "cpu" or x.dtype not in _DTYPES:
        return None
    return ops

