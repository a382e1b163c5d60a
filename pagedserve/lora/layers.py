"""LoRA on top of the model's projections, for a whole heterogeneous batch at once.

`wrap_model_for_lora` replaces each decoder layer's qkv_proj, o_proj, gate_up_proj and
down_proj with a `LoRALinear` that runs the base projection (full precision or quantized,
unchanged) and then adds every segment's adapter delta into the matching column slice:

    qkv_proj output columns:     | q (module 0) | k (1) | v (2) |
    gate_up_proj output columns: | gate (4) | up (5) |

Tensor parallelism: a column-parallel base's output is this rank's columns and its adapter
shard's B rows match them; a row-parallel base (o_proj, down_proj) computes its partial
product, the shard's partial delta is added to it, and only then does the one all-reduce
run (lora/tp.py), so LoRA costs no communication of its own.

The step's segment tables reach the layers through `lora_step`, a context manager the
model runner enters around the forward pass (always reset on exit); outside it, or in a
step without adapter tokens, the wrappers cost one context-variable read.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

from pagedserve.distributed.parallel_state import SINGLE
from pagedserve.lora.kernels import flat_storage, kernel_available, kernel_handles
from pagedserve.lora.layout import cache_index
from pagedserve.lora.peft_loader import TARGETABLE
from pagedserve.lora.segments import LoRASegments, table_slices
from pagedserve.models.layers.linear import RowParallelLinear
from pagedserve.quantization.packed import PackedLinearMethod

_segments: ContextVar[LoRASegments | None] = ContextVar("pagedserve_lora_segments", default=None)


@contextmanager
def lora_step(segments: LoRASegments | None) -> Iterator[None]:
    token = _segments.set(segments)
    try:
        yield
    finally:
        _segments.reset(token)


class LoRALinear(nn.Module):
    """base(x) plus, for each (module, column slice), the segments' LoRA deltas."""

    def __init__(self, base: nn.Module, layer_idx: int, slices: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.base = base
        self.layer_idx = layer_idx
        self.slices = slices  # (TARGETABLE index, first column, end column)
        self.kernel_slices = table_slices(layer_idx, slices)
        self.storage_a: torch.Tensor | None = None
        self.storage_b: torch.Tensor | None = None
        self.one_op = False  # base GEMM and deltas in one op (set by bind)
        # Row-parallel bases: the partial sums (base + delta) are reduced here, once.
        self.tp = base.tp if isinstance(base, RowParallelLinear) else SINGLE

    def bind(self, kv_cache: torch.Tensor, dtype: torch.dtype) -> None:
        """Points the layer at the KV-cache memory its adapters live in (zero-copy views).

        A oneDNN-prepacked base (the CPU default; float32 / bfloat16 weights, the activations'
        dtype) then runs with the deltas in one op call: a separate LoRA op right after the
        GEMM costs 20-35 us on this host before it does any work.
        """
        self.storage_a, self.storage_b = flat_storage(kv_cache, dtype)
        if kv_cache.device.type == "cpu":
            kernel_available()  # built now, at engine start-up, never on the first LoRA request
        self.one_op = (
            isinstance(getattr(self.base, "quant_method", None), PackedLinearMethod)
            and hasattr(self.base, "packed_weight")  # bf16 that oneDNN cannot pack keeps F.linear
        ) and kernel_handles(
            self.base.packed_weight.dtype, dtype, kv_cache.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        segments = _segments.get()
        if segments is None or segments.num_segments == 0:
            return self.base(x)
        if self.one_op and x.dim() == 2:
            y = segments.linear(x.contiguous(), self.base.packed_weight, getattr(self.base, "bias", None),
                                self.storage_a, self.storage_b, self.kernel_slices)
            return self.tp.all_reduce(y)
        y = self.base.quant_method.apply(self.base, x)  # = base(x), before any all-reduce
        segments.apply(y, x.contiguous(), self.storage_a, self.storage_b, self.kernel_slices)
        return self.tp.all_reduce(y)


def bind_lora_layers(wrappers: list[LoRALinear], kv_caches: list[torch.Tensor], dtype: torch.dtype) -> None:
    """Points every wrapper at the cache tensor its layer's adapter weights live in: its own
    layer's, or with windowed layers (fewer tensors than layers) the one
    `layout.cache_index` names."""
    for wrapper in wrappers:
        wrapper.bind(kv_caches[cache_index(wrapper.layer_idx, len(kv_caches))], dtype)


def _slices(layer: nn.Module, names: tuple[str, ...]) -> list[tuple[int, int, int]]:
    bounds, start = [], 0
    for name, size in zip(names, layer.output_sizes, strict=True):
        bounds.append((TARGETABLE.index(name), start, start + size))
        start += size
    return bounds


def lora_targets(model: nn.Module) -> tuple[str, ...]:
    """The TARGETABLE projections `model` takes adapters on: its class's `lora_targets`
    (Qwen3-MoE: attention only, its MLPs are experts), else all of them."""
    return tuple(getattr(model, "lora_targets", TARGETABLE))


def wrap_model_for_lora(model: nn.Module) -> list[LoRALinear]:
    """Wraps the projections of a Llama-family model in place (those `lora_targets` names);
    returns the wrappers.

    Raises:
        ValueError: the model has no Llama-style decoder layers (LoRA needs them).
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") and hasattr(layer.self_attn, "qkv_proj") for layer in layers):
        raise ValueError(f"enable_lora: {type(model).__name__} is not supported (LoRA serves Llama-family models)")
    # The loader refuses adapters on the rest (peft_loader.module_dims_for), so an unwrapped
    # projection never has weights in a layout.
    with_mlp = "gate_proj" in lora_targets(model)
    wrappers = []
    for index, layer in enumerate(layers):
        attn = layer.self_attn
        attn.qkv_proj = LoRALinear(attn.qkv_proj, index, _slices(attn.qkv_proj, ("q_proj", "k_proj", "v_proj")))
        attn.o_proj = LoRALinear(attn.o_proj, index, _slices(attn.o_proj, ("o_proj",)))
        wrappers += [attn.qkv_proj, attn.o_proj]
        if with_mlp:
            mlp = layer.mlp
            mlp.gate_up_proj = LoRALinear(mlp.gate_up_proj, index, _slices(mlp.gate_up_proj, ("gate_proj", "up_proj")))
            mlp.down_proj = LoRALinear(mlp.down_proj, index, _slices(mlp.down_proj, ("down_proj",)))
            wrappers += [mlp.gate_up_proj, mlp.down_proj]
    return wrappers
