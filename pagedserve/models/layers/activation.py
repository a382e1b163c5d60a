"""Activations: gated (SwiGLU over a fused gate/up projection) and plain, by HF name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.layers import fused_ops


class SiluAndMul(nn.Module):
    """SwiGLU: x = [gate | up] (last dim 2 * I) -> silu(gate) * up, (..., I)."""

    def __init__(self) -> None:
        super().__init__()
        self.fused = fused_ops.resolve()  # the C++ ops or None, chosen once (PAGEDSERVE_FUSED_OPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = fused_ops.for_tensor(self.fused, x) if x.dim() == 2 else None
        if ops is not None and x.stride(1) == 1:
            return ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


# Hugging Face `hidden_act` / `activation_function` names -> elementwise functions.
# "gelu_new" (GPT-2) is the tanh approximation, the same formula as "gelu_pytorch_tanh".
_ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation called `name` in Hugging Face configs; ValueError naming it if unknown."""
    if name not in _ACTIVATIONS:
        raise ValueError(
            f"unsupported activation_function={name!r} (supported: {', '.join(_ACTIVATIONS)})"
        )
    return _ACTIVATIONS[name]
