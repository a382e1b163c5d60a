"""The decode forward alone, eager vs compiled (issue 18): no scheduler, no sampler.

    python benchmarks/compile_micro.py --model smollm2 --dtype float32 --batches 1 8
    python benchmarks/compile_micro.py --model smollm2 --cpp-wrapper      # + inductor's C++ wrapper
    python benchmarks/compile_micro.py --quick                            # tiny model, smoke run

One engine's model, its compiled decode graphs (one per batch size), the same attention
metadata for every call (B requests decoding at position --context): per variant and batch,
the median over --runs rounds of the mean of --iters forwards, the variants alternating round
by round; also the compile time per size and the largest |hidden| difference to eager.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import resolve_model  # noqa: E402

from pagedserve import LLM  # noqa: E402
from pagedserve.attention.metadata import CommonAttentionMetadata  # noqa: E402
from pagedserve.compilation.decode import CompiledDecode  # noqa: E402
from pagedserve.demo_models import get_model_path, model_names  # noqa: E402


def decode_metadata(batch: int, context: int, block_size: int) -> CommonAttentionMetadata:
    """`batch` requests, each decoding its token at position `context` (blocks laid out one
    request after another)."""
    blocks = context // block_size + 1
    tables = torch.arange(batch * blocks).view(batch, blocks)
    slots = tables[:, context // block_size] * block_size + context % block_size
    return CommonAttentionMetadata(
        num_tokens=batch, num_seqs=batch, block_size=block_size, slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1), seq_lens=torch.full((batch,), context + 1),
        block_tables=tables, query_lens_list=[1] * batch, seq_lens_list=[context + 1] * batch,
        max_query_len=1, max_seq_len=context + 1,
    )


def time_batch(runner, variants: dict[str, CompiledDecode], batch: int, args: argparse.Namespace) -> str:
    """One line: eager and each variant at `batch`, paired round by round."""
    meta = runner.backend.build_metadata(decode_metadata(batch, args.context, runner.block_size))
    ids = torch.randint(3, runner.vocab_size, (batch,))
    positions = torch.full((batch,), args.context)
    calls = {"eager": lambda: runner.model(ids, positions, meta)}
    for name, graphs in variants.items():
        calls[name] = lambda g=graphs: g(ids, positions, meta, runner.kv_caches)
    reference = calls["eager"]()
    diffs = {name: (f() - reference).abs().max().item() for name, f in calls.items() if name != "eager"}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.runs):
        for name, f in calls.items():
            start = time.perf_counter()
            for _ in range(args.iters):
                f()
            times[name].append((time.perf_counter() - start) / args.iters)
    eager = statistics.median(times["eager"])
    parts = [f"eager {eager * 1e3:7.3f} ms"]
    for name in variants:
        t = statistics.median(times[name])
        parts.append(f"{name} {t * 1e3:7.3f} ms ({eager / t:.2f}x, max|diff| {diffs[name]:.1e})")
    return "  ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="smollm2, 125m, a demo model name or an HF folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cpp-wrapper", action="store_true", help="also inductor's C++ wrapper")
    parser.add_argument("--quick", action="store_true", help="llama-gqa, batches 1 and 4, 3 runs")
    args = parser.parse_args()
    if args.quick:
        args.model, args.batches, args.runs, args.iters = "llama-gqa", [1, 4], 3, 10
    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(get_model_path(args.model)) if args.model in model_names() else resolve_model(args.model)
    llm = LLM(path, dtype=args.dtype, max_model_len=max(256, 2 * args.context), kv_cache_memory_bytes=256 << 20)
    runner = llm.llm_engine.runner
    variants: dict[str, CompiledDecode] = {"compiled": CompiledDecode(runner.model, tuple(args.batches))}
    if args.cpp_wrapper:
        variants["cpp wrapper"] = CompiledDecode(runner.model, tuple(args.batches), {"cpp_wrapper": True})
    for name, graphs in variants.items():
        graphs.warm_up(runner.device)
        print(f"{name}: compile " + ", ".join(f"b{b} {s:.1f} s" for b, s in graphs.compile_seconds.items()), flush=True)
    print(f"{args.model} {args.dtype}, threads={torch.get_num_threads()}, context {args.context}")
    with torch.inference_mode():
        for batch in args.batches:
            print(f"  b{batch}: " + time_batch(runner, variants, batch, args), flush=True)


if __name__ == "__main__":
    main()
