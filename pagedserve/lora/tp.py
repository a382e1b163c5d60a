"""A LoRA adapter's shard for one tensor-parallel rank (S-LoRA's split, no extra communication).

delta W = scale * B @ A, with A (r, in) and B (out, r). Each module is cut as its base layer is:

    column-parallel (q, k, v, gate, up): A whole, B's rows of this rank's output slice
        -> delta_r = (x A^T) B_r^T is this rank's output columns, like the base's
    row-parallel (o, down):              A's columns of this rank's input slice, B whole
        -> delta_r = (x_r A_r^T) B^T is a partial sum, added to the base's partial output
           before the layer's one all-reduce (lora/layers.py), so sum_r delta_r = delta

k / v rows follow the base's KV heads (a replicated KV head: the same rows on its ranks).
"""

from __future__ import annotations

from dataclasses import replace

from pagedserve.distributed.parallel_state import TPGroup
from pagedserve.lora.peft_loader import LoRAAdapter, LoRAModuleWeights

_COLUMN = ("q_proj", "gate_proj", "up_proj")
_KV = ("k_proj", "v_proj")
_ROW = ("o_proj", "down_proj")


def shard_adapter(adapter: LoRAAdapter, tp: TPGroup, kv_replicas: int = 1) -> LoRAAdapter:
    """This rank's part of every module of `adapter` (the adapter itself with one rank).

    Args:
        kv_replicas: ranks sharing one KV head (tp / num_key_value_heads when that is > 1).
    """
    if tp.size == 1:
        return adapter
    weights = {key: _shard(name, w, tp, kv_replicas) for key, w in adapter.weights.items()
               for name in (key[1],)}
    return replace(adapter, weights=weights)


def _shard(name: str, w: LoRAModuleWeights, tp: TPGroup, kv_replicas: int) -> LoRAModuleWeights:
    if name in _ROW:
        cols = w.lora_a.shape[1] // tp.size
        return LoRAModuleWeights(w.lora_a[:, tp.rank * cols : (tp.rank + 1) * cols].contiguous(), w.lora_b, w.scale)
    parts, index = tp.size, tp.rank
    if name in _KV:
        parts, index = tp.size // kv_replicas, tp.rank // kv_replicas
    elif name not in _COLUMN:
        raise ValueError(f"LoRA module {name!r} has no tensor-parallel split")
    rows = w.lora_b.shape[0] // parts
    return LoRAModuleWeights(w.lora_a, w.lora_b[index * rows : (index + 1) * rows].contiguous(), w.scale)
