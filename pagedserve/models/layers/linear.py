"""Linear layers with per-class weight loaders.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)` so the loader
never needs to know a layer's internals. How the weight is stored and multiplied belongs to
the layer's `quant_method` (pagedserve/quantization/base.py): it registers the weight
(`create_weights`), may repack it once loaded (`process_weights_after_loading`, e.g. to int8)
and computes the base output x W^T + b (`apply`); `forward` is exactly that base output, so
a LoRA wrapper adds its delta on top of any quantized or unquantized base. Every layer exposes `output_sizes` (one entry per logical
projection, in order along the output dim; a single entry unless fused), and fused layers
`shard_ids` and `shard_slice(shard_id)`, so per-projection LoRA can find each slice:

    QKVLinear.weight     (q_size + 2 * kv_size, in)    rows: | q | k | v |
    MergedLinear.weight  (sum(output_sizes), in)        rows: | gate | up |  (shards 0, 1)
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from pagedserve.quantization.base import UNQUANTIZED, LinearMethod


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T (+ b). Weights are left uninitialised: they always come from a checkpoint.

    The bias always stays full precision (owned here); the weight belongs to `quant_method`.
    """

    shard_ids: list[Hashable] | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # Output rows per logical projection, in order (one entry unless fused).
        self.output_sizes = [output_size]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        # Full precision until the loader attaches a quantization method (set_quant_method).
        self.quant_method: LinearMethod = UNQUANTIZED
        self.quant_method.create_weights(self)

    def set_quant_method(self, method: LinearMethod) -> None:
        """Before loading: hand the (still uninitialised) weight over to another method."""
        for name, _ in list(self.named_parameters(recurse=False)):
            if name != "bias":
                delattr(self, name)
        self.quant_method = method
        method.create_weights(self)
        self._tag_shards()

    def _tag_shards(self) -> None:
        # Fused layers: the loader checks that every shard of every parameter arrived.
        if self.shard_ids is not None:
            for p in self.parameters(recurse=False):
                p.shard_ids = tuple(self.shard_ids)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base output x W^T + b (..., output_size); adapters add their delta to it."""
        return self.quant_method.apply(self, x)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"quant={self.quant_method.name}"
        )


class ReplicatedLinear(LinearBase):
    """A plain projection loaded from one checkpoint tensor (o_proj, down_proj)."""

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard, got {shard_id!r}")
        default_weight_loader(param, loaded_weight)


class MergedLinear(LinearBase):
    """Several projections of the same input fused along the output dim (gate_up_proj).

    Checkpoint shard i is loaded into rows [sum(output_sizes[:i]), sum(output_sizes[:i+1])).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        shard_ids: Sequence[Hashable] | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_ids = (
            list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        )
        self._tag_shards()

    def shard_slice(self, shard_id: Hashable) -> slice:
        """Output rows of one shard, e.g. for a per-projection LoRA."""
        i = self.shard_ids.index(shard_id)
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(
                f"{type(self).__name__}: unknown shard {shard_id!r}, expected one of {self.shard_ids}"
            )
        default_weight_loader(param[self.shard_slice(shard_id)], loaded_weight)


class QKVLinear(MergedLinear):
    """q_proj, k_proj, v_proj fused; shards "q", "k", "v"."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_ids=["q", "k", "v"])
