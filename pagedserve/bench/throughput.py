"""`pagedserve bench throughput`: offline throughput (every request queued at once) per
KV allocation scheme and batching policy, in the same KV memory.

Wall time is the engine's busy time (nothing is idle when everything is queued), so these
numbers match a plain `LLM.generate` over the same requests. benchmarks/throughput.py
compares against Hugging Face transformers instead.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from pagedserve.bench.common import (
    EngineSpec,
    add_workload_args,
    make_engine,
    md_table,
    parse_list,
    progress,
    requests_from_args,
    resolve_model_path,
    torch_threads,
    warm_up,
    write_outputs,
)
from pagedserve.bench.sim import run_simulated, summarize


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--kv-allocation", default="paged,contiguous-max,contiguous-pow2,contiguous-oracle")
    parser.add_argument("--batching", default="continuous")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.num_requests = min(args.num_requests, 30)
    model = resolve_model_path(args.model)
    requests = requests_from_args(args, model)
    arrivals = [0.0] * len(requests)
    results = []
    specs = [EngineSpec(model, kv, batching, block_size=args.block_size, kv_tokens=args.kv_tokens,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype)
             for batching in parse_list(args.batching) for kv in parse_list(args.kv_allocation)]
    with torch_threads(args.threads):
        for spec in specs:
            engine = make_engine(spec)
            warm_up(engine)
            with progress(len(requests), spec.label, args.progress) as bar:
                run_ = run_simulated(engine, requests, arrivals, on_finish=lambda: bar.update(1))
            engine.assert_no_leaks()
            results.append({"label": spec.label, "kv_allocation": spec.kv_allocation, "batching": spec.batching,
                            "request_rate": math.inf, **summarize(run_)})
    settings = {"model": args.model, "workload": args.dataset or args.workload, "num_requests": len(requests),
                "kv_tokens": args.kv_tokens, "max_model_len": args.max_model_len, "dtype": args.dtype,
                "max_num_seqs": args.max_num_seqs, "seed": args.seed}
    data = {"settings": settings, "results": results}
    paths = write_outputs(args.out_dir, args.name or "throughput", data, markdown(data))
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    headers = ["config", "requests", "time (s)", "req/s", "output tok/s", "total tok/s", "mean batch",
               "preemptions", "peak KV blocks"]
    rows = [[r["label"], r["completed"], r["makespan_s"], r["request_throughput"], r["output_throughput"],
             r["total_token_throughput"], r["mean_batched_requests"], r["num_preemptions"], r["peak_blocks_used"]]
            for r in data["results"]]
    title = (f"Offline throughput, {s['num_requests']} {s['workload']} requests all queued at once, model "
             f"{s['model']} ({s['dtype']}), {s['kv_tokens']} KV slots, max_num_seqs {s['max_num_seqs']}.")
    return f"{title}\n\n{md_table(headers, rows)}"
