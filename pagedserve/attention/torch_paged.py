"""Pure-torch paged attention, tuned for CPU (also runs, unoptimised, on CUDA).

Plan, built once per step in `build_metadata`:

  * Requests are split into a decode group (query_len == 1) and a prefill group, so decode
    queries are never padded to the longest prefill chunk.
  * Each group is sorted by context length (longest first) and cut into *chunks*: runs of
    requests whose padded K/V gather (num_seqs * max_ctx tokens) stays under a budget.
    Sorting keeps padding small; the budget keeps one chunk's gathered K/V cache-resident
    (a few MiB) between the gather and the attention that reads it. Measured on CPU
    (benchmarks/attention_micro.py), one padded gather per group is ~2.3x slower than
    budgeted chunks for 256 decodes, ~6x when gathered into fresh (page-faulted) tensors;
    gathers go into one reused workspace for the same reason (long contexts: 2x).
  * A prefill chunk of >= `solo_prefill_tokens` new tokens runs alone, so big prefills are
    never padded. Per layer the forward therefore loops over chunks (about total context
    tokens / budget: 39 for 256 decodes of ~550 tokens), never over single requests.

Per chunk, per layer:

    q  = query rows of the chunk                   (n * max_q, H, D)    gathered or a slice
    K  = cache slots of positions 0..max_ctx-1     (n, KVH, max_ctx, D) gathered; or the new
         tokens themselves when every request is a fresh prefill (no cached context)
    o  = SDPA(q, K, V, bool mask | is_causal)      flash CPU kernel; decode folds the GQA
         group into the query length: (n, KVH, group, D), 4.6x faster than enable_gqa in bf16
    out[rows] = o                                   scatter back to the flat batch order

int8 KV cache (kv_cache_dtype="int8", layout in pagedserve/quantization/kv_int8.py): new K/V
rows are quantized on write, gathered rows are dequantized into a reused workspace before
SDPA, and the step's new tokens are used in their dequantized form too, so a token attends
identically whether it was read back from the cache or computed in this step.

Sliding-window layers (`sliding_window=W`) use the same gathers with a banded mask (key j is
visible to the query at position p iff p - W < j <= p); the banded chunks are built on the
first windowed layer of a step and kept in the metadata for the step's other windowed layers
(one set per distinct window). Logit softcapping (Gemma 2) cannot go through SDPA, so a
softcapped layer computes its scores eagerly (scores, tanh cap, mask, float32 softmax), as
transformers' eager attention does.

Padding never reads unwritten cache memory: padded query rows repeat the request's last row
and padded K/V positions repeat its last position (clamped), so uninitialised cache slots
(possibly NaN, which would leak through 0 * NaN) are never touched; the mask hides them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.quantization.kv_int8 import SCALE_BYTES, dequantize_kv, quantize_kv, row_bytes


@dataclass(slots=True)
class AttnChunk:
    """Requests attended by one SDPA call, padded to a common (max_q, max_ctx)."""

    num_seqs: int
    max_q: int
    max_ctx: int
    # (start, end) when the chunk is one request: its rows are a contiguous, unpadded slice.
    q_range: tuple[int, int] | None
    # (num_seqs * max_q,) int64: flat-batch row of each padded query row (None with q_range).
    q_rows: torch.Tensor | None
    # (num_valid,) int64 rows of the padded output that are real, and their flat-batch rows;
    # None when the chunk has no query padding (then q_rows are the destinations).
    out_src: torch.Tensor | None
    out_rows: torch.Tensor | None
    # (num_seqs * max_ctx,) int64 flat cache slots of positions 0..max_ctx-1 (clamped).
    # None when every request is a fresh prefill: K/V are then the new tokens at q_rows.
    kv_slots: torch.Tensor | None
    # (num_seqs, 1, max_q, max_ctx) bool, True = attend; None when not needed.
    mask: torch.Tensor | None
    is_causal: bool


@dataclass(slots=True)
class TorchAttentionMetadata(AttentionMetadata):
    backend: TorchPagedAttentionBackend
    num_tokens: int
    # (num_tokens,) int64 flat slot of each new token.
    slot_mapping: torch.Tensor
    chunks: list[AttnChunk]
    # The step and its request groups, for the windowed chunks built on first use.
    common: CommonAttentionMetadata | None = None
    groups: list[list[int]] = field(default_factory=list)
    # sliding window -> chunks with the banded mask (same groups as `chunks`).
    windowed: dict[int, list[AttnChunk]] = field(default_factory=dict)


class TorchPagedAttentionBackend(AttentionBackend):
    """Gather-then-SDPA paged attention.

    Args:
        device: where index tensors live (the device of the model and KV cache).
        kv_budget_tokens: max padded context tokens (num_seqs * max_ctx) gathered per chunk.
        score_budget: max num_seqs * max_q * max_ctx per prefill chunk (bounds mask size).
        solo_prefill_tokens: prefill chunks at least this long run as their own chunk.
        fold_gqa_decode: run decode as SDPA over (n, KVH, group, D) queries (each K/V head
            read once for its whole query group) instead of `enable_gqa`.
        use_workspace: gather K/V into one reused buffer instead of fresh tensors.
    """

    name = "torch_paged"
    supports_kv_int8 = True

    def __init__(
        self,
        device: torch.device | None = None,
        kv_budget_tokens: int = 4096,
        score_budget: int = 1 << 22,
        solo_prefill_tokens: int = 64,
        fold_gqa_decode: bool = True,
        use_workspace: bool = True,
    ) -> None:
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.kv_budget_tokens = kv_budget_tokens
        self.score_budget = score_budget
        self.solo_prefill_tokens = solo_prefill_tokens
        self.fold_gqa_decode = fold_gqa_decode
        self.use_workspace = use_workspace
        # Reused gather destination (2, capacity, KVH, D): big fresh allocations are page-faulted
        # on every call on CPU, which costs more than the copy itself.
        self._workspace: torch.Tensor | None = None
        # int8 cache: reused destination of the dequantized gather, (2, capacity, KVH, D).
        self._dequant_workspace: torch.Tensor | None = None

    # ---- once per step ------------------------------------------------------------------

    def build_metadata(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        q_lens, s_lens = common.query_lens_list, common.seq_lens_list
        q_starts = [0, *accumulate(q_lens)]
        by_len = sorted(range(common.num_seqs), key=lambda i: -s_lens[i])
        decodes = [i for i in by_len if q_lens[i] == 1]
        prefills = [i for i in by_len if q_lens[i] > 1]
        groups = self._group(decodes, q_lens, s_lens) + self._group(prefills, q_lens, s_lens)
        chunks = [_build_chunk(common, g, q_starts, self.device) for g in groups]
        return TorchAttentionMetadata(
            backend=self,
            num_tokens=common.num_tokens,
            slot_mapping=common.slot_mapping.to(self.device, torch.int64),
            chunks=chunks,
            common=common,
            groups=groups,
        )

    def _windowed_chunks(self, meta: TorchAttentionMetadata, window: int) -> list[AttnChunk]:
        """The step's chunks with a banded mask for `window`, built once a step per window."""
        chunks = meta.windowed.get(window)
        if chunks is None:
            assert meta.common is not None
            q_starts = [0, *accumulate(meta.common.query_lens_list)]
            chunks = [
                _build_chunk(meta.common, g, q_starts, self.device, window) for g in meta.groups
            ]
            meta.windowed[window] = chunks
        return chunks

    def _group(self, ids: list[int], q_lens: list[int], s_lens: list[int]) -> list[list[int]]:
        """Cut `ids` (sorted by context length, longest first) into budgeted chunks."""
        groups: list[list[int]] = []
        cur: list[int] = []
        cur_q = 0
        for i in ids:
            if q_lens[i] >= self.solo_prefill_tokens:
                groups.append([i])
                continue
            # Sorted longest first, so the chunk's padded context is its first member's.
            n, max_ctx, max_q = len(cur) + 1, s_lens[cur[0]] if cur else 0, max(cur_q, q_lens[i])
            if cur and (
                n * max_ctx > self.kv_budget_tokens or n * max_q * max_ctx > self.score_budget
            ):
                groups.append(cur)
                cur, cur_q = [], 0
            cur.append(i)
            cur_q = max(cur_q, q_lens[i])
        if cur:
            groups.append(cur)
        return groups

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
        assert isinstance(meta, TorchAttentionMetadata)
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        if kv_cache.dtype == torch.int8:
            # (2, num_slots, KVH, D + 4) int8 rows; attention uses the dequantized new K/V.
            cache = kv_cache.view(2, -1, num_kv_heads, row_bytes(head_dim))
            k_rows, v_rows = quantize_kv(key), quantize_kv(value)
            cache[0].index_copy_(0, meta.slot_mapping, k_rows)
            cache[1].index_copy_(0, meta.slot_mapping, v_rows)
            key, value = dequantize_kv(k_rows, key.dtype), dequantize_kv(v_rows, value.dtype)
        else:
            # (2, num_slots, KVH, D): flat slot = block_id * block_size + offset.
            cache = kv_cache.view(2, -1, num_kv_heads, head_dim)
            cache[0].index_copy_(0, meta.slot_mapping, key)
            cache[1].index_copy_(0, meta.slot_mapping, value)
        chunks = meta.chunks if sliding_window is None else self._windowed_chunks(meta, sliding_window)
        if len(chunks) == 1 and chunks[0].q_range == (0, meta.num_tokens):
            return self._attend(chunks[0], query, key, value, cache, scale, softcap)
        out = torch.empty_like(query)
        for c in chunks:
            o = self._attend(c, query, key, value, cache, scale, softcap)
            if c.q_range is not None:
                out[c.q_range[0] : c.q_range[1]] = o
            elif c.out_src is None:
                out.index_copy_(0, c.q_rows, o)
            else:
                out.index_copy_(0, c.out_rows, o.index_select(0, c.out_src))
        return out

    def _gather(
        self, cache: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows at `slots`: two (len(slots), KVH, D) tensors."""
        if not self.use_workspace:
            return cache[0].index_select(0, slots), cache[1].index_select(0, slots)
        n, shape = slots.shape[0], cache.shape[2:]
        ws = self._workspace
        if (
            ws is None
            or ws.shape[2:] != shape
            or ws.dtype != cache.dtype
            or ws.device != cache.device
        ):
            ws = None
        if ws is None or ws.shape[1] < n:
            capacity = max(n, ws.shape[1] * 3 // 2) if ws is not None else n
            ws = self._workspace = cache.new_empty((2, capacity, *shape))
        k = torch.index_select(cache[0], 0, slots, out=ws[0, :n])
        v = torch.index_select(cache[1], 0, slots, out=ws[1, :n])
        return k, v

    def _dequantize(
        self, k_rows: torch.Tensor, v_rows: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered int8 rows (n, KVH, D + 4) -> K and V (n, KVH, D) in `dtype` (workspace)."""
        n, kvh, d = k_rows.shape[0], k_rows.shape[1], k_rows.shape[2] - SCALE_BYTES
        ws = self._dequant_workspace
        if ws is None or ws.shape[1] < n or ws.shape[2:] != (kvh, d) or ws.dtype != dtype:
            capacity = max(n, ws.shape[1] * 3 // 2) if ws is not None else n
            ws = self._dequant_workspace = k_rows.new_empty((2, capacity, kvh, d), dtype=dtype)
        return dequantize_kv(k_rows, dtype, ws[0, :n]), dequantize_kv(v_rows, dtype, ws[1, :n])

    def _attend(
        self,
        c: AttnChunk,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """SDPA for one chunk; returns the padded output (n * max_q, H, D)."""
        n, max_q, max_ctx = c.num_seqs, c.max_q, c.max_ctx
        num_heads, head_dim, num_kv_heads = query.shape[1], query.shape[2], key.shape[1]
        q = _take_rows(query, c)  # (n * max_q, H, D)
        # Context K/V from the cache; or, for fresh prefills, the new tokens themselves.
        if c.kv_slots is not None:
            k, v = self._gather(cache, c.kv_slots)
            if cache.dtype == torch.int8:
                k, v = self._dequantize(k, v, query.dtype)
        else:
            k, v = _take_rows(key, c), _take_rows(value, c)
        # (n, KVH, max_ctx, D) views over the (n * max_ctx, KVH, D) gather.
        k = k.view(n, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        v = v.view(n, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
        if softcap is not None:
            q = q.view(n, max_q, num_heads, head_dim).transpose(1, 2)  # (n, H, max_q, D)
            o = _softcapped_attention(q, k, v, c.mask, c.is_causal, scale, softcap)
            return o.transpose(1, 2).reshape(n * max_q, num_heads, head_dim)
        if max_q == 1 and self.fold_gqa_decode:
            # Decode: head h uses KV head h // group, so (n, H, D) -> (n, KVH, group, D)
            # makes the group the "query length" and each K/V head is read once.
            q = q.view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=c.mask, scale=scale)
            return o.reshape(n, num_heads, head_dim)
        q = q.view(n, max_q, num_heads, head_dim).transpose(1, 2)  # (n, H, max_q, D)
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=c.mask,
            is_causal=c.is_causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        return o.transpose(1, 2).reshape(n * max_q, num_heads, head_dim)


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    is_causal: bool, scale: float, softcap: float,
) -> torch.Tensor:
    """q (n, H, max_q, D), k/v (n, KVH, max_ctx, D), mask (n, 1, max_q, max_ctx), or None with
    `is_causal` (max_q == max_ctx) or without (every key visible) -> (n, H, max_q, D), as
    transformers' eager attention:
    scores * scale, softcap * tanh(scores / softcap), masked, softmax in float32."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def _take_rows(x: torch.Tensor, c: AttnChunk) -> torch.Tensor:
    """The chunk's (padded) query rows of a flat (num_tokens, ...) tensor."""
    if c.q_range is not None:
        return x[c.q_range[0] : c.q_range[1]]
    return x.index_select(0, c.q_rows)


def _build_chunk(
    common: CommonAttentionMetadata, reqs: list[int], q_starts: list[int], device: torch.device,
    window: int | None = None,
) -> AttnChunk:
    """Index tensors of one chunk (built on CPU from host lists, moved once); with `window`,
    the mask is banded to the last `window` positions of each query, and the gathered
    context of each request starts at its first query's window: positions before it are
    never read (a paged cache may have given their blocks back, core/hybrid_kv_manager.py)."""
    ql = [common.query_lens_list[i] for i in reqs]
    sl = [common.seq_lens_list[i] for i in reqs]
    # Fresh: no cached context, so K/V are exactly the new tokens (no cache gather).
    fresh = all(q == s for q, s in zip(ql, sl, strict=True))
    # First context position gathered per request (0 unless a window hides the start).
    first = [0] * len(reqs) if window is None or fresh else [
        max(0, s - q - window + 1) for q, s in zip(ql, sl, strict=True)]
    n, max_q, max_ctx = len(reqs), max(ql), max(s - f for s, f in zip(sl, first, strict=True))
    uniform = all(s == max_ctx for s in sl) and all(q == max_q for q in ql)
    q_range = (q_starts[reqs[0]], q_starts[reqs[0]] + ql[0]) if n == 1 else None

    qlt, slt = torch.tensor(ql), torch.tensor(sl)
    firstt = torch.tensor(first) if any(first) else None
    t = torch.arange(max_q)
    # Query row t of request r is token min(t, ql-1): padding repeats the last real row.
    t_clamped = torch.minimum(t[None], (qlt - 1)[:, None])  # (n, max_q)
    q_rows = out_src = out_rows = kv_slots = mask = None
    if q_range is None:
        q_rows = (torch.tensor([q_starts[i] for i in reqs])[:, None] + t_clamped).flatten()
        if any(q != max_q for q in ql):
            out_src = (t[None] < qlt[:, None]).flatten().nonzero().squeeze(1)
            out_rows = q_rows[out_src].to(device)
            out_src = out_src.to(device)
        q_rows = q_rows.to(device)
    if not fresh:
        kv_slots = _kv_slots(common, reqs, slt, max_ctx, device, firstt)
    # Fresh prefills of equal length: plain causal (top-left == bottom-right alignment).
    is_causal = fresh and uniform and max_q > 1 and window is None
    if not uniform or (max_q > 1 and not is_causal) or window is not None:
        # Key j is visible to query row t iff j <= (sl - ql) + t: its cached context plus the
        # new tokens up to itself. Padded rows/keys fall outside via the clamps.
        last_visible = (slt - qlt)[:, None] + t_clamped  # (n, max_q)
        keys = torch.arange(max_ctx)[None, None, :]  # context positions: first + index
        if firstt is not None:
            keys = keys + firstt[:, None, None]
        mask = keys <= last_visible[:, :, None]
        if window is not None:  # and j > p - window: the query itself always stays visible
            mask &= keys > last_visible[:, :, None] - window
        mask = mask[:, None].to(device)  # (n, 1, max_q, max_ctx)
    return AttnChunk(
        n, max_q, max_ctx, q_range, q_rows, out_src, out_rows, kv_slots, mask, is_causal
    )


def _kv_slots(
    common: CommonAttentionMetadata,
    reqs: list[int],
    seq_lens: torch.Tensor,
    max_ctx: int,
    device: torch.device,
    first: torch.Tensor | None = None,
) -> torch.Tensor:
    """(n * max_ctx,) flat cache slots of positions first..first+max_ctx-1 (`first`: per
    request, default 0), clamped to seq_len-1."""
    pos = torch.arange(max_ctx)[None] + (first[:, None] if first is not None else 0)
    pos = torch.minimum(pos, (seq_lens - 1)[:, None])  # (n, max_ctx)
    bt_device = common.block_tables.device
    tables = common.block_tables.index_select(0, torch.tensor(reqs, device=bt_device))
    pos = pos.to(bt_device)
    bs = common.block_size
    slots = tables.gather(1, pos // bs) * bs + pos % bs
    return slots.flatten().to(device, torch.int64)
