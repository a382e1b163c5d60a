"""Fused C++ paged attention for CPU (pagedserve/csrc/paged_attention_cpu.cpp), loaded by
`cpp_build` when the backend is constructed.

The kernel reads K/V blocks in place through the block table: no gather, no padding, one
pass over each request's K/V with an online softmax. Work is cut into *items* once per
step here; the kernel runs every (item, KV-head group) as one OpenMP task, handed out
dynamically in item order, so items are sorted by estimated cost (longest first).

    item = (seq, q_begin, q_end, kv_begin, kv_end, part)          int32 row of `items`

    decode (query_len 1):  one item over the whole context ........ part = -1
                           or, when there are too few requests to keep every thread busy,
                           split in parts of `part_tokens` keys ... part = 0, 1, ...
                           merged afterwards by log-sum-exp (one `merges` row per request)
    prefill chunk:         one item per tile of `q_tile` query tokens, keys [0, ctx + q_end)
                           (causal within the chunk, full over the cached context)

A sliding-window layer (key j visible to query i iff i - W < j <= i) gets its own items,
planned once a step per window: a decode over its last W keys, a prefill tile from its first
query's window start; the kernel masks each row's window inside a tile. Keys before that are
never read (a windowed KV group's table holds the null block there). A softcapped layer
(Gemma 2) caps the scores in the kernel, softcap * tanh(s / softcap), before the softmax.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve import cpp_build
from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.cpp_build import KernelUnavailable

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
_TILE_KEYS = 32  # keys per kernel tile (KT in the C++): decode parts are multiples of it


def _cost(query_tokens: int, keys: int) -> int:
    """Relative cost of a work item: a decode is bound by its K/V bytes (~ keys), a prefill
    tile by its FLOPs (~ query tokens x keys); one K/V row ~ the FLOPs of 4 query rows."""
    return keys * (4 + query_tokens)


def load_extension() -> Any:
    """The kernel's op namespace (built on first use on this machine, 10-30 s).

    Raises:
        KernelUnavailable: no source, no compiler / ninja, or the build failed.
    """
    return cpp_build.load(cpp_build.PAGED_ATTENTION).require()


@dataclass(slots=True)
class CppAttentionMetadata(AttentionMetadata):
    backend: CppPagedAttentionBackend
    num_tokens: int
    # (num_tokens,) int64 flat slot of each new token.
    slot_mapping: torch.Tensor
    # (num_seqs, max_blocks) int32; (num_seqs,) int32; (num_seqs + 1,) int32.
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    # (num_items, 6) int32 work items, costliest first; (num_merges, 3) int32 split decodes.
    items: torch.Tensor
    merges: torch.Tensor
    num_parts: int
    max_q: int
    # The step, kept for the torch fallback (dtypes the kernel does not handle).
    common: CommonAttentionMetadata
    fallback: AttentionMetadata | None = None
    # sliding window -> (items, merges, num_parts), planned on first use in the step.
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)


class CppPagedAttentionBackend(AttentionBackend):
    """Paged attention by the fused C++ kernel.

    Args:
        device: must be a CPU device.
        q_tile: query tokens per prefill work item (rows = q_tile * GQA group).
        heads_per_task: KV heads a decode task walks together (0 = all: a token's K/V rows
            of every head are one contiguous run of the cache).
        min_part_tokens: a decode is split into parts no shorter than this.
        parts_per_thread: split decodes until there are about this many items per thread.
        fused_cache_write: write new K/V with the C++ op instead of two `index_copy_`.
        ops: the op namespace of a variant build (`cpp_build.load(..., namespace=...)`);
            default the native one.

    Raises:
        KernelUnavailable: the kernel cannot be built here.
    """

    name = "cpp_paged"

    def __init__(
        self,
        device: torch.device | None = None,
        q_tile: int = 16,
        heads_per_task: int = 0,
        min_part_tokens: int = 512,
        parts_per_thread: int = 4,
        fused_cache_write: bool = True,
        ops: Any = None,
    ) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        if self.device.type != "cpu":
            raise KernelUnavailable(f"the C++ paged-attention kernel is CPU-only, not {device}")
        self.q_tile = q_tile
        self.heads_per_task = heads_per_task
        self.min_part_tokens = min_part_tokens
        self.parts_per_thread = parts_per_thread
        self.fused_cache_write = fused_cache_write
        self.ops = load_extension() if ops is None else ops
        self._fallback_backend: AttentionBackend | None = None

    # ---- once per step ------------------------------------------------------------------

    def build_metadata(self, common: CommonAttentionMetadata) -> CppAttentionMetadata:
        q_lens, s_lens = common.query_lens_list, common.seq_lens_list
        items, merges, num_parts = self._plan_tensors(common, None)
        i32 = torch.int32
        return CppAttentionMetadata(
            backend=self,
            num_tokens=common.num_tokens,
            slot_mapping=common.slot_mapping.to(self.device, torch.int64).contiguous(),
            block_tables=common.block_tables.to(self.device, i32).contiguous(),
            seq_lens=torch.tensor(s_lens, dtype=i32),
            query_start_loc=torch.tensor([0, *itertools.accumulate(q_lens)], dtype=i32),
            items=items,
            merges=merges,
            num_parts=num_parts,
            max_q=min(common.max_query_len, self.q_tile),
            common=common,
        )

    def _plan_tensors(
        self, common: CommonAttentionMetadata, window: int | None
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        items, merges, num_parts = self._plan(
            common.query_lens_list, common.seq_lens_list, torch.get_num_threads(), window)
        i32 = torch.int32
        return (torch.tensor(items, dtype=i32).view(-1, 6),
                torch.tensor(merges, dtype=i32).view(-1, 3), num_parts)

    def _windowed(
        self, meta: CppAttentionMetadata, window: int
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The step's items for a sliding-window layer, planned once a step per window."""
        plan = meta.windowed.get(window)
        if plan is None:
            plan = meta.windowed[window] = self._plan_tensors(meta.common, window)
        return plan

    def _plan(
        self, q_lens: list[int], s_lens: list[int], threads: int, window: int | None = None
    ) -> tuple[list[list[int]], list[list[int]], int]:
        """Work items sorted costliest first, merge rows of split decodes, number of parts.
        With a window, each item starts at the window of its first query."""
        w = window or (1 << 30)
        # Keys a decode reads (split decisions see the windowed work).
        kv_lens = [min(s, w) if q == 1 else s for q, s in zip(q_lens, s_lens, strict=True)]
        part_tokens = self._part_tokens(q_lens, kv_lens, threads)
        costed: list[tuple[int, list[int]]] = []
        merges: list[list[int]] = []
        num_parts = 0
        for seq, (q, s) in enumerate(zip(q_lens, s_lens, strict=True)):
            if q == 1 and min(s, w) > part_tokens:
                bounds = [*range(max(0, s - w), s, part_tokens), s]
                merges.append([seq, num_parts, len(bounds) - 1])
                for b, e in itertools.pairwise(bounds):
                    costed.append((_cost(1, e - b), [seq, 0, 1, b, e, num_parts]))
                    num_parts += 1
                continue
            ctx = s - q
            for qb in range(0, q, self.q_tile):
                qe = min(q, qb + self.q_tile)
                kb = max(0, ctx + qb - w + 1)
                costed.append((_cost(qe - qb, ctx + qe - kb), [seq, qb, qe, kb, ctx + qe, -1]))
        costed.sort(key=lambda c: -c[0])
        return [row for _, row in costed], merges, num_parts

    def _part_tokens(self, q_lens: list[int], s_lens: list[int], threads: int) -> int:
        """Split decodes only when there are too few items to keep `threads` busy."""
        decode_kv = sum(s for q, s in zip(q_lens, s_lens, strict=True) if q == 1)
        target = max(1, self.parts_per_thread * threads)
        if threads <= 1 or decode_kv == 0:
            return 1 << 30
        part = max(self.min_part_tokens, -(-decode_kv // target))
        return -(-part // _TILE_KEYS) * _TILE_KEYS

    # ---- once per layer -----------------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        assert isinstance(meta, CppAttentionMetadata)
        if query.dtype not in _SUPPORTED_DTYPES or kv_cache.dtype != query.dtype:
            return self._forward_fallback(
                query, key, value, kv_cache, meta, scale, sliding_window, softcap)
        self.write_cache(key, value, kv_cache, meta.slot_mapping)
        if query.stride(-1) != 1 or query.stride(1) != query.shape[2]:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        hpt = self.heads_per_task or key.shape[1]
        if sliding_window is None and softcap is None:
            self.ops.paged_attention(
                out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.items, meta.merges, scale, hpt, meta.num_parts, meta.max_q,
            )
            return out
        items, merges, num_parts = meta.items, meta.merges, meta.num_parts
        if sliding_window is not None:
            items, merges, num_parts = self._windowed(meta, sliding_window)
        self.ops.paged_attention_windowed(
            out, query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            items, merges, scale, hpt, num_parts, meta.max_q, sliding_window or 0, softcap or 0.0,
        )
        return out

    def write_cache(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """kv_cache[0/1] at flat `slots` <- key / value (T, KVH, D)."""
        rows_ok = all(t.stride(-1) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
        if self.fused_cache_write and rows_ok:
            self.ops.reshape_and_cache(key, value, kv_cache, slots)
            return
        cache = kv_cache.view(2, -1, key.shape[1], key.shape[2])
        cache[0].index_copy_(0, slots, key)
        cache[1].index_copy_(0, slots, value)

    def _forward_fallback(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: CppAttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Dtypes the kernel lacks (fp16): the torch backend, its metadata built once a step
        (shared by every such layer of the step)."""
        if self._fallback_backend is None:
            from pagedserve.attention.torch_paged import TorchPagedAttentionBackend

            self._fallback_backend = TorchPagedAttentionBackend(device=self.device)
        if meta.fallback is None:
            meta.fallback = self._fallback_backend.build_metadata(meta.common)
        return self._fallback_backend.forward(
            query, key, value, kv_cache, meta.fallback, scale, sliding_window, softcap)
