"""Micro-benchmark of one layer of paged attention (KV write + attention) on realistic shapes.

Shapes: 12 heads, 4 KV heads, head_dim 64 (hidden 768), block_size 16, shuffled block ids.
Scenarios: 64 / 256 decodes with context 100-1000; one fresh 512-token prefill; a 512-token
chunk continuing a 512-token cached prefix, alone and in a mixed step with 64 decodes.

Options compared (all produce the same output; checked against the default):
    default          budgeted chunks of 4096 padded context tokens (sorted by length), GQA
                     folded into the decode query, K/V gathered into a reused workspace
    no_fold          same, decode via SDPA(enable_gqa=True)
    no_workspace     same, K/V gathered into fresh tensors
    budget=N         kv_budget_tokens = N padded context tokens per chunk
    padded_groups    one padded gather per group (decode group, prefill group)
    padded_all       one padded gather + mask for the whole step (decodes padded to the prefill)
    matmul_decode    budgeted chunks, decode by explicit matmul + masked softmax + matmul
    prefill_masked   fresh prefill through the cache gather + explicit mask, not is_causal
    cpp              fused C++ kernel (pagedserve/attention/cpp_paged.py): K/V read in place
                     through the block table, online softmax, GQA group per K/V row
    cpp_head_task    same, one KV head per decode task (default: all heads walk together)
    cpp_index_copy   same, new K/V written by index_copy_ instead of the fused C++ write
    cpp_qtile=N      same, N query tokens per prefill work item (default 16)
    cpp_no_split     same, decodes never split across threads
    cpp_row_loop     same, built with -DPAGEDSERVE_ATTN_ROW_BLOCKS=0: one query row at a time
                     (K/V reloaded per row of a GQA group, next-tile prefetch in the score
                     phase only; the kernel before session 13)

Reference points printed first: memory read bandwidth (sum of a large tensor) and copy
bandwidth into a preallocated buffer; decode rows report effective GB/s of real K/V read
(sum over requests of seq_len * KVH * D * 2 * bytes) against those.

    python benchmarks/attention_micro.py [--dtype bfloat16] [--reps 5] [--threads N]
        [--only default,cpp] [--split 16]

--split N (decode scenarios): also time the requests as N interleaved sub-batches, each one
cold in cache when it runs, and report the sum of their per-sub-batch minimum times
("split" columns; the read bandwidth likewise over N chunks). A 1-5 ms call is rarely
preempted, so this stays meaningful when other processes share the cores, where the
minimum over whole 10-100 ms calls does not.

The cpp options are skipped, with a note, when the extension cannot be built.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from itertools import accumulate

import torch

from pagedserve import cpp_build
from pagedserve.attention import cpp_paged
from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.torch_paged import (
    AttnChunk,
    TorchAttentionMetadata,
    TorchPagedAttentionBackend,
    _build_chunk,
    _kv_slots,
)
from pagedserve.cpp_build import KernelUnavailable

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 4, 64, 16


def make_step(kinds: list[tuple[int, int]], dtype: torch.dtype, seed: int = 0):
    """kinds: (cached, new) per request -> (cache, q, k, v, common), shuffled block ids."""
    rng = random.Random(seed)
    nblocks = [-(-(c + n) // BLOCK_SIZE) for c, n in kinds]
    pool = list(range(sum(nblocks) + 8))
    rng.shuffle(pool)
    tables, slots, start = [], [], 0
    for (c, n), nb in zip(kinds, nblocks, strict=True):
        blocks = pool[start : start + nb]
        start += nb
        tables.append(blocks)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)]
    width = max(nblocks)
    q_lens = [n for _, n in kinds]
    s_lens = [c + n for c, n in kinds]
    cache = torch.randn(2, len(pool), BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)
    tokens = sum(q_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM).to(dtype)
    common = CommonAttentionMetadata(
        num_tokens=tokens,
        num_seqs=len(kinds),
        block_size=BLOCK_SIZE,
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor([0, *accumulate(q_lens)]),
        seq_lens=torch.tensor(s_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        query_lens_list=q_lens,
        seq_lens_list=s_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(s_lens),
    )
    return cache, q, k, v, common


class MatmulDecodeBackend(TorchPagedAttentionBackend):
    """Decode chunks by explicit matmul + masked softmax instead of SDPA."""

    def _attend(self, c: AttnChunk, query, key, value, cache, scale):
        if c.max_q != 1 or c.kv_slots is None:
            return super()._attend(c, query, key, value, cache, scale)
        n, ctx = c.num_seqs, c.max_ctx
        q = query[c.q_range[0] : c.q_range[1]] if c.q_range else query.index_select(0, c.q_rows)
        group = HEADS // KV_HEADS
        q = q.view(n, KV_HEADS, group, HEAD_DIM)
        k = cache[0].index_select(0, c.kv_slots).view(n, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = cache[1].index_select(0, c.kv_slots).view(n, ctx, KV_HEADS, HEAD_DIM).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (n, KVH, group, ctx)
        if c.mask is not None:
            scores.masked_fill_(~c.mask, float("-inf"))
        probs = scores.softmax(-1).to(v.dtype)
        return torch.matmul(probs, v).reshape(n, HEADS, HEAD_DIM)


def meta_with_groups(backend, common: CommonAttentionMetadata, groups: list[list[int]]):
    q_starts = [0, *accumulate(common.query_lens_list)]
    chunks = [_build_chunk(common, g, q_starts, backend.device) for g in groups]
    return TorchAttentionMetadata(backend, common.num_tokens, common.slot_mapping, chunks)


def padded_groups(backend, common):
    dec = [i for i, q in enumerate(common.query_lens_list) if q == 1]
    pre = [i for i, q in enumerate(common.query_lens_list) if q > 1]
    return meta_with_groups(backend, common, [g for g in (dec, pre) if g])


def padded_all(backend, common):
    return meta_with_groups(backend, common, [list(range(common.num_seqs))])


def prefill_masked(backend, common):
    meta = backend.build_metadata(common)
    for c in meta.chunks:
        if c.kv_slots is None:  # fresh prefill: force the cache gather + explicit causal mask
            reqs = [i for i, q in enumerate(common.query_lens_list) if q == c.max_q][:1]
            c.kv_slots = _kv_slots(
                common, reqs, torch.tensor([c.max_ctx]), c.max_ctx, backend.device
            )
            t = torch.arange(c.max_q)
            c.mask = (torch.arange(c.max_ctx)[None, :] <= t[:, None])[None, None]
            c.is_causal = False
    return meta


def cpp_options() -> dict[str, tuple[AttentionBackend, Callable | None]]:
    try:
        cpp_paged.load_extension()
    except KernelUnavailable as exc:
        print(f"cpp options skipped: {exc}")
        return {}
    make = cpp_paged.CppPagedAttentionBackend
    opts: dict[str, tuple[AttentionBackend, Callable | None]] = {
        "cpp": (make(), None),
        "cpp_head_task": (make(heads_per_task=1), None),
        "cpp_index_copy": (make(fused_cache_write=False), None),
        "cpp_no_split": (make(min_part_tokens=1 << 30), None),
    }
    for q_tile in (4, 8, 32, 64):
        opts[f"cpp_qtile={q_tile}"] = (make(q_tile=q_tile), None)
    row_loop = cpp_build.load(
        cpp_build.PAGED_ATTENTION,
        ("-DPAGEDSERVE_ATTN_ROW_BLOCKS=0",),
        namespace="pagedserve_attn_row_loop",
    )
    if row_loop.ops is not None:
        opts["cpp_row_loop"] = (make(ops=row_loop.ops), None)
    return opts


def options() -> dict[str, tuple[AttentionBackend, Callable | None]]:
    opts: dict[str, tuple[AttentionBackend, Callable | None]] = {
        "default": (TorchPagedAttentionBackend(), None),
        "no_fold": (TorchPagedAttentionBackend(fold_gqa_decode=False), None),
    }
    opts["no_workspace"] = (TorchPagedAttentionBackend(use_workspace=False), None)
    for budget in (1024, 2048, 8192, 16384):
        opts[f"budget={budget}"] = (TorchPagedAttentionBackend(kv_budget_tokens=budget), None)
    opts["padded_groups"] = (TorchPagedAttentionBackend(), padded_groups)
    opts["padded_all"] = (TorchPagedAttentionBackend(), padded_all)
    opts["matmul_decode"] = (MatmulDecodeBackend(), None)
    opts["prefill_masked"] = (TorchPagedAttentionBackend(), prefill_masked)
    return opts | cpp_options()


def timeit(fn: Callable[[], object], reps: int) -> float:
    """Minimum wall time in ms: robust to other processes sharing the cores."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def bandwidth(reps: int, split: int = 1) -> tuple[float, float, float]:
    """(read GB/s, copy GB/s counting read + write, read GB/s over `split` chunks) on 256 MiB."""
    src = torch.randn(64 << 20)
    dst = torch.empty_like(src)
    t_read = timeit(lambda: src.sum(), reps)
    t_copy = timeit(lambda: dst.copy_(src), reps)
    chunks = src.chunk(split)
    best = [float("inf")] * split
    for _ in range(reps):
        for i, c in enumerate(chunks):
            t0 = time.perf_counter()
            c.sum()
            best[i] = min(best[i], time.perf_counter() - t0)
    nbytes = src.numel() * 4
    return nbytes / t_read / 1e6, 2 * nbytes / t_copy / 1e6, nbytes / sum(best) / 1e9


