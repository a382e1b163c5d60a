"""`pagedserve bench report`: every benchmark, then one Markdown page tying them together.

    pagedserve bench report                # everything: ~19 min on the shared 2-core box
    pagedserve bench report --models smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct --out DIR [--quick]
                                           # the per-model study instead (bench/study.py)
    pagedserve bench report --quick        # the same pipeline on tiny settings, ~2.5 min
    pagedserve bench report --render-only  # rewrite report.md from the results on disk

Writes into --out-dir (default docs/benchmarks): each part's JSON, Markdown table and PNG,
and report.md with the figures, a "how to read this" per figure, the key numbers and how
long each part took. A part that fails is reported and the rest still run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pagedserve.bench.cli import parse_bench_args, run_bench
from pagedserve.bench.common import parse_list
from pagedserve.bench.study import PARTS as STUDY_PARTS
from pagedserve.bench.study import add_arguments as add_study_arguments
from pagedserve.bench.study import run_study

# part -> (bench subcommand, its arguments). Budgeted for ~20 min on 2 shared cores.
PARTS: dict[str, tuple[str, list[str]]] = {
    "memory": ("memory", []),
    "online_sharegpt": ("serve", ["--workload", "sharegpt", "--num-requests", "200"]),
    "online_alpaca": ("serve", ["--workload", "alpaca", "--num-requests", "400"]),
    "batching": ("serve", ["--workload", "sharegpt", "--num-requests", "200", "--kv-allocation", "paged",
                           "--batching", "continuous,static,dynamic", "--max-num-seqs", "32"]),
    "sharing": ("sharing", []),
    "lora": ("lora", []),
    "sweep": ("sweep", []),
}

HOW_TO_READ = {
    "memory": (
        "memory_breakdown.png",
        "Each bar is one allocation scheme running the same ShareGPT-like trace in the same KV memory; "
        "it splits the KV memory that is in use or unusable, summed over every engine step, into slots "
        "holding a token's K/V (token states), slots held for tokens the request will still write "
        "(reserved), slots that will never be written (internal fragmentation, including rounding a "
        "contiguous region up to whole blocks) and free slots in holes too small for the next "
        "request's region (external fragmentation). Paged memory wastes at most part of one block per "
        "sequence, so its bar is nearly all token states; contiguous schemes reserve for the worst case "
        "(max), for a doubling buffer (pow2) or for the exact output budget (oracle)."),
    "online_sharegpt": (
        "online_sharegpt.png",
        "Left: mean over requests of end-to-end latency divided by output length (the vLLM paper's "
        "normalized latency, log scale) against the Poisson arrival rate; a curve turning up is the "
        "rate where that scheme's queue starts to grow without bound, i.e. its sustainable throughput. "
        "Right: the mean number of requests per engine step (time-weighted), which is what the KV "
        "memory lets each scheme batch. Rates are fractions of the paged engine's capacity with every "
        "request queued at once (on the same fitted clock)."),
    "online_alpaca": (
        "online_alpaca.png",
        "As above for short Alpaca-like requests (prompt ~19, output ~58 tokens). Lines that coincide "
        "exactly are schemes whose KV memory never became the limit at these rates: they made the same "
        "scheduling decisions, and on the fitted clock the same decisions take the same time. On this "
        "CPU the compute saturates (at ~35 requests per step) long before 16384 slots fill with short "
        "requests, so only contiguous-max, which reserves 2048 slots per request and so runs at most 8 "
        "at once, is memory-bound here; on a GPU, whose batches grow to hundreds, the others would be too."),
    "batching": (
        "batching.png",
        "Static batching waits for max_num_seqs requests (or the end of the trace) and runs the batch "
        "until its longest request ends; dynamic batching launches early once the oldest request has "
        "waited batch_window_s; continuous batching refills any free slot at the next step. Panels: "
        "output throughput, mean TTFT (queueing shows here first), mean TPOT and mean end-to-end "
        "latency against the arrival rate, all on the paged engine with the same max_num_seqs (32). "
        "Static batches are the same 32 requests whatever the rate, hence its flat TPOT; its finished "
        "members leave the batch at once (no padding compute), which flatters it against a real static "
        "batcher."),
    "sharing": (
        "sharing.png",
        "Memory saving = 1 - distinct blocks / sum of every running sequence's block-table length, over "
        "the run: what sharing the prompt's blocks (parallel samples) or common prefixes (beams) saves."),
    "lora": (
        "lora.png",
        "K distinct LoRA adapters share one engine: request i uses adapter i % K (K = base: LoRA off). "
        "Left, the capacity with every request queued; right, normalized latency under Poisson load at "
        "a fixed fraction of the base model's capacity. Adapters live in the KV block pool; above "
        "max_loras resident adapters the engine evicts and reloads them (the loads column), which is "
        "where the cost jumps."),
    "sweep": (
        "sweep.png",
        "One knob at a time on the 125M model, each point a short offline run: rows are batch size "
        "(max_num_seqs = number of requests), prompt length (one request), dtype and KV block size; "
        "columns are output throughput, TTFT, TPOT and end-to-end latency. The table adds the KV "
        "footprint: bytes per token, peak blocks and MiB in use, and the share of allocated slots "
        "holding tokens (small blocks waste less, large blocks make fewer, cheaper table entries)."),
}


METHOD = (
    "**Method.** Serving figures run the real engine in-process on a simulated clock: requests "
    "join the engine at their Poisson arrival times on a virtual clock, and each engine step "
    "advances it by that step's time, so queueing and batching behave as online while idle gaps "
    "cost nothing (pagedserve/bench/sim.py). The step time is a model fitted to the engine's own "
    "measured steps in a calibration run (fixed + per-sequence + per-token + per-context-token "
    "cost, bench/clock.py; coefficients and R^2 in each JSON), not each step's wall time: the "
    "machine is a shared 2-core box and minutes of load from other processes would otherwise skew "
    "whole points (`--clock measured` gives the raw version). Memory and serving figures use the "
    "tiny `llama-gqa` model with unscaled ShareGPT-/Alpaca-like lengths (max_model_len 2048, 16384 "
    "KV slots for every scheme): memory shares depend only on lengths and allocation, and the tiny "
    "model keeps a run to seconds. On this CPU a step costs about a millisecond plus a fraction of "
    "one per sequence, so bigger batches pay off less than on a GPU, where a decode step costs "
    "nearly the same for 1 or 100 sequences: the batch sizes each scheme reaches carry over, the "
    "throughput gaps are smaller than the paper's. All schemes preempt by recompute and run "
    "without prefix caching, so allocation is the only difference. Sweeps use the 125M model "
    "(wall time, fastest of 2 runs per point; still noisy, +-30% between neighbouring points on "
    "this shared machine). One torch thread throughout."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=None,
                        help=f"comma-separated subset of {', '.join(PARTS)} (with --models: of {', '.join(STUDY_PARTS)})")
    parser.add_argument("--render-only", action="store_true",
                        help="rewrite report.md from the results already in --out-dir (no benchmark runs)")
    add_study_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.models:
        return run_study(args)
    if args.render_only:
        saved = json.loads((Path(args.out_dir) / "report.json").read_text())
        path = write_report(Path(args.out_dir), saved["timings"], saved["total_s"], saved["quick"])
        print(f"[report] wrote {path}")
        return 0
    common = ["--out-dir", args.out_dir, "--seed", str(args.seed), "--threads", str(args.threads)]
    common += (["--quick"] if args.quick else []) + ([] if args.progress else ["--no-progress"])
    timings: dict[str, Any] = {}
    start = time.perf_counter()
    for part in parse_list(args.parts or ",".join(PARTS)):
        command, extra = PARTS[part]
        t0 = time.perf_counter()
        code: int | str
        try:
            code = run_bench(parse_bench_args([command, *extra, "--name", part, *common]))
        except Exception as exc:  # one broken part must not lose the others' results
            code = f"{type(exc).__name__}: {exc}"
        timings[part] = {"seconds": time.perf_counter() - t0, "exit": code}
        print(f"[report] {part}: {timings[part]['seconds']:.0f} s, exit {code}", flush=True)
    total = time.perf_counter() - start
    path = write_report(Path(args.out_dir), timings, total, args.quick)
    print(f"[report] {total / 60:.1f} min in all; wrote {path}")
    return 0 if all(t["exit"] in (0, 2) for t in timings.values()) else 1


def write_report(out_dir: Path, timings: dict[str, Any], total_s: float, quick: bool) -> Path:
    command = "pagedserve bench report" + (" --quick" if quick else "")
    lines = ["# pagedserve benchmarks", "",
             f"Regenerate: `{command}` ({total_s / 60:.1f} min on this machine, "
             f"{time.strftime('%Y-%m-%d')}). Each section's JSON and Markdown sit next to this file.", "",
             METHOD, ""]
    for part, timing in timings.items():
        figure, how = HOW_TO_READ[part]
        lines += [f"## {part.replace('_', ' ')}", ""]
        if timing["exit"] not in (0,):
            lines += [f"Not produced: exit {timing['exit']}.", ""]
            continue
        if figure:
            lines += [f"![{part}]({figure})", ""]
        lines += [f"**How to read this.** {how}", ""]
        key = key_numbers(out_dir, part)
        if key:
            lines += [f"**Key numbers.** {key}", ""]
        table = out_dir / f"{part}.md"
        if table.exists():
            lines += [table.read_text().strip(), ""]
        lines += [f"_({timing['seconds']:.0f} s)_", ""]
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
    timings_json = {"timings": timings, "total_s": total_s, "quick": quick}
    (out_dir / "report.json").write_text(json.dumps(timings_json, indent=2) + "\n")
    return path


def key_numbers(out_dir: Path, part: str) -> str:
    """A sentence of headline numbers from a part's JSON ('' when there is nothing to say)."""
    path = out_dir / f"{part}.json"
    if not path.exists():
        return ""
    data = json.loads(path.read_text())
    if part == "memory":
        shares = {r["label"]: r["memory"]["shares"]["token_states"] for r in data["results"]}
        return "Token-state share: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in shares.items()) + "."
    if part == "batching":
        return _at_top_rate(data)
    if part.startswith("online"):
        return _sustainable(data)
    if part == "sharing":
        ok = [r for r in data["results"] if "error" not in r]
        return "Memory saved: " + ", ".join(f"{r['mode']} {100 * r['memory_saving']:.1f}%" for r in ok) + "."
    if part == "lora" and data["results"]:
        base = data["results"][0]["capacity_req_s"]
        return "Capacity relative to the base model: " + ", ".join(
            f"{r['num_adapters'] or 'base'} adapters {r['capacity_req_s'] / base:.2f}x" for r in data["results"]) + "."
    return ""


