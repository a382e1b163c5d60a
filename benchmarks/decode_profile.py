"""Where a batch-1 decode token goes (issue 18): torch.profiler over a short greedy run.

    python benchmarks/decode_profile.py --model smollm2 --dtype float32 --tokens 64
    python benchmarks/decode_profile.py --model smollm2 --dtype bfloat16 --compile

Per generated token: wall time, time inside the linear kernels (GEMV / oneDNN / F.linear),
inside every other top-level op, and outside any op (Python: module calls, input building,
sampling glue), plus the number of top-level ops dispatched. "Top-level" = ops not called
from inside another op, so nothing is counted twice.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import resolve_model  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402

LINEAR_OPS = ("gemv", "linear", "mkldnn", "addmm", "mm")


def top_level(events: list) -> list:
    """Events not nested in another op event (by time interval, per thread)."""
    ops = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: (e.time_range.start, -e.time_range.end))
    out: list = []
    end_by_thread: dict[int, int] = {}
    for e in ops:
        if e.name.startswith(("ProfilerStep", "## ")):
            continue
        if e.time_range.start >= end_by_thread.get(e.thread, -1):
            out.append(e)
            end_by_thread[e.thread] = e.time_range.end
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="compiled decode (compilation_config level 3)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = {"compilation_config": {"level": 3, "compile_sizes": [1]}} if args.compile else {}
    llm = LLM(resolve_model(args.model), dtype=args.dtype, max_model_len=512, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 << 20, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [1]}], params, use_tqdm=False)  # warm
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [2]}], params, use_tqdm=False)
        wall = time.perf_counter() - start
    every = [e for e in prof.events() if e.device_type.name == "CPU"]
    events = top_level(every)
    per = 1 / args.tokens
    linear = sum(e.time_range.elapsed_us() for e in events if any(k in e.name for k in LINEAR_OPS)) / 1e3
    other = sum(e.time_range.elapsed_us() for e in events) / 1e3 - linear
    total = wall * 1e3
    print(f"{args.model} {args.dtype} compile={args.compile}: {args.tokens} tokens, {total * per:.2f} ms/token (threads={torch.get_num_threads()})")
    print(f"  linear ops  {linear * per:7.2f} ms/token ({100 * linear / total:4.1f}%)")
    print(f"  other ops   {other * per:7.2f} ms/token ({100 * other / total:4.1f}%)")
    print(f"  outside ops {(total - linear - other) * per:7.2f} ms/token ({100 * (total - linear - other) / total:4.1f}%)")
    print(f"  top-level ops per token: {len(events) / args.tokens:.0f}  (a compiled region counts once)")
    kernels = [e for e in every if e.name.startswith(("pagedserve", "aten::"))]
    print(f"  op events per token, nested included: {len(kernels) / args.tokens:.0f}")
    by_name: Counter = Counter()
    counts: Counter = Counter()
    for e in events:
        by_name[e.name] += e.time_range.elapsed_us()
        counts[e.name] += 1
    for name, us in by_name.most_common(args.top):
        print(f"    {name:50} {counts[name] / args.tokens:6.1f}/tok {us / 1e3 * per:7.3f} ms/tok")


if __name__ == "__main__":
    main()
