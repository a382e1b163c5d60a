"""Rotary position embedding (RoPE), Hugging Face "rotate_half" (non-interleaved) layout.

cos/sin are computed once per forward from the step's positions and shared by all layers:

    cos, sin: (num_tokens, head_dim // 2)            already multiplied by attention_scaling
    x = [x1 | x2] along head_dim  ->  [x1 cos - x2 sin | x2 cos + x1 sin]

Inverse frequencies come from transformers' ROPE_INIT_FUNCTIONS (which read the normalised
`config.rope_parameters`), so the scaled variants match transformers bit for bit. Only
position-independent variants are supported: "dynamic" and "longrope" rescale with the
sequence length at run time and are refused.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig

from pagedserve.models.layers import fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: PretrainedConfig) -> dict:
    """The config's RoPE parameters, validated; raises ValueError naming the bad option."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_parameters.rope_type={rope_type!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params["rope_type"] = rope_type
    return params


def partial_rotary_factor(config: PretrainedConfig) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return 1.0 if partial is None else float(partial)


def rotary_dim_of(config: PretrainedConfig) -> int:
    """The leading dims of each head that RoPE rotates: head_dim * partial_rotary_factor
    (all of them except in Phi-3-style partial rotary), as transformers computes it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(head_dim * partial_rotary_factor(config))


class RotaryEmbedding(nn.Module):
    """`head_dim` is the rotated width (`rotary_dim_of`); cos/sin cover head_dim // 2."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        # The model may be built under a bf16/fp16 default dtype; frequencies need float32.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            if params["rope_type"] == "default":
                exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
                inv_freq = 1.0 / (params["rope_theta"] ** exponents)
                scaling = 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](
                    config, _current_device()
                )
        finally:
            torch.set_default_dtype(default_dtype)
        if inv_freq.shape[0] * 2 != head_dim:
            raise ValueError(f"RoPE covers {inv_freq.shape[0] * 2} dims, head_dim is {head_dim}")
        # (head_dim // 2,) float32; not persistent: recomputed from the config, never loaded.
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = float(scaling)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (num_tokens,) -> cos, sin (num_tokens, head_dim // 2) in `dtype`."""
        freqs = positions[:, None].float() * self.inv_freq.float()
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _current_device() -> torch.device:
    # The device of the construction context (`with torch.device(...)`), where buffers go.
    return torch.empty(0).device


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: Any = None
) -> torch.Tensor:
    """x (num_tokens, num_heads, head_dim), cos/sin (num_tokens, head_dim // 2) -> rotated x.

    `fused`: the caller's `fused_ops.resolve()` (chosen when it was built); None = torch code.
    """
    ops = fused_ops.for_tensor(fused, x)
    if ops is not None and x.stride(2) == 1 and cos.dtype == x.dtype:
        return ops.rotary(x, cos.contiguous(), sin.contiguous())
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
