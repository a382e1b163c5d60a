"""Where a resident adapter's weights sit inside its run of KV-cache blocks (S-LoRA style).

An adapter on the device owns N consecutive block ids [b0, b0 + N) of the paged KV cache,
in every layer. Layer l's cache is (2, num_blocks, block_size, kv_heads, head_dim); its K
half holds that layer's A matrices and its V half the packed B matrices, each half of the
run read as one flat array of the LoRA dtype (E = block_elems elements per block):

    kv_l[0, b0 : b0+N]  (A region, N * E elements)
    |A q_proj (r_q, in_q)|A k_proj|A v_proj|A o_proj|A gate|A up|A down (r_d, in_d)|..free..|
    ^ a_offsets[l, 0]    ^ a_offsets[l, 1] ...                                 N*E ^

    kv_l[1, b0 : b0+N]  (B region, N * E elements)
    |B q_proj packed (out_q/16 panels of (r_q, 16))|B k_proj|B v_proj|...|B down|..free..|
    ^ b_offsets[l, 0]    ^ b_offsets[l, 1] ...

Modules in TARGETABLE order, each start rounded up to _ALIGN elements (64 bytes or more, so
no vector load straddles two matrices' lines); a module an adapter does not adapt in a layer
takes no space and has rank 0. The panel packing of B is `kernels.pack_lora_b`. N is the
larger of the A and B regions over all layers, rounded up to whole blocks; the two regions
are of similar size for Llama (sum of r * in vs sum of r * out), so little is wasted.

Offsets are relative to the run's first element; the absolute offset passed to the kernel
is first_block * E + offset.

Models with windowed layers (core/kv_groups.py) have fewer cache tensors than layers: a
block id is one page of `page_layers` tensors, which every layer group shares. The run of
blocks is still the adapter's alone (taken from the one pool, never in any group's table),
so its weights can sit in any of the tensors: layer l goes to tensor l % T (T tensors, T
dividing the number of layers), and the layers sharing a tensor are packed one after the
other inside the run, e.g. Gemma 3 (T = 1, 6 layers):

    kv_0[0, b0 : b0+N]  |A layer 0 q ... down|A layer 1 q ... down| ... |A layer 5 ...|..free..|

With T = num_layers (no windowed layer) this is the layout above. Chosen over keeping the
weights outside the KV pool: the kernels, segment tables and the S-LoRA accounting (one
budget, idle adapters evicted for KV) stay the same, and the run costs the same bytes as
without windows (a block is T layers' worth instead of all of them, so it takes
num_layers / T times as many blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.lora.kernels import b_region_elems, block_elems, flat_storage, pack_lora_b
from pagedserve.lora.peft_loader import TARGETABLE, LoRAAdapter

_ALIGN = 32  # elements: 128 bytes in float32, 64 in bfloat16


@dataclass
class AdapterLayout:
    num_blocks: int
    # (num_layers, num_modules), module order = TARGETABLE; LoRA-dtype elements relative to
    # the adapter's first block. Rank 0 (offsets 0) where a module is not adapted.
    a_offsets: torch.Tensor  # int64
    b_offsets: torch.Tensor  # int64
    ranks: torch.Tensor  # int32
    scales: torch.Tensor  # float32
    # Elements per block the layout was planned for (checked by write_adapter).
    block_elems: int
    # Cache tensors the layout was planned for; layer l's weights are in `cache_index(l, num_caches)`.
    num_caches: int


def cache_index(layer: int, num_caches: int) -> int:
    """The cache tensor holding layer `layer`'s adapter weights (see the module docstring)."""
    return layer % num_caches


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def plan_layout(
    adapter: LoRAAdapter, num_layers: int, block_elems: int, num_caches: int | None = None
) -> AdapterLayout:
    """Pack every (layer, module) of `adapter` into a run of blocks (see the module docstring).

    Args:
        num_layers: decoder layers of the model.
        block_elems: LoRA-dtype elements in one block of one half of a layer's cache
            (`kernels.block_elems(kv_cache, dtype)`).
        num_caches: KV cache tensors (None: one per layer); must divide `num_layers`.
    """
    num_caches = num_layers if num_caches is None else num_caches
    if num_caches < 1 or num_layers % num_caches:
        raise ValueError(f"{num_layers} layers cannot share {num_caches} cache tensors evenly")
    shape = (num_layers, len(TARGETABLE))
    a_off = torch.zeros(shape, dtype=torch.int64)
    b_off = torch.zeros(shape, dtype=torch.int64)
    ranks = torch.zeros(shape, dtype=torch.int32)
    scales = torch.zeros(shape, dtype=torch.float32)
    # Per cache tensor: where its next matrix goes in the A and B regions.
    a_end, b_end = [0] * num_caches, [0] * num_caches
    for layer in range(num_layers):
        c = cache_index(layer, num_caches)
        for m, name in enumerate(TARGETABLE):
            w = adapter.weights.get((layer, name))
            if w is None:
                continue
            (rank, in_dim), out_dim = w.lora_a.shape, w.lora_b.shape[0]
            a_off[layer, m], b_off[layer, m] = a_end[c], b_end[c]
            ranks[layer, m], scales[layer, m] = rank, w.scale
            a_end[c] += _align(rank * in_dim)
            b_end[c] += _align(b_region_elems(out_dim, rank))
    needed = max(1, *a_end, *b_end)
    num_blocks = -(-needed // block_elems)
    return AdapterLayout(num_blocks, a_off, b_off, ranks, scales, block_elems, num_caches)


def write_adapter(
    adapter: LoRAAdapter,
    layout: AdapterLayout,
    kv_caches: list[torch.Tensor],
    first_block: int,
    dtype: torch.dtype,
) -> None:
    """Copy the adapter's weights, cast to `dtype`, into blocks [first_block, +num_blocks).

    Only the planned ranges are written; the rest of the run keeps whatever it held (the
    kernel never reads it).

    Raises:
        ValueError: the caches' block size in `dtype` or their number differs from the
            layout's, the run does not fit, or an adapted layer is out of range.
    """
    if len(kv_caches) != layout.num_caches:
        raise ValueError(f"{len(kv_caches)} cache tensors, layout planned for {layout.num_caches}")
    layers = {layer for layer, _ in adapter.weights}
    if layers and max(layers) >= layout.ranks.shape[0]:
        raise ValueError(f"adapter has layer {max(layers)} but the layout has {layout.ranks.shape[0]} layers")
    for layer, kv in enumerate(kv_caches):
        if block_elems(kv, dtype) != layout.block_elems:
            raise ValueError(
                f"layer {layer}: {block_elems(kv, dtype)} {dtype} elements per block, "
                f"layout planned for {layout.block_elems}"
            )
        if first_block < 0 or first_block + layout.num_blocks > kv.shape[1]:
            raise ValueError(
                f"blocks [{first_block}, {first_block + layout.num_blocks}) out of range "
                f"(cache has {kv.shape[1]})"
            )
    base = first_block * layout.block_elems
    for (layer, name), w in adapter.weights.items():
        storage_a, storage_b = flat_storage(kv_caches[cache_index(layer, layout.num_caches)], dtype)
        m = TARGETABLE.index(name)
        a = w.lora_a.reshape(-1)
        b = pack_lora_b(w.lora_b)
        a_start = base + int(layout.a_offsets[layer, m])
        b_start = base + int(layout.b_offsets[layer, m])
        storage_a[a_start : a_start + a.numel()].copy_(a)
        storage_b[b_start : b_start + b.numel()].copy_(b)


def absolute_offsets(
    layout: AdapterLayout, first_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_offsets, b_offsets) + first_block * block_elems: what the kernel is given."""
    base = first_block * layout.block_elems
    return layout.a_offsets + base, layout.b_offsets + base
