"""`pagedserve bench serve`: latency and throughput against request rate (the vLLM paper's
Figs. 12 and 13), for KV allocation schemes and batching policies in the same KV memory.

By default the engine runs in-process on a simulated clock (see `bench/sim.py`) advanced
by a step-time model fitted to the engine's measured steps (`bench/clock.py`; --clock
measured uses each step's wall time instead): each point costs the engine's busy time only. With --base-url
the same trace is sent over HTTP to a live OpenAI-compatible server instead, through the
load generator in pagedserve/bench/loadgen.py.

--rates auto first runs the first configuration with every request queued at once; its
request throughput is the capacity C, and the rates are C x --rate-fractions. So the x axis
spans the same load range on any machine, and every scheme meets the same rates.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedserve.bench.clock import fit_step_model, modelled_makespan
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
from pagedserve.bench.http import run_http
from pagedserve.bench.plots import plot_batching, plot_online
from pagedserve.bench.sim import run_simulated, summarize
from pagedserve.bench.workloads import arrival_times

# A calibration run shorter than this (tiny smoke runs) cannot pin 4 coefficients down:
# those runs keep the measured clock.
MIN_FIT_STEPS = 32
DEFAULT_FRACTIONS = "0.2,0.4,0.6,0.8,0.9,1.0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser)
    parser.add_argument("--rates", default="auto", help="comma-separated req/s (inf = all at once), or auto")
    parser.add_argument("--rate-fractions", default=DEFAULT_FRACTIONS, help="--rates auto: fractions of capacity")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    parser.add_argument("--kv-allocation", default="paged,contiguous-max,contiguous-pow2,contiguous-oracle",
                        help="comma-separated allocation schemes")
    parser.add_argument("--batching", default="continuous", help="comma-separated: continuous, static, dynamic")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--batch-window", type=float, default=0.05, help="dynamic batching window (s)")
    parser.add_argument("--clock", default="fitted", choices=["fitted", "measured"],
                        help="advance the simulated clock by a step-time model fitted to measured steps "
                             "(default: immune to other load on the machine), or by each step's wall time")
    parser.add_argument("--base-url", default=None, help="benchmark a live server here instead (HTTP)")


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.num_requests = min(args.num_requests, 30)
        if args.rates == "auto":
            args.rate_fractions = "0.3,1.0"
    if args.base_url:
        return run_http(args)
    name = args.name or ("online_dataset" if args.dataset else f"online_{args.workload}")
    model = resolve_model_path(args.model)
    requests = requests_from_args(args, model)
    specs = [EngineSpec(model, kv, batching, block_size=args.block_size, kv_tokens=args.kv_tokens,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, batch_window_s=args.batch_window)
             for batching in parse_list(args.batching) for kv in parse_list(args.kv_allocation)]
    with torch_threads(args.threads):
        data = sweep_rates(specs, requests, args)
    paths = write_outputs(args.out_dir, name, data, markdown(data))
    many_policies = len({r["batching"] for r in data["results"]}) > 1
    paths.append((plot_batching if many_policies else plot_online)(data, args.out_dir, name))
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def sweep_rates(specs: list[EngineSpec], requests: list, args: argparse.Namespace) -> dict[str, Any]:
    """Every spec at every rate, after a calibration run of the first spec with every request
    queued at once: its throughput is the capacity behind --rates auto, and its steps fit the
    step-time model behind --clock fitted (see bench/clock.py)."""
    first = _engine(specs[0])
    model, capacity, calibration = None, None, None
    if args.rates == "auto" or args.clock == "fitted":
        with progress(len(requests), f"calibration: {specs[0].label}, all queued", args.progress) as bar:
            run_ = run_simulated(first, requests, [0.0] * len(requests), on_finish=lambda: bar.update(1),
                                 id_prefix="calibration-")
        capacity = measured = summarize(run_)["request_throughput"]
        if args.clock == "fitted" and len(run_.steps) >= MIN_FIT_STEPS:
            model = fit_step_model(run_.steps)
            # The capacity on the clock the points will run on: the same steps, modelled.
            capacity = len(requests) / modelled_makespan(run_, model)
        calibration = {"request_throughput_measured": measured, "request_throughput": capacity,
                       "steps": run_.num_steps, "step_model": model.as_dict() if model else None}
    if args.rates == "auto":
        rates = [round(capacity * f, 3) for f in parse_list(args.rate_fractions, float)]
    else:
        rates = parse_list(args.rates, float)
    results: list[dict[str, Any]] = []
    with progress(len(specs) * len(rates), "rate sweep", args.progress, leave=True) as bar:
        for index, spec in enumerate(specs):
            engine = first if index == 0 else _engine(spec)
            for rate in rates:
                results.append(_point(engine, spec, requests, rate, args, model))
                bar.update(1)
            engine.assert_no_leaks()
    settings = {"model": args.model, "workload": args.dataset or args.workload, "num_requests": len(requests),
                "kv_tokens": args.kv_tokens, "block_size": args.block_size, "max_model_len": args.max_model_len,
                "max_num_seqs": args.max_num_seqs, "batch_window_s": args.batch_window,
                "burstiness": args.burstiness, "rates": rates, "capacity_req_s": capacity,
                "mean_prompt_len": sum(len(r.prompt_token_ids) for r in requests) / max(len(requests), 1),
                "mean_output_len": sum(r.output_len for r in requests) / max(len(requests), 1),
                "seed": args.seed, "clock": "fitted" if model else "measured", "calibration": calibration}
    return {"settings": settings, "results": results}


def _engine(spec: EngineSpec) -> Any:
    engine = make_engine(spec)
    warm_up(engine)
    return engine


def _point(
    engine: Any, spec: EngineSpec, requests: list, rate: float, args: argparse.Namespace, step_time: Any
) -> dict[str, Any]:
    arrivals = arrival_times(len(requests), rate, args.burstiness, args.seed)
    with progress(len(requests), f"{spec.label} @ {rate:g} req/s", args.progress) as bar:
        run_ = run_simulated(engine, requests, arrivals, on_finish=lambda: bar.update(1), id_prefix=f"{rate}-",
                             step_time=step_time)
    # Comparing policies: name each line by its policy (continuous included).
    label = f"{spec.batching}, {spec.alloc_label}" if "," in args.batching else spec.label
    return {"label": label, "kv_allocation": spec.kv_allocation, "batching": spec.batching,
            "request_rate": rate, **summarize(run_)}


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    headers = ["rate (req/s)", "config", "req/s", "output tok/s", "norm. latency (ms/tok)", "TTFT mean (ms)",
               "TTFT p99 (ms)", "TPOT mean (ms)", "E2E mean (s)", "mean batch", "preemptions"]
    rows = [[r["request_rate"], r["label"], r["request_throughput"], r["output_throughput"],
             1000 * r["normalized_latency_s"], r["ttft_ms"]["mean"], r["ttft_ms"]["p99"], r["tpot_ms"]["mean"],
             r["e2e_ms"]["mean"] / 1000, r["mean_batched_requests"], r["num_preemptions"]]
            for r in sorted(data["results"], key=lambda r: (r["request_rate"], r["batching"], r["label"]))]
    capacity = f"; capacity C = {s['capacity_req_s']:.2f} req/s (first config, all queued)" if s["capacity_req_s"] else ""
    model = (s.get("calibration") or {}).get("step_model")
    if model:
        c = model["coefficients_s"]
        capacity += (f"; fitted step time = {1000 * c['fixed']:.2f} ms + {1000 * c['per_sequence']:.3f} ms/seq + "
                     f"{1000 * c['per_new_token']:.4f} ms/token + {1000 * c['per_context_token']:.5f} ms/context "
                     f"token (R^2 {model['r2']:.2f})")
    title = (f"{s['num_requests']} {s['workload']} requests (prompt mean {s['mean_prompt_len']:.0f}, output mean "
             f"{s['mean_output_len']:.0f}), Poisson arrivals (burstiness {s['burstiness']}), model {s['model']}, "
             f"{s['kv_tokens']} KV slots, max_num_seqs {s['max_num_seqs']}, simulated clock ({s['clock']}){capacity}.")
    return f"{title}\n\n{md_table(headers, rows)}"

