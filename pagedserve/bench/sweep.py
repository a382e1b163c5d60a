"""`pagedserve bench sweep`: one knob at a time on the 125M model, everything else fixed.

Axes (each point is one short offline run, every request queued at once):

    batch    max_num_seqs = number of requests = B: one full batch of short requests
    context  prompt length (one request at a time): prefill cost and long-context decode
    dtype    float32, bfloat16, and int8 / int4 weights when `LLM(quantization=...)` exists
    block    KV block size 1..128: per-step cost of the block tables vs slots wasted

Per point: TTFT, TPOT, end-to-end latency, throughput, and the KV cache's footprint (bytes
per token, peak blocks in use, peak KV MiB, share of allocated slots holding tokens). KV
memory is sized to hold the whole point without preemption, so the knob alone varies.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from pagedserve.bench.common import (
    EngineSpec,
    llm_accepts,
    make_engine,
    md_table,
    parse_list,
    progress,
    resolve_model_path,
    torch_threads,
    vocab_size,
    warm_up,
    write_outputs,
)
from pagedserve.bench.plots import plot_sweep
from pagedserve.bench.sim import run_simulated, summarize
from pagedserve.bench.workloads import fixed

AXES = ("batch", "context", "dtype", "block")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bench-125m", help="model folder or demo model name")
    parser.add_argument("--axes", default=",".join(AXES), help=f"comma-separated subset of {', '.join(AXES)}")
    parser.add_argument("--batch-sizes", default="1,4,16,64,256")
    parser.add_argument("--batch-prompt-len", type=int, default=32)
    parser.add_argument("--context-lens", default="128,512,1024,2048,4064",
                        help="prompt lengths (prompt + output must fit max_model_len)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="int8 and int4 weights are added when LLM accepts quantization=")
    parser.add_argument("--block-sizes", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--num-requests", type=int, default=8, help="requests per dtype / block-size point")
    parser.add_argument("--prompt-len", type=int, default=128, help="dtype / block-size points")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per point; the fastest is kept (other load on the machine only adds time)")


def _quick(args: argparse.Namespace) -> None:
    args.model, args.repeats = (args.model if args.model != "bench-125m" else "llama-gqa"), 1
    args.batch_sizes, args.context_lens, args.dtypes = "1,4", "16,128", "float32"
    args.block_sizes, args.num_requests, args.output_len, args.max_model_len = "4,16", 2, 4, 256


def plan(args: argparse.Namespace, model: str) -> dict[str, list[tuple[Any, EngineSpec, int, int, int]]]:
    """axis -> [(value, engine spec, requests, prompt len, output len)]."""
    base = EngineSpec(model, max_model_len=args.max_model_len)
    out = args.output_len

    def spec(n: int, p: int, **changes: Any) -> EngineSpec:
        # Room for every request at once, and at least one max_model_len sequence.
        tokens = max(args.max_model_len, n * (p + out)) + 256
        return replace(base, kv_tokens=tokens, **changes)

    n, p = args.num_requests, args.prompt_len
    dtypes: list[tuple[str, str | None]] = [(d, None) for d in parse_list(args.dtypes)]
    if llm_accepts("quantization") and not args.quick:
        dtypes += [("float32", "int8"), ("float32", "int4")]  # quantized weights, fp32 activations
    axes = {
        "batch": [(b, spec(b, args.batch_prompt_len, max_num_seqs=b), b, args.batch_prompt_len, out)
                  for b in parse_list(args.batch_sizes, int)],
        "context": [(c, spec(1, c), 1, c, out) for c in parse_list(args.context_lens, int)],
        "dtype": [(q or d, spec(n, p, dtype=d, quantization=q), n, p, out) for d, q in dtypes],
        "block": [(b, spec(n, p, block_size=b), n, p, out) for b in parse_list(args.block_sizes, int)],
    }
    return {axis: axes[axis] for axis in parse_list(args.axes)}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        _quick(args)
    model = resolve_model_path(args.model)
    points = plan(args, model)
    vocab = vocab_size(model)
    results: dict[str, list[dict[str, Any]]] = {}
    with torch_threads(args.threads), progress(sum(map(len, points.values())), "sweep", args.progress, True) as bar:
        for axis, axis_points in points.items():
            results[axis] = []
            engine, engine_spec = None, None
            for value, spec, n, p, o in axis_points:
                if spec != engine_spec:
                    engine, engine_spec = None, spec  # drop the old engine's memory first
                    engine = _try_engine(spec)
                requests = fixed(n, p, o, vocab, args.seed)
                results[axis].append(_point(engine, spec, value, requests, args.repeats))
                bar.update(1)
    data = {"settings": {"model": args.model, "max_model_len": args.max_model_len, "threads": args.threads,
                         "output_len": args.output_len, "seed": args.seed}, "axes": results}
    paths = write_outputs(args.out_dir, args.name or "sweep", data, markdown(data))
    paths.append(plot_sweep(data, args.out_dir, args.name or "sweep"))
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _try_engine(spec: EngineSpec) -> Any:
    try:
        engine = make_engine(spec)
        warm_up(engine)
        return engine
    except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
        return exc


def _point(engine: Any, spec: EngineSpec, value: Any, requests: list, repeats: int) -> dict[str, Any]:
    point: dict[str, Any] = {"value": value, "num_requests": len(requests),
                             "prompt_len": len(requests[0].prompt_token_ids), "output_len": requests[0].output_len}
    if isinstance(engine, Exception):
        return {**point, "error": f"{type(engine).__name__}: {engine}"}
    runs = [run_simulated(engine, requests, [0.0] * len(requests), sample_memory=True, id_prefix=f"{value}-{i}-")
            for i in range(max(1, repeats))]
    run_ = min(runs, key=lambda r: r.busy_s)
    engine.assert_no_leaks()
    kv_spec = engine.runner.kv_cache_spec()
    summary = summarize(run_)
    return {**point, **summary,
            "kv_bytes_per_token": kv_spec.bytes_per_token,
            "peak_kv_mib": summary["peak_blocks_used"] * kv_spec.bytes_per_block / 2**20,
            "token_state_share": summary["memory"]["shares"]["token_states"]}


def markdown(data: dict[str, Any]) -> str:
    parts = [f"Sweeps on {data['settings']['model']} (one knob at a time; all requests queued at once; "
             f"{data['settings']['threads']} thread(s))."]
    headers = ["value", "requests x prompt/output", "TTFT mean (ms)", "TPOT mean (ms)", "E2E mean (ms)",
               "output tok/s", "total tok/s", "KV bytes/token", "peak KV blocks", "peak KV MiB", "token-state share"]
    for axis, points in data["axes"].items():
        rows = []
        for p in points:
            shape = f"{p['num_requests']} x {p['prompt_len']}/{p['output_len']}"
            if "error" in p:
                rows.append([p["value"], shape, p["error"], *[""] * 8])
                continue
            rows.append([p["value"], shape, p["ttft_ms"]["mean"], p["tpot_ms"]["mean"], p["e2e_ms"]["mean"],
                         p["output_throughput"], p["total_token_throughput"], p["kv_bytes_per_token"],
                         p["peak_blocks_used"], p["peak_kv_mib"], p["token_state_share"]])
        parts.append(f"### {axis}\n\n{md_table(headers, rows)}")
    return "\n\n".join(parts)
