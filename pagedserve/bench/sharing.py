"""`pagedserve bench sharing`: KV memory saved by block sharing (the vLLM paper's Figs. 14-15)
under parallel sampling (n samples of one prompt) and beam search, on the paged engine.

After every step, over the running sequences:

    logical  = sum of their block-table lengths (what each would hold without sharing)
    physical = distinct blocks in those tables
    saving   = 1 - sum(physical) / sum(logical), summed over the run's steps

Runs offline on an Alpaca-like trace (short prompts, as in the paper's sampling figure).
Exits 2 with "not available yet" when the engine lacks parallel sampling (SamplingParams(n=2)
raising); beam search rows are skipped when the engine has no `add_beam_search`.
"""

from __future__ import annotations

import argparse
import sys
import time
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
from pagedserve.bench.plots import plot_sharing


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, workload="alpaca", num_requests=100)
    parser.add_argument("--modes", default="n=1,n=2,n=4,n=6,beam=2,beam=4,beam=6",
                        help="comma-separated n=<samples> (parallel sampling) or beam=<width>")
    parser.add_argument("--block-size", type=int, default=16)


def parallel_sampling_available() -> bool:
    from pagedserve.sampling_params import SamplingParams

    try:
        SamplingParams(n=2, temperature=1.0)
    except ValueError:
        return False
    return True


def beam_search_available() -> bool:
    from pagedserve.engine.llm_engine import LLMEngine

    return hasattr(LLMEngine, "add_beam_search")


def run(args: argparse.Namespace) -> int:
    if not parallel_sampling_available():
        print("pagedserve bench sharing: not available yet: needs parallel sampling (SamplingParams(n>1))",
              file=sys.stderr)
        return 2
    if args.quick:
        args.num_requests = min(args.num_requests, 8)
        args.modes = "n=1,n=2" + (",beam=2" if beam_search_available() else "")
    model = resolve_model_path(args.model)
    requests = requests_from_args(args, model)
    spec = EngineSpec(model, block_size=args.block_size, kv_tokens=args.kv_tokens, max_model_len=args.max_model_len)
    results = []
    with torch_threads(args.threads):
        for mode in parse_list(args.modes):
            kind, _, value = mode.partition("=")
            if kind == "beam" and not beam_search_available():
                results.append({"mode": mode, "error": "not available yet: needs beam search"})
                continue
            engine = make_engine(spec)
            warm_up(engine)
            with progress(len(requests), mode, args.progress) as bar:
                results.append({"mode": mode, **_run_mode(engine, requests, kind, int(value), args.seed, bar)})
            engine.assert_no_leaks()
    settings = {"model": args.model, "workload": args.dataset or args.workload, "num_requests": len(requests),
                "kv_tokens": args.kv_tokens, "block_size": args.block_size, "seed": args.seed}
    data = {"settings": settings, "results": results}
    paths = write_outputs(args.out_dir, args.name or "sharing", data, markdown(data))
    paths.append(plot_sharing(data, args.out_dir, args.name or "sharing"))
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _add(engine: Any, kind: str, value: int, requests: list, seed: int) -> list[str]:
    from pagedserve.sampling_params import SamplingParams

    ids = []
    for i, r in enumerate(requests):
        prompt = {"prompt_token_ids": r.prompt_token_ids}
        if kind == "beam":
            from pagedserve.beam_search import BeamSearchParams

            beam = BeamSearchParams(beam_width=value, max_tokens=r.output_len, ignore_eos=True)
            ids.append(engine.add_beam_search(f"s{i}", prompt, beam))
        else:
            params = SamplingParams(n=value, temperature=1.0, seed=seed + i, max_tokens=r.output_len, ignore_eos=True)
            ids.append(engine.add_request(f"s{i}", prompt, params))
    return ids


def _run_mode(engine: Any, requests: list, kind: str, value: int, seed: int, bar: Any) -> dict[str, Any]:
    ids = _add(engine, kind, value, requests, seed)
    results = getattr(getattr(engine, "beam_search", None), "results", {})
    logical = physical = steps = seq_steps = tokens = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests() or (kind == "beam" and any(i not in results for i in ids)):
        outputs = engine.step()
        steps += 1
        tables = [engine.kv_manager.get_block_table(r.request_id) for r in engine.scheduler.running]
        logical += sum(map(len, tables))
        physical += len({b for t in tables for b in t})
        seq_steps += len(tables)
        for output in outputs:
            if output.finished:
                tokens += sum(len(c.token_ids) for c in output.outputs)
                bar.update(1)
    elapsed = time.perf_counter() - start
    if kind == "beam":
        tokens = sum(len(results.pop(i).sequences[0].tokens) - len(r.prompt_token_ids)
                     for i, r in zip(ids, requests, strict=True))
        bar.update(len(ids))
    return {"sequences_per_request": value, "elapsed_s": elapsed, "steps": steps, "output_tokens": tokens,
            "output_throughput": tokens / elapsed, "mean_running_seqs": seq_steps / max(steps, 1),
            "memory_saving": 1 - physical / logical if logical else 0.0,
            "num_preemptions": engine.scheduler.num_preemptions_total}


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    headers = ["mode", "sequences / request", "memory saving %", "mean running seqs", "output tok/s", "preemptions"]
    rows = []
    for r in data["results"]:
        if "error" in r:
            rows.append([r["mode"], "", r["error"], "", "", ""])
            continue
        rows.append([r["mode"], r["sequences_per_request"], f"{100 * r['memory_saving']:.1f}",
                     r["mean_running_seqs"], r["output_throughput"], r["num_preemptions"]])
    title = (f"KV block sharing, {s['num_requests']} {s['workload']} requests, model {s['model']}, "
             f"{s['kv_tokens']} KV slots, block {s['block_size']}. Beam output tokens count the best beam only.")
    return f"{title}\n\n{md_table(headers, rows)}"
