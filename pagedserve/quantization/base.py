"""The linear-layer quantization interface: one method object per linear layer.

A linear layer (models/layers/linear.py) owns its shape, its shard bookkeeping and its
bias; its `quant_method` owns how the weight is stored and multiplied:

    create_weights(layer)                  register the parameters the checkpoint loads into
                                           (each with `weight_loader = layer.weight_loader`,
                                           so fused q/k/v and gate/up shards load by name)
    process_weights_after_loading(layer)   once every shard is in: quantize, repack, free
    apply(layer, x)                        x (..., in) -> x W^T + b  (..., out), in x.dtype

`apply` is the *base* output only. A LoRA layer wrapping a quantized linear computes
`layer.quant_method.apply(layer, x) + delta(x)` with the adapter in full precision; no
method may fold anything else into its output.

The methods here quantize at load time from a full-precision checkpoint, so their
`create_weights` registers the ordinary full-precision weight; a method for a
pre-quantized format (or a GPU kernel) registers its own tensors instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

# (op name, the op's arguments after x with the bias last when there is one): one linear
# layer's call as `LinearMethod.decode_op` / `gemm_op` describe it.
LinearCall = tuple[str, list[torch.Tensor]]


def linear_call(op: str, *args: torch.Tensor, bias: torch.Tensor | None) -> LinearCall:
    return op, [*args] if bias is None else [*args, bias]


class LinearMethod(ABC):
    """How one linear layer stores its weight and computes x W^T + b."""

    #: Short name for logs and reports ("unquantized", "int8", "int4").
    name: str = "abstract"

    def create_weights(self, layer: nn.Module) -> None:
        """Register `layer.weight` (output_size, input_size) in the default dtype, uninitialised.

        It always comes from a checkpoint, through `layer.weight_loader` (which knows the
        layer's shards). Methods loading another format override this.
        """
        weight = nn.Parameter(
            torch.empty(layer.output_size, layer.input_size), requires_grad=False
        )
        weight.weight_loader = layer.weight_loader  # type: ignore[attr-defined]
        layer.weight = weight

    def supports(self, layer: nn.Module) -> bool:
        """Whether this method can take `layer` (shape constraints of its kernel)."""
        return True

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every shard of `layer` is loaded; the default keeps the weight."""
        return

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x (..., input_size) -> x W^T + b (..., output_size) in x.dtype."""

    def decode_op(self, layer: nn.Module) -> LinearCall | None:
        """The single GEMV op `apply` calls for x of at most `gemv.MAX_ROWS` rows in float32 /
        bfloat16, as (its name in quantization/gemv.py's op library, its arguments after x,
        the bias last when there is one); None when `apply` does something else there.
        The C++ decoder loop (models/decoder_loop.py) makes exactly this call."""
        return None

    # Whether the path for more rows converts the whole weight on every call (dequantizes or
    # widens it): such a method runs its decode op 32 rows a call up to gemv.CHUNKED_MAX_ROWS.
    converts_weight_per_call = False

    def decode_max_rows(self, layer: nn.Module) -> int:
        """Rows up to which `apply` runs `decode_op`, in calls of at most `gemv.MAX_ROWS`
        rows (`gemv.in_chunks`); `gemm_op` beyond. The C++ decoder loop does the same."""
        from pagedserve.quantization import gemv

        if self.converts_weight_per_call and self.decode_op(layer) is not None:
            return gemv.CHUNKED_MAX_ROWS
        return gemv.MAX_ROWS

    def gemm_op(self, layer: nn.Module) -> LinearCall | None:
        """The same for x of more rows: "linear" (aten::linear), "linear_widened" (aten::linear
        on x, W and b widened to float32, the result back in x's dtype) or "mkldnn_linear"
        (oneDNN's prepacked GEMM) and its arguments after x; None when `apply` does more."""
        return None

    def add_to_weight(self, layer: nn.Module, delta: torch.Tensor) -> None:
        """W += delta (output_size, input_size), e.g. to merge a LoRA adapter into the base.

        Quantized methods cannot hold W + delta exactly and refuse.
        """
        raise NotImplementedError(f"{self.name} weights cannot be changed in place")

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes this method keeps resident for `layer` (weights, scales; not the bias)."""
        return sum(t.numel() * t.element_size() for t in self.weight_tensors(layer))

    def weight_tensors(self, layer: nn.Module) -> list[torch.Tensor]:
        return [layer.weight]


class UnquantizedLinearMethod(LinearMethod):
    name = "unquantized"

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, getattr(layer, "bias", None))

    def add_to_weight(self, layer: nn.Module, delta: torch.Tensor) -> None:
        layer.weight.data += delta.to(layer.weight.dtype)


UNQUANTIZED = UnquantizedLinearMethod()


def add_bias(y: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    bias = getattr(layer, "bias", None)
    return y if bias is None else y.add_(bias)
