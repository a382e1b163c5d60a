"""Per-step LoRA segment tables: built once per step, sliced per (layer, module).

The flat token batch is cut into runs of consecutive tokens that use one adapter:

    tokens:    | req0 (ad 3) | req1 (ad 3) | req2 (base) | req3 (ad 7) | req4 (base) |
    segments:  |<---- s0: adapter 3 ----->|<- s1: r=0 ->|<- s2: ad 7->|  (not in any)
    seg_starts  0                          n0+n1        ...          ...

Neighbouring requests with the same adapter merge into one segment (longer segments run
more efficiently); base-model runs between segments become rank-0 segments (skipped), and
leading / trailing ones fall outside [seg_starts[0], seg_starts[S]). The scheduler orders a
step's requests by adapter, so segments are as long as they can be.

Tables are contiguous (num_layers, num_modules, S): `segments.apply(y, x, storage_a,
storage_b, table_slices(layer, modules))` has the op read rows (layer, module) in place, all
of a fused projection's modules in one call (the fast path); `segments.args(layer, module)`
gives (S,) views for `lora_apply`. The slices depend only on the layer and its modules, so a
wrapper computes them once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.lora import kernels
from pagedserve.lora.kernels import lora_apply_slices
from pagedserve.lora.layout import AdapterLayout
from pagedserve.lora.peft_loader import TARGETABLE


@dataclass(frozen=True, slots=True, eq=False)
class ResidentAdapter:
    """An adapter written into KV blocks [first_block, first_block + layout.num_blocks)."""

    layout: AdapterLayout
    first_block: int


@dataclass(slots=True)
class LoRASegments:
    seg_starts: torch.Tensor  # (S + 1,) int64 token offsets
    a_offsets: torch.Tensor  # (num_layers, num_modules, S) int64, absolute
    b_offsets: torch.Tensor  # (num_layers, num_modules, S) int64, absolute
    ranks: torch.Tensor  # (num_layers, num_modules, S) int32
    scales: torch.Tensor  # (num_layers, num_modules, S) float32

    @property
    def num_segments(self) -> int:
        return self.seg_starts.numel() - 1

    def args(
        self, layer: int, module: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seg_starts, a_offsets, b_offsets, ranks, scales) for `lora_apply`."""
        return (self.seg_starts, self.a_offsets[layer, module], self.b_offsets[layer, module],
                self.ranks[layer, module], self.scales[layer, module])

    def apply(
        self,
        y: torch.Tensor,
        x: torch.Tensor,
        storage_a: torch.Tensor,
        storage_b: torch.Tensor,
        slices: list[int],
    ) -> None:
        """y[:, first:end] += each module's deltas, for `slices` from `table_slices`: one op
        call reading the tables in place (no Python views, ~1.5 us each)."""
        lora_apply_slices(y, x, storage_a, storage_b, self.seg_starts, self.a_offsets,
                          self.b_offsets, self.ranks, self.scales, slices)

    def linear(
        self,
        x: torch.Tensor,
        packed_weight: torch.Tensor,
        bias: torch.Tensor | None,
        storage_a: torch.Tensor,
        storage_b: torch.Tensor,
        slices: list[int],
    ) -> torch.Tensor:
        """oneDNN's projection of x by a prepacked weight (`quantization/packed.py`) plus
        `apply`'s deltas, in one op call (csrc: lora_linear), bit for bit the two run apart.
        Only where `kernels.kernel_handles` holds."""
        return kernels._ops_or_none().lora_linear(
            x, packed_weight, bias, storage_a, storage_b, self.seg_starts, self.a_offsets, self.b_offsets,
            self.ranks, self.scales, slices, kernels.MM_MIN_ROWS, kernels.MM_MIN_RANK)


def table_slices(layer: int, modules: Sequence[tuple[int, int, int]],
                 num_modules: int = len(TARGETABLE)) -> list[int]:
    """The kernel's slices, [table row, first column, end column] per module, for the
    (TARGETABLE index, first column, end column) modules of one layer."""
    return [v for m, start, end in modules for v in (layer * num_modules + m, start, end)]


def _key(adapter: ResidentAdapter | None) -> int:
    return -1 if adapter is None else adapter.first_block


def build_segments(
    runs: Sequence[tuple[int, ResidentAdapter | None]], num_layers: int, num_modules: int,
    merge_neighbours: bool = True,
) -> LoRASegments:
    """Segment tables for a step whose tokens come in `runs` of (num_tokens, adapter or None).

    Args:
        runs: in token order, e.g. one per scheduled request; None = base model.
        num_layers, num_modules: the layouts' table shape.
        merge_neighbours: neighbouring runs with one adapter become one segment (False:
            a segment per run, for benchmarks that compare the two).
    """
    merged: list[list] = []  # [start, end, adapter]
    pos = 0
    for n, adapter in runs:
        if n <= 0:
            continue
        # Resident adapters never share a first block, so it identifies the adapter.
        if merge_neighbours and merged and _key(merged[-1][2]) == _key(adapter):
            merged[-1][1] += n
        else:
            merged.append([pos, pos + n, adapter])
        pos += n
    while merged and merged[-1][2] is None:
        merged.pop()
    while merged and merged[0][2] is None:
        merged.pop(0)
    shape = (num_layers, num_modules)
    zeros_i64 = torch.zeros(shape, dtype=torch.int64)
    a_cols, b_cols, r_cols, s_cols = [], [], [], []
    for _, _, adapter in merged:
        if adapter is None:
            a_cols.append(zeros_i64)
            b_cols.append(zeros_i64)
            r_cols.append(torch.zeros(shape, dtype=torch.int32))
            s_cols.append(torch.zeros(shape, dtype=torch.float32))
            continue
        base = adapter.first_block * adapter.layout.block_elems
        a_cols.append(adapter.layout.a_offsets + base)
        b_cols.append(adapter.layout.b_offsets + base)
        r_cols.append(adapter.layout.ranks)
        s_cols.append(adapter.layout.scales)
    starts = [m[0] for m in merged] + [merged[-1][1]] if merged else [0]

    def stack(cols: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if not cols:
            return torch.zeros((*shape, 0), dtype=dtype)
        return torch.stack(cols, dim=-1).contiguous()

    return LoRASegments(
        seg_starts=torch.tensor(starts, dtype=torch.int64),
        a_offsets=stack(a_cols, torch.int64),
        b_offsets=stack(b_cols, torch.int64),
        ranks=stack(r_cols, torch.int32),
        scales=stack(s_cols, torch.float32),
    )
