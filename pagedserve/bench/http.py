"""`pagedserve bench serve --base-url URL`: the same trace against a live server over HTTP.

Wraps the load generator of `pagedserve.bench.loadgen` (streamed /v1/completions, Poisson or
gamma arrivals, TTFT / TPOT / ITL / E2E per request).
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pagedserve.bench.common import md_table, parse_list, write_outputs
from pagedserve.bench.workloads import synthetic_means


def serve_argv(args: argparse.Namespace, rates: list[float]) -> list[str]:
    """`pagedserve.bench.loadgen` flags for this run (synthetic lengths follow --workload)."""
    argv = ["--base-url", args.base_url, "--num-prompts", str(args.num_requests), "--seed", str(args.seed),
            "--burstiness", str(args.burstiness), "--sweep-rates", ",".join(str(r) for r in rates)]
    if args.dataset:
        argv += ["--dataset", args.dataset]
    elif args.workload == "random":
        argv += ["--prompt-mean", str(args.prompt_len), "--output-mean", str(args.output_len)]
    else:
        prompt_mean, output_mean = synthetic_means(args.workload)
        argv += ["--prompt-mean", str(prompt_mean), "--output-mean", str(output_mean)]
    return argv


def run_http(args: argparse.Namespace) -> int:
    if args.rates == "auto":
        raise ValueError("bench serve --base-url needs explicit --rates (e.g. 1,2,4,inf)")
    rates = parse_list(args.rates, float)
    from pagedserve.bench import loadgen  # httpx: the [bench] extra

    serve_args = loadgen.build_parser().parse_args(serve_argv(args, rates))
    report = asyncio.run(loadgen.run_from_args(serve_args))
    name = args.name or f"http_{args.workload}"
    rows = []
    for run in report["runs"]:
        s = run["summary"]
        rows.append([s["request_rate"], s["completed"], s["failed"], s["request_throughput"], s["output_throughput"],
                     s["ttft_ms"]["mean"], s["ttft_ms"]["p99"], s["tpot_ms"]["mean"], s["e2e_ms"]["mean"] / 1000])
    headers = ["rate (req/s)", "completed", "failed", "req/s", "output tok/s", "TTFT mean (ms)", "TTFT p99 (ms)",
               "TPOT mean (ms)", "E2E mean (s)"]
    md = f"Live server at {args.base_url}, model {report['model']}, {args.num_requests} requests.\n\n"
    md += md_table(headers, rows)
    data: dict[str, Any] = {"settings": {"base_url": args.base_url, "rates": rates, "clock": "wall (HTTP)"},
                            "runs": [run["summary"] for run in report["runs"]], "model": report["model"]}
    paths = write_outputs(args.out_dir, name, data, md)
    print(md)
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = any(run["summary"]["failed"] for run in report["runs"])
    return 1 if failed else 0
