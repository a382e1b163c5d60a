"""`pagedserve bench memory`: where the KV memory goes (the vLLM paper's Fig. 2).

The real engine runs a ShareGPT-like trace (all requests queued at once, so memory is the
bottleneck the whole run) once per allocation scheme, in the same KV memory, and classifies
every KV slot after every step (`MemoryBreakdown`: token states / reserved / internal /
external fragmentation). The shares depend only on what the scheduler and allocator do with
the request lengths, not on the model's weights, so the tiny "llama-gqa" model is used with
unscaled ShareGPT lengths (prompt mean ~161, output ~338, each capped at 1024; max_model_len
2048 as in the paper): the picture is faithful and a run takes seconds.
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
from pagedserve.bench.plots import plot_memory
from pagedserve.bench.sim import run_simulated, summarize
from pagedserve.bench.workloads import arrival_times

DEFAULT_CONFIGS = "paged:8,paged:16,paged:32,contiguous-max,contiguous-pow2,contiguous-oracle"
CATEGORIES = ("token_states", "reserved", "internal", "external")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated: paged:<block size> or a contiguous kind")
    parser.add_argument("--contiguous-block-size", type=int, default=16,
                        help="block size the contiguous regions are expressed in")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = all queued at once")


def parse_config(text: str, contiguous_block_size: int) -> tuple[str, int]:
    """'paged:16' -> ('paged', 16); 'contiguous-max' -> ('contiguous-max', contiguous block size)."""
    kind, _, block = text.partition(":")
    if kind == "paged":
        return kind, int(block or 16)
    return kind, int(block or contiguous_block_size)


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.num_requests = min(args.num_requests, 40)
        args.kv_tokens = min(args.kv_tokens, 8192)
    model = resolve_model_path(args.model)
    requests = requests_from_args(args, model)
    arrivals = arrival_times(len(requests), args.request_rate, seed=args.seed)
    results = []
    configs = [parse_config(c, args.contiguous_block_size) for c in parse_list(args.configs)]
    with torch_threads(args.threads):
        for kind, block_size in configs:
            spec = EngineSpec(model, kind, block_size=block_size, kv_tokens=args.kv_tokens,
                              max_model_len=args.max_model_len)
            results.append(_run_one(spec, requests, arrivals, args.progress))
    data = {"settings": _settings(args, requests), "results": results}
    paths = write_outputs(args.out_dir, args.name or "memory", data, markdown(data))
    paths.append(plot_memory(data, args.out_dir))
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_one(spec: EngineSpec, requests: list, arrivals: list[float], show: bool) -> dict[str, Any]:
    engine = make_engine(spec)
    warm_up(engine)
    kv = engine.kv_manager
    reallocations = getattr(kv, "num_reallocations", 0)
    with progress(len(requests), spec.label, show) as bar:
        run = run_simulated(engine, requests, arrivals, sample_memory=True, on_finish=lambda: bar.update(1))
    summary = summarize(run)
    summary["num_reallocations"] = getattr(kv, "num_reallocations", 0) - reallocations
    engine.assert_no_leaks()
    return {"label": spec.label, "kv_allocation": spec.kv_allocation, "block_size": spec.block_size, **summary}


def _settings(args: argparse.Namespace, requests: list) -> dict[str, Any]:
    n = max(len(requests), 1)
    return {
        "model": args.model, "workload": args.dataset or args.workload, "num_requests": len(requests),
        "kv_tokens": args.kv_tokens, "max_model_len": args.max_model_len, "request_rate": args.request_rate,
        "mean_prompt_len": sum(len(r.prompt_token_ids) for r in requests) / n,
        "mean_output_len": sum(r.output_len for r in requests) / n, "seed": args.seed,
    }


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    rows = []
    for r in data["results"]:
        shares = r["memory"]["shares"]
        rows.append([r["label"], *(f"{100 * shares[c]:.1f}" for c in CATEGORIES),
                     f"{100 * r['memory']['rounding_share']:.1f}", f"{r['mean_batched_requests']:.1f}",
                     r["num_preemptions"], r["num_reallocations"], f"{r['output_throughput']:.0f}"])
    headers = ["allocation", "token states %", "reserved %", "internal frag. %", "external frag. %",
               "(of which block rounding %)", "mean batch", "preemptions", "reallocations", "output tok/s"]
    title = (f"KV memory breakdown, {s['num_requests']} {s['workload']} requests (prompt mean "
             f"{s['mean_prompt_len']:.0f}, output mean {s['mean_output_len']:.0f}), {s['kv_tokens']} KV slots, "
             f"max_model_len {s['max_model_len']}, model {s['model']}; shares of KV memory in use or unusable, "
             "summed over every engine step.")
    return f"{title}\n\n{md_table(headers, rows)}"
