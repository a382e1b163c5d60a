"""Each C++ kernel's native build against its AVX2 build (x86-64-v3) on the same machine, paired
in one process (issue 32): on an AVX-512 CPU the native build takes the AVX-512 code (16-lane
float in paged attention and the LoRA kernel, AVX512-VNNI `vpdpbusd` in the int8 x int8 GEMV),
the AVX2 build what an AVX2-only CPU runs. bf16 rows times bf16 weights take AVX512-BF16
`vdpbf16ps` natively. Both builds read the same tensors; calls alternate
native / avx2 (and which goes first) so the VM's swings hit both alike.

    python benchmarks/isa_variants.py [--reps 31] [--threads 2]

Prints, per case, each build's median time and native's speed-up (avx2 / native: > 1 means
the AVX-512 code is faster). The CPU's model name and flags head the output.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from pagedserve import cpp_build
from pagedserve.attention import cpp_paged
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.cpp_build import cpu_description
from pagedserve.quantization import gemv

Case = Callable[[object], object]  # ops namespace -> result


def gemv_cases() -> dict[str, Case]:
    """SmolLM2's largest layer (1536 x 576) and Qwen2.5-1.5B's MLP shape (8960 x 1536)."""
    cases: dict[str, Case] = {}
    for n, k in ((1536, 576), (8960, 1536)):
        gen = torch.Generator().manual_seed(n)
        w = torch.randn(n, k, generator=gen) * 0.05
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        scale = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
        quads, scales = gemv.pack_int8_quads(q), gemv.pack_int8_grouped(q, scale)[1]
        bf16_tiles, f32_tiles = gemv.pack_tiles(w.bfloat16()), gemv.pack_tiles(w)
        for rows in (1, 4, 8, 16):
            x = torch.randn(rows, k, generator=gen)
            cases[f"gemv int8 x q8 (vnni)  {n}x{k} rows={rows}"] = (
                lambda ops, x=x, quads=quads, scales=scales: ops.gemv_int8_q8(x, quads, scales, None))
            cases[f"gemv bf16 x bf16 w (dpbf16) {n}x{k} rows={rows}"] = (
                lambda ops, x=x.bfloat16(), t=bf16_tiles: ops.gemv_dense(x, t, None))
            cases[f"gemv fp32 x bf16 w     {n}x{k} rows={rows}"] = (
                lambda ops, x=x, t=bf16_tiles: ops.gemv_dense(x, t, None))
            cases[f"gemv fp32 weights      {n}x{k} rows={rows}"] = (
                lambda ops, x=x, t=f32_tiles: ops.gemv_dense(x, t, None))
    return cases


def attention_cases() -> dict[str, Case]:
    """Decode over 16 sequences of 512 tokens, GQA 9:3 and 12:2, head_dim 64 / 128, float32."""
    cases: dict[str, Case] = {}
    for heads, kv_heads, dim in ((9, 3, 64), (12, 2, 128)):
        seqs, ctx, bs = 16, 512, 16
        blocks = seqs * ctx // bs
        cache = torch.randn(2, blocks, bs, kv_heads, dim)
        order = list(range(blocks))
        random.Random(0).shuffle(order)
        table = torch.tensor(order, dtype=torch.int32).view(seqs, ctx // bs)
        qkv = torch.randn(seqs, heads + 2 * kv_heads, dim)
        q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
        common = CommonAttentionMetadata(
            num_tokens=seqs, num_seqs=seqs, block_size=bs,
            slot_mapping=table[:, -1].long() * bs + bs - 1,
            query_start_loc=torch.arange(seqs + 1), seq_lens=torch.full((seqs,), ctx),
            block_tables=table, query_lens_list=[1] * seqs, seq_lens_list=[ctx] * seqs,
            max_query_len=1, max_seq_len=ctx)

        def run(ops, q=q, k=k, v=v, cache=cache, common=common, dim=dim):
            backend = cpp_paged.CppPagedAttentionBackend(ops=ops)
            return backend.forward(q, k, v, cache, backend.build_metadata(common), dim**-0.5)

        cases[f"paged attention decode  h{heads}kv{kv_heads}d{dim} 16x512"] = run
    return cases


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_description())
    if "avx2" not in cpp_build.runnable_isas():
        raise SystemExit("this CPU has no AVX-512: its native build is the AVX2 build")
    pairs = {kernel: {isa: cpp_build.load_isa(kernel, isa).require() for isa in ("native", "avx2")}
             for kernel in (cpp_build.GEMV, cpp_build.PAGED_ATTENTION)}
    cases = [(cpp_build.GEMV, gemv_cases()), (cpp_build.PAGED_ATTENTION, attention_cases())]
    print(f"{'case':58s} {'native ms':>10s} {'avx2 ms':>10s} {'avx2/native':>12s}")
    for kernel, table in cases:
        builds = pairs[kernel]
        for name, case in table.items():
            a, b = case(builds["native"]), case(builds["avx2"])
            # The same numbers by other code (bf16 outputs: one rounding, summed in another order).
            tol = 1e-2 if a.dtype == torch.bfloat16 else 1e-4
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
            times: dict[str, list[float]] = {"native": [], "avx2": []}
            for rep in range(args.reps):
                order = ("native", "avx2") if rep % 2 else ("avx2", "native")
                for isa in order:
                    times[isa].append(timed(lambda ops=builds[isa], case=case: case(ops)))
            nat, avx = (statistics.median(times[i]) * 1e3 for i in ("native", "avx2"))
            print(f"{name:58s} {nat:10.3f} {avx:10.3f} {avx / nat:12.2f}")


if __name__ == "__main__":
    main()
