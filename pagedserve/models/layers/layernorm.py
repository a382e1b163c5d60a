"""RMSNorm (optionally fused with the residual add that precedes it) and LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.models.layers import fused_ops


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 like Hugging Face's LlamaRMSNorm.

    `forward(x, residual)` first forms `x + residual` (the decoder's skip connection) and
    returns `(norm(x + residual), x + residual)`, so each layer hands the sum along instead
    of keeping a separate residual stream.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.fused = fused_ops.resolve()  # the C++ ops or None, chosen once (PAGEDSERVE_FUSED_OPS)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = fused_ops.for_tensor(self.fused, x) if x.dim() == 2 and x.dtype == self.weight.dtype else None
        if ops is not None and x.stride(1) == 1:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(1) == 1:
                return ops.add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last dim, like torch.nn.LayerNorm.

    `elementwise_affine=False` (some OPT configs) has neither weight nor bias.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, elementwise_affine: bool = True) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
            self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}"