def _sustainable(data: dict[str, Any]) -> str:
    """Per config, the highest rate whose normalized latency stays within 2x its lowest-rate value."""
    by_label: dict[str, list[tuple[float, float]]] = {}
    for r in data["results"]:
        if isinstance(r["request_rate"], (int, float)) and r["request_rate"] != float("inf"):
            by_label.setdefault(r["label"], []).append((r["request_rate"], r["normalized_latency_s"]))
    parts = []
    for label, points in by_label.items():
        points.sort()
        base = points[0][1]
        ok = [rate for rate, lat in points if lat <= 2 * base]
        parts.append(f"{label} {max(ok):.3g} req/s")
    return ("Highest tested rate with normalized latency within 2x of its low-load value: "
            + ", ".join(parts) + ".") if parts else ""


def _at_top_rate(data: dict[str, Any]) -> str:
    """Throughput and mean latencies of each config at the highest finite rate."""
    finite = [r for r in data["results"] if isinstance(r["request_rate"], (int, float))]
    if not finite:
        return ""
    top = max(r["request_rate"] for r in finite)
    parts = [f"{r['label']}: {r['output_throughput']:.0f} tok/s, TTFT {r['ttft_ms']['mean']:.0f} ms, "
             f"E2E {r['e2e_ms']['mean'] / 1000:.2f} s" for r in finite if r["request_rate"] == top]
    return f"At {top:.3g} req/s: " + "; ".join(parts) + "."