def scenarios(rng: random.Random) -> dict[str, list[tuple[int, int]]]:
    def decodes(n: int) -> list[tuple[int, int]]:
        return [(rng.randint(99, 999), 1) for _ in range(n)]

    return {
        "decode x64 ctx 100-1000": decodes(64),
        "decode x256 ctx 100-1000": decodes(256),
        "prefill 512 fresh": [(0, 512)],
        "prefill 512 chunk @512 cached": [(512, 512)],
        "mixed: 64 decodes + 512 chunk @512": decodes(64) + [(512, 512)],
    }


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    parser.add_argument("--only", default="", help="comma-separated option names")
    parser.add_argument("--split", type=int, default=1, help="decode sub-batches (see above)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    read_bw, copy_bw, split_bw = bandwidth(args.reps, args.split)
    split_s = f", read over {args.split} chunks {split_bw:.1f} GB/s" if args.split > 1 else ""
    print(
        f"threads={torch.get_num_threads()} dtype={args.dtype}  "
        f"read {read_bw:.1f} GB/s, copy {copy_bw:.1f} GB/s (read+write){split_s}"
    )
    opts = options()
    if args.only:
        opts = {k: v for k, v in opts.items() if k in args.only.split(",")}
    for name, kinds in scenarios(random.Random(0)).items():
        run_scenario(name, kinds, opts, dtype, args.reps, args.split)


def run_scenario(
    name: str, kinds: list[tuple[int, int]], opts: dict, dtype: torch.dtype, reps: int, split: int
) -> None:
    cache, q, k, v, common = make_step(kinds, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = sum(common.seq_lens_list) * KV_HEADS * HEAD_DIM * 2 * elem
    print(
        f"\n{name}: tokens={common.num_tokens} sum(seq_len)={sum(common.seq_lens_list)} "
        f"K/V read={kv_bytes / 1e6:.1f} MB"
    )
    runs, errs, ref = {}, {}, None
    for opt, (backend, make_meta) in opts.items():
        meta = make_meta(backend, common) if make_meta else backend.build_metadata(common)
        out = backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)  # also the warm-up
        ref = out if ref is None else ref
        errs[opt] = (out.float() - ref.float()).abs().max().item()
        runs[opt] = (backend, meta)
    # Round-robin over the options so that interference from other processes hits all alike.
    times: dict[str, list[float]] = {opt: [] for opt in runs}
    for _ in range(reps):
        for opt, (backend, meta) in runs.items():
            t0 = time.perf_counter()
            backend.forward(q, k, v, cache, meta, HEAD_DIM**-0.5)
            times[opt].append(time.perf_counter() - t0)
    decode_only = all(n == 1 for n in common.query_lens_list)
    split_ms = split_times(opts, (q, k, v, cache, common), split, reps) if decode_only else {}
    for opt, (backend, meta) in runs.items():
        ms = min(times[opt]) * 1e3
        build = timeit(lambda b=backend: b.build_metadata(common), 3)
        build_s = f"{build:6.2f} ms" if opts[opt][1] is None else "   n/a   "
        sp = split_ms.get(opt)
        split_s = f"  split {sp:7.2f} ms {kv_bytes / sp / 1e6:5.1f} GB/s" if sp else ""
        print(
            f"  {opt:16s} {ms:8.2f} ms/layer  {kv_bytes / ms / 1e6:6.1f} GB/s  "
            f"{work_units(meta):11s} build={build_s}  maxerr={errs[opt]:.1e}{split_s}"
        )


def decode_subset(common: CommonAttentionMetadata, idx: list[int]) -> CommonAttentionMetadata:
    """The decode-only step restricted to requests `idx` (token i is request i's)."""
    s_lens = [common.seq_lens_list[i] for i in idx]
    rows = torch.tensor(idx)
    return CommonAttentionMetadata(
        num_tokens=len(idx),
        num_seqs=len(idx),
        block_size=common.block_size,
        slot_mapping=common.slot_mapping[rows],
        query_start_loc=torch.arange(len(idx) + 1),
        seq_lens=common.seq_lens[rows],
        block_tables=common.block_tables[rows],
        query_lens_list=[1] * len(idx),
        seq_lens_list=s_lens,
        max_query_len=1,
        max_seq_len=max(s_lens),
    )


def split_times(opts: dict, step: tuple, split: int, reps: int) -> dict[str, float]:
    """Per option: sum over `split` interleaved sub-batches of their minimum time, in ms."""
    if split <= 1:
        return {}
    q, k, v, cache, common = step
    subs = [list(range(i, common.num_seqs, split)) for i in range(split)]
    subs = [s for s in subs if s]
    parts = [(decode_subset(common, s), torch.tensor(s)) for s in subs]
    inputs = [(q[r], k[r], v[r]) for _, r in parts]
    metas = {
        opt: [make(b, c) if make else b.build_metadata(c) for c, _ in parts]
        for opt, (b, make) in opts.items()
    }
    best = {opt: [float("inf")] * len(parts) for opt in opts}
    # Options outer, sub-batches inner: the other sub-batches pass between two runs of one,
    # so each runs cold in cache, as the whole batch would.
    for _ in range(reps):
        for opt, (backend, _) in opts.items():
            for i, (qi, ki, vi) in enumerate(inputs):
                t0 = time.perf_counter()
                backend.forward(qi, ki, vi, cache, metas[opt][i], HEAD_DIM**-0.5)
                best[opt][i] = min(best[opt][i], time.perf_counter() - t0)
    return {opt: sum(ts) * 1e3 for opt, ts in best.items()}


def work_units(meta: object) -> str:
    """SDPA chunks of the torch backend, work items of the C++ one."""
    if isinstance(meta, TorchAttentionMetadata):
        return f"chunks={len(meta.chunks):4d}"
    if isinstance(meta, cpp_paged.CppAttentionMetadata):
        return f"items={meta.items.shape[0]:5d}"
    return ""


if __name__ == "__main__":
    main()
