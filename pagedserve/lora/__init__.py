"""Multi-LoRA serving core: PEFT adapter loading, unified paged memory, batched kernels.

    request.py      LoRARequest (vLLM's names)
    peft_loader.py  adapter folder -> LoRAAdapter (fp32 A, B, scale per (layer, module)) or
                    LoRALoadError
    layout.py       an adapter's packing inside a run of KV blocks; write_adapter
    segments.py     per-step segment tables (one adapter per run of tokens)
    kernels.py      lora_apply (C++ SGMV, pagedserve/csrc/lora_sgmv_cpu.cpp) and its torch reference

Use, per step and per LoRA-wrapped projection (layer l, module m = TARGETABLE.index(name)):

    storage_a, storage_b = flat_storage(kv_caches[cache_index(l, len(kv_caches))], dtype)  # once, zero-copy
    segments = build_segments(runs, num_layers, len(TARGETABLE))  # once per step (runner)
    y = base_layer(x)                                             # e.g. (T, q + 2 kv) fused
    slices = table_slices(l, [(m_q, 0, q), (m_k, q, q + kv), (m_v, q + kv, q + 2 * kv)])
    segments.apply(y, x, storage_a, storage_b, slices)            # y += deltas, in place
    # == lora_apply(y[:, 0:q], x, storage_a, storage_b, *segments.args(l, m_q)), then k, v
"""

from __future__ import annotations

from pagedserve.lora.kernels import flat_storage, lora_apply, lora_apply_reference
from pagedserve.lora.layout import AdapterLayout, plan_layout, write_adapter
from pagedserve.lora.peft_loader import (
    TARGETABLE,
    LoRAAdapter,
    LoRALoadError,
    LoRAModuleWeights,
    load_peft_adapter,
    module_dims_for,
)
from pagedserve.lora.request import LoRARequest
from pagedserve.lora.segments import LoRASegments, ResidentAdapter, build_segments

__all__ = [
    "TARGETABLE",
    "AdapterLayout",
    "LoRAAdapter",
    "LoRALoadError",
    "LoRAModuleWeights",
    "LoRARequest",
    "LoRASegments",
    "ResidentAdapter",
    "build_segments",
    "flat_storage",
    "load_peft_adapter",
    "lora_apply",
    "lora_apply_reference",
    "module_dims_for",
    "plan_layout",
    "write_adapter",
]
