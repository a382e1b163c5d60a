"""The decoder's elementwise steps as single C++ passes on CPU (csrc/fused_ops_cpu.cpp).

RMSNorm (with its residual add), SiLU * up and rotary are 5-9 torch ops each; fused, each is
one read and one write of the activations. The layers call `cpu_ops(x)`: the op namespace
when the C++ ops apply to `x` (CPU, float32 / bfloat16, they built), else None and the
layer runs its torch code, which stays the reference (tests compare the two).
`PAGEDSERVE_FUSED_OPS=torch` forces the torch code, `=cpp` makes a failed build an error.
"""

from __future__ import annotations

import functools
import logging
import pathlib
from typing import Any

import torch

from pagedserve import envs
from pagedserve.cpp_build import CFLAGS, load_cpp_ops

logger = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).resolve().parents[3] / "csrc" / "fused_ops_cpu.cpp"
_DTYPES = (torch.float32, torch.bfloat16)


class FusedOpsError(RuntimeError):
    pass


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Any, FusedOpsError | None]:
    try:
        load_cpp_ops("pagedserve_fused", _SOURCE, CFLAGS, "fused elementwise ops", FusedOpsError)
    except FusedOpsError as exc:
        return None, exc
    return torch.ops.pagedserve_fused, None


def available() -> bool:
    """Whether the C++ ops are in use for CPU tensors (honours PAGEDSERVE_FUSED_OPS)."""
    choice = envs.fused_ops()
    if choice == "torch":
        return False
    ops, error = _load()
    if error is not None:
        if choice == "cpp":
            raise error
        _warn_once(str(error))
        return False
    return True


def cpu_ops(x: torch.Tensor) -> Any:
    """The op namespace if the fused ops should handle `x`, else None."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES or not available():
        return None
    return _load()[0]


@functools.cache
def _warn_once(message: str) -> None:
    logger.warning("fused ops: using torch's elementwise ops: %s", message)
