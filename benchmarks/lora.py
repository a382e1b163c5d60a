"""Multi-LoRA serving on the 125M model, S-LoRA style, side by side in one run.

    python benchmarks/lora.py --result-json results/lora.json      # everything (~40 min here)
    python benchmarks/lora.py --parts sweep --adapters 1,64 --quick # smoke run
    python benchmarks/lora.py --parts steps --num-requests 48       # LoRA cost, paired per step

Workload (S-LoRA's): Poisson arrivals at --rate req/s (default saturating the engine, so
throughput is capacity and TTFT includes queueing), input and output lengths uniform in
[8, 512), random prompt tokens, `ignore_eos`. Request i uses adapter floor(u_i * K) with
u_i ~ Power(alpha) (numpy's power distribution, S-LoRA's generator): alpha = 1 is uniform,
alpha = 0.3 puts most requests on a few adapters.

Parts (--parts, comma-separated):
    sweep     throughput, TTFT, TPOT for K adapters (--adapters), per --settings (ranks
              all-8 / mixed {8, 16, 32, 64}, alpha); ratio to the 1-adapter run of the same ranks
    merged    rank 16 on all 7 projections vs the same weights merged into the base, the
              same engine and requests (runs alternate; median of --repeats)
    steps     the same comparison paired per step (far less noise than whole runs): with the
              adapter merged, every step's forward runs twice on the same inputs, once with
              the LoRA path on (merged + LoRA: the same work as LoRA on the base weights) and
              once off (the merged model), in alternating order; the run's throughput with
              and without the LoRA path follows from the summed forward times
    pairs     the sweep's ratio paired per step: the K-adapter workload runs, and every step's
              forward also runs with all its tokens on the 1-adapter run's adapter, and with
              each token on the one adapter of its own adapter's rank (same FLOPs and segments,
              few adapters' weights), the order rotating; the ratios of the runs' throughputs
              follow from the summed forward times (settings and --adapters as for the sweep;
              K = 1 is skipped)
    order     a step's requests side by side by adapter (the scheduler's order) vs the
              segments arrival order would give, paired per step (settings and --adapters as
              for the sweep)
    switch    heterogeneous batching vs merge-and-switch (merge one adapter into the base,
              run its queued requests, unmerge, next) for 2, 5 and 20 adapters, all queued;
              and the same batch on the base model alone (no LoRA work), whose speed-up over
              merge-and-switch is the most any heterogeneous batching could reach here
    coldload  per rank: disk -> host (parse + validate) and host -> device (write into the
              KV pool) latency; and TPOT of running decodes while adapters load vs not
    int8      the sweep (all-8, alpha 1) again on an int8 weight-quantized base

Adapter files: --distinct-files random PEFT-format adapters per rank are written once (under
the pagedserve cache); adapter j of rank r is file j mod --distinct-files of rank r, served
under its own name and id, so K adapters are K distinct adapters to the engine (own cache
entries, own device pages, own loads) without K distinct files on disk. Targets q/k/v/o
(S-LoRA's setting) for the sweep; all 7 projections for `merged`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from pagedserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedserve.bench.lora import merge_adapter, write_random_adapter  # noqa: E402
from pagedserve.lora.peft_loader import TARGETABLE, load_peft_adapter, module_dims_for  # noqa: E402

MIXED_RANKS = (8, 16, 32, 64)
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]


# ---- adapters and workload -----------------------------------------------------------------


def adapter_folder(model: str, rank: int, targets: list[str], index: int) -> Path:
    """Random PEFT-format adapter number `index` of this rank and targets, cached."""
    from pagedserve.demo_models import default_cache_dir

    tag = f"{Path(model).name}-r{rank}-{'-'.join(t[0] + t[-4] for t in targets)}-{index}"
    folder = default_cache_dir() / "adapters" / "bench-lora" / tag
    return write_random_adapter(model, folder, rank, targets, 1000 * rank + index)


def make_adapters(model: str, k: int, ranks: tuple[int, ...], targets: list[str], distinct: int,
                  first_id: int = 1) -> list[LoRARequest]:
    """K adapters, ranks cycling through `ranks`; see the module docstring for the files."""
    out = []
    for j in range(k):
        rank = ranks[j % len(ranks)]
        folder = adapter_folder(model, rank, targets, (j // len(ranks)) % distinct)
        out.append(LoRARequest(f"a{first_id + j}", first_id + j, str(folder)))
    return out


def settings(args: argparse.Namespace) -> list[tuple[tuple[int, ...], float]]:
    """--settings as (ranks, alpha) pairs."""
    out = []
    for item in args.settings.split(","):
        ranks, alpha = item.split(":")
        out.append((MIXED_RANKS if ranks == "mixed" else (int(ranks),), float(alpha)))
    return out


def ranks_label(ranks: tuple[int, ...]) -> str:
    return "mixed" if len(ranks) > 1 else str(ranks[0])


def workload(n: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    inputs = rng.integers(8, 512, n)
    outputs = rng.integers(8, 512, n)
    return [{"prompt": rng.integers(100, vocab - 1, int(i)).tolist(), "output_len": int(o)}
            for i, o in zip(inputs, outputs, strict=True)]


def adapter_choice(n: int, k: int, alpha: float, seed: int) -> list[int]:
    """S-LoRA's power-law choice: index floor(u * K), u ~ Power(alpha)."""
    rng = np.random.default_rng(seed + 1)
    return np.minimum((rng.power(alpha, n) * k).astype(int), k - 1).tolist()


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    if rate <= 0:
        return [0.0] * n
    rng = np.random.default_rng(seed + 2)
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


# ---- running --------------------------------------------------------------------------------


def make_llm(args: argparse.Namespace, max_loras: int, max_cpu_loras: int, quantization: str | None = None) -> LLM:
    llm = LLM(args.model, enable_lora=True, max_loras=max_loras, max_lora_rank=64,
              max_cpu_loras=max_cpu_loras, kv_cache_memory_bytes=args.kv_cache_bytes,
              max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048,
              quantization=quantization, dtype=args.dtype, lora_dtype=args.lora_dtype)
    # Warm-up, also of the LoRA path (its kernel loads on first use), with a throwaway adapter.
    warm = LoRARequest("warm-up", 99999, str(adapter_folder(args.model, 8, QKVO, 0)))
    llm.generate([{"prompt_token_ids": [11, 12, 13]}] * 2, SamplingParams(max_tokens=4), use_tqdm=False,
                 lora_request=[None, warm])
    llm.llm_engine.lora_manager.unregister(warm.lora_int_id)
    return llm


def run_online(llm: LLM, reqs: list[dict], loras: list[LoRARequest | None], times: list[float],
               groups: dict[str, range] | None = None) -> dict:
    """Feeds requests at their arrival times (real clock), steps until all finish.

    `groups` (name -> request indices) adds a summary of each subset under its name."""
    engine = llm.llm_engine
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in reqs]
    order = sorted(range(len(reqs)), key=lambda i: times[i])
    start = time.monotonic()
    done: dict[str, Any] = {}
    nxt = 0
    while nxt < len(order) or engine.has_unfinished_requests():
        now = time.monotonic() - start
        while nxt < len(order) and times[order[nxt]] <= now:
            i = order[nxt]
            engine.add_request(f"r{i}", {"prompt_token_ids": reqs[i]["prompt"]}, params[i],
                               arrival_time=start + times[i], lora_request=loras[i])
            nxt += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        else:
            time.sleep(max(0.0, times[order[nxt]] - now))
    end = time.monotonic()
    engine.assert_no_leaks()
    result = summarize(done, start, end)
    for name, indices in (groups or {}).items():
        result[name] = summarize({f"r{i}": done[f"r{i}"] for i in indices}, start, end)
    return result


def summarize(done: dict[str, Any], start: float, end: float) -> dict:
    ttft, tpot, tokens = [], [], 0
    for out in done.values():
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if out.outputs[0].finish_reason not in ("length", "stop"):
            raise RuntimeError(f"{out.request_id} ended with {out.outputs[0].finish_reason}")
        tokens += n
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    wall = end - start
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "req_s": len(done) / wall, "ttft_ms_mean": _ms(statistics.mean, ttft),
            "ttft_ms_p50": _ms(statistics.median, ttft), "tpot_ms_mean": _ms(statistics.mean, tpot)}


def _ms(stat: Any, seconds: list[float]) -> float:
    return 1000 * stat(seconds) if seconds else float("nan")


def preload(llm: LLM, adapters: list[LoRARequest], host_capacity: int) -> None:
    """Adapters start in the host cache (S-LoRA keeps them in host memory), up to its size."""
    manager = llm.llm_engine.lora_manager
    for a in adapters[:host_capacity]:
        manager.register(a, load_now=True)


def sweep_point(args: argparse.Namespace, reqs: list[dict], k: int, ranks: tuple[int, ...], alpha: float,
                quantization: str | None = None) -> dict:
    adapters = make_adapters(args.model, k, ranks, QKVO, args.distinct_files)
    choice = adapter_choice(len(reqs), k, alpha, args.seed)
    used = sorted(set(choice))
    llm = make_llm(args, args.max_loras, args.max_cpu_loras, quantization)
    preload(llm, [adapters[j] for j in used], args.max_cpu_loras)
    result = run_online(llm, reqs, [adapters[j] for j in choice], arrivals(len(reqs), args.rate, args.seed))
    manager = llm.llm_engine.lora_manager
    result.update(num_adapters=k, ranks=ranks_label(ranks), alpha=alpha,
                  distinct_used=len(used), disk_loads=manager.num_disk_loads,
                  device_loads=manager.num_device_loads, quantization=quantization or "none",
                  lora_dtype=args.lora_dtype)
    del llm
    return result


def part_sweep(args: argparse.Namespace, reqs: list[dict], quantization: str | None = None) -> list[dict]:
    rows = []
    for ranks, alpha in [((8,), 1.0)] if quantization else settings(args):
        base = None
        for k in map(int, args.adapters.split(",")):
            if alpha != 1.0 and k == 1:
                continue  # alpha changes nothing with one adapter: reuse the alpha-1 run
            r = sweep_point(args, reqs, k, ranks, alpha, quantization)
            base = base or next((x for x in rows if x["num_adapters"] == 1 and x["ranks"] == r["ranks"]
                                 and x["quantization"] == r["quantization"]), r)
            r["vs_1_adapter"] = r["output_tok_s"] / base["output_tok_s"]
            rows.append(r)
            print(f"  K={k:5d} ranks={r['ranks']:5s} alpha={alpha:3.1f} {r['output_tok_s']:7.1f} tok/s "
                  f"({r['vs_1_adapter']:.3f}x)  TTFT {r['ttft_ms_mean']:8.0f} ms  TPOT {r['tpot_ms_mean']:6.1f} ms  "
                  f"used {r['distinct_used']} loads {r['disk_loads']}/{r['device_loads']}", flush=True)
    return rows


# ---- merged weights and merge-and-switch ------------------------------------------------------


def part_merged(args: argparse.Namespace, reqs: list[dict]) -> dict:
    """Rank 16 on all 7 projections, batched LoRA vs the same adapter merged."""
    adapter = make_adapters(args.model, 1, (16,), list(TARGETABLE), 1, first_id=9001)[0]
    llm = make_llm(args, 4, 16)
    preload(llm, [adapter], 1)
    lora_runs, merged_runs = [], []
    for _ in range(args.repeats):
        lora_runs.append(run_online(llm, reqs, [adapter] * len(reqs), [0.0] * len(reqs)))
        merge_adapter(llm.llm_engine, adapter)
        merged_runs.append(run_online(llm, reqs, [None] * len(reqs), [0.0] * len(reqs)))
        merge_adapter(llm.llm_engine, adapter, -1.0)
    lora = statistics.median(r["output_tok_s"] for r in lora_runs)
    merged = statistics.median(r["output_tok_s"] for r in merged_runs)
    out = {"lora_tok_s": lora, "merged_tok_s": merged, "slowdown": 1 - lora / merged,
           "lora_runs": [r["output_tok_s"] for r in lora_runs], "merged_runs": [r["output_tok_s"] for r in merged_runs]}
    print(f"  rank 16 x 7 projections: LoRA {lora:.1f} tok/s, merged {merged:.1f} tok/s, "
          f"LoRA {100 * out['slowdown']:.1f}% slower", flush=True)
    return out


def paired_run(llm: LLM, alternatives: dict[str, Any], run: Any) -> tuple[dict, dict]:
    """Runs `run()` with every step's forward done once with the step's own LoRA segments
    ("own") and once per alternative, on the same inputs, the order rotating from step to
    step; `alternatives[name](sched)` gives that side's segments (None = the LoRA path off).
    Returns (run's result, times): per side, the summed forward seconds (times[side]) and
    the seconds building its segment tables (times[side + "_tables"]); times["ratios"][name]
    lists the per-step own / alternative forward ratios.

    The run as it would be with one side only is its wall time less every other side's
    forward and tables (`one_sided_wall`); the values computed do not matter (ignore_eos,
    fixed lengths)."""
    runner = llm.llm_engine.runner
    sides = ["own", *alternatives]
    builders = {"own": runner.lora_segments, **alternatives}
    times: dict[str, Any] = {side + suffix: 0.0 for side in sides for suffix in ("", "_tables")}
    times["ratios"] = {name: [] for name in alternatives}
    state = {"step": 0}

    def paired_forward(sched: Any, forward: Any) -> Any:
        segments = {}
        for side in sides:
            t0 = time.perf_counter()
            segments[side] = builders[side](sched)
            times[side + "_tables"] += time.perf_counter() - t0
        shift = state["step"] % len(sides)
        step, out = {}, None
        for side in sides[shift:] + sides[:shift]:
            t0 = time.perf_counter()
            result = forward(segments[side])
            step[side] = time.perf_counter() - t0
            if side == "own":
                out = result
        state["step"] += 1
        for side, seconds in step.items():
            times[side] += seconds
        for name in alternatives:
            times["ratios"][name].append(step["own"] / step[name])
        return out

    runner.set_forward_hook(paired_forward)  # the runner's hook: nothing on it is replaced
    try:
        result = run()
    finally:
        runner.set_forward_hook(None)
    return result, times


def one_sided_wall(result: dict, times: dict, side: str) -> float:
    """The run's wall time as it would be with only `side`'s forwards and tables."""
    others = [s for s in times["ratios"] if s != side] + (["own"] if side != "own" else [])
    return result["wall_s"] - sum(times[s] + times[s + "_tables"] for s in others)


def part_steps(args: argparse.Namespace, reqs: list[dict]) -> dict:
    """Rank 16 on all 7 projections vs merged, paired per step (see the module docstring)."""
    adapter = make_adapters(args.model, 1, (16,), list(TARGETABLE), 1, first_id=9001)[0]
    llm = make_llm(args, 4, 16)
    preload(llm, [adapter], 1)
    merge_adapter(llm.llm_engine, adapter)
    result, times = paired_run(llm, {"merged": lambda sched: None},  # the merged model: LoRA path off
                               lambda: run_online(llm, reqs, [adapter] * len(reqs), [0.0] * len(reqs)))
    lora_wall, merged_wall = one_sided_wall(result, times, "own"), one_sided_wall(result, times, "merged")
    ratios = times["ratios"]["merged"]
    out = {"steps": len(ratios), "lora_forward_s": times["own"], "merged_forward_s": times["merged"],
           "segments_s": times["own_tables"], "step_ratio_median": statistics.median(ratios),
           "slowdown": 1 - merged_wall / lora_wall}
    print(f"  paired per step ({out['steps']} steps): LoRA forwards {times['own']:.2f} s + segment "
          f"tables {times['own_tables']:.2f} s vs merged {times['merged']:.2f} s; median step "
          f"ratio {out['step_ratio_median']:.3f}; LoRA {100 * out['slowdown']:.1f}% slower "
          f"end to end", flush=True)
    return out


def paired_points(args: argparse.Namespace, reqs: list[dict], point: Any, describe: Any) -> list[dict]:
    """`point(args, reqs, k, ranks, alpha)` for every --settings pair and every K > 1 of
    --adapters (one adapter has nothing to pair against); prints `describe(row)` after each."""
    rows = []
    for ranks, alpha in settings(args):
        for k in (k for k in map(int, args.adapters.split(",")) if k > 1):
            rows.append(point(args, reqs, k, ranks, alpha))
            print(f"  K={k:5d} ranks={rows[-1]['ranks']:5s} alpha={alpha:3.1f}: {describe(rows[-1])}", flush=True)
    return rows


def part_pairs(args: argparse.Namespace, reqs: list[dict]) -> list[dict]:
    """K adapters vs 1 adapter, paired per step (see the module docstring)."""
    return paired_points(args, reqs, pair_point, lambda row: (
        f"forwards {row['multi']:.2f} s (K adapters) vs {row['single']:.2f} s (1 adapter), tables "
        f"{row['multi_tables']:.2f} / {row['single_tables']:.2f} s -> {row['vs_1_adapter']:.3f}x of the "
        f"1-adapter throughput ({row['device_loads']} device loads); one adapter per rank "
        f"{row['per_rank']:.2f} s -> K adapters {row['vs_per_rank']:.3f}x of it, it "
        f"{row['per_rank_vs_1_adapter']:.3f}x of 1 adapter"))


def pair_point(args: argparse.Namespace, reqs: list[dict], k: int, ranks: tuple[int, ...], alpha: float) -> dict:
    """The K-adapter run with two alternatives per step: every token on the 1-adapter run's
    adapter ("single", rank ranks[0], one segment), and every token on the one adapter of its
    own adapter's rank ("per_rank": the same segments and FLOPs, reading len(ranks) adapters'
    weights instead of up to one per token). K vs single is the figure; K vs per_rank is the
    cost of many adapters' weights alone, and per_rank vs single that of the ranks and
    segments."""
    adapters = make_adapters(args.model, k, ranks, QKVO, args.distinct_files)
    choice = adapter_choice(len(reqs), k, alpha, args.seed)
    single = adapters[0]  # what the sweep's 1-adapter run serves (rank ranks[0])
    per_rank = adapters[:len(ranks)]  # adapter j has rank ranks[j % len(ranks)]
    llm = make_llm(args, args.max_loras, args.max_cpu_loras)
    preload(llm, per_rank + [adapters[j] for j in sorted(set(choice)) if j >= len(ranks)], args.max_cpu_loras)
    manager = llm.llm_engine.lora_manager
    # Onto the device; they stay there (--max-loras exceeds the adapters a run uses, so
    # nothing is evicted: `manager.resident` would raise otherwise).
    for adapter in per_rank:
        llm.generate([{"prompt_token_ids": [11, 12]}], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=adapter)
    rank_of = {a.lora_int_id: ranks[j % len(ranks)] for j, a in enumerate(adapters)}
    stand_in = {rank: a.lora_int_id for rank, a in zip(ranks[:len(per_rank)], per_rank, strict=True)}

    def segments_for(lora_id_of: Any) -> Any:
        return lambda sched: step_segments(llm, [(item.num_new_tokens, lora_id_of(item.request.lora_id))
                                                 for item in sched.scheduled])

    alternatives = {"single": segments_for(lambda lora_id: single.lora_int_id),
                    "per_rank": segments_for(lambda lora_id: stand_in[rank_of[lora_id]])}
    result, times = paired_run(llm, alternatives, lambda: run_online(
        llm, reqs, [adapters[j] for j in choice], arrivals(len(reqs), args.rate, args.seed)))
    walls = {side: one_sided_wall(result, times, side) for side in ("own", "single", "per_rank")}
    return {"num_adapters": k, "ranks": ranks_label(ranks), "alpha": alpha,
            "lora_dtype": args.lora_dtype, "distinct_used": len(set(choice)),
            "device_loads": manager.num_device_loads, "multi": times["own"], "single": times["single"],
            "per_rank": times["per_rank"], "multi_tables": times["own_tables"],
            "single_tables": times["single_tables"], "per_rank_tables": times["per_rank_tables"],
            "wall_s": result["wall_s"], "vs_1_adapter": walls["single"] / walls["own"],
            "vs_per_rank": walls["per_rank"] / walls["own"], "per_rank_vs_1_adapter": walls["single"] / walls["per_rank"]}


def step_segments(llm: LLM, runs: list[tuple[int, int]], merge_neighbours: bool = True) -> Any:
    """A step's segment tables for runs of (tokens, adapter id; 0 = base model), the
    adapters resident on the device."""
    from pagedserve.lora.segments import build_segments

    runner, manager = llm.llm_engine.runner, llm.llm_engine.lora_manager
    return build_segments([(n, manager.resident(lora_id) if lora_id else None) for n, lora_id in runs],
                          len(runner.attn_layers), len(TARGETABLE), merge_neighbours)


def arrival_order_runs(sched: Any) -> list[tuple[int, int]]:
    """The runs of (tokens, adapter id) that arrival order would have given a step whose
    requests the scheduler grouped by adapter (arrival order within each): a new run wherever
    the adapter changes from one request to the next in arrival order. Requests that follow
    each other in arrival order with one adapter are neighbours in the grouped layout too."""
    items = sched.scheduled
    by_arrival = sorted(range(len(items)), key=lambda i: (items[i].request.arrival_time, i))
    continues = {i for p, i in zip(by_arrival, by_arrival[1:], strict=False)
                 if i == p + 1 and items[i].request.lora_id == items[p].request.lora_id}
    runs: list[list[int]] = []
    for i, item in enumerate(items):
        if i not in continues:  # always so for i = 0
            runs.append([0, item.request.lora_id])
        runs[-1][0] += item.num_new_tokens
    return [(n, lora_id) for n, lora_id in runs]


def part_order(args: argparse.Namespace, reqs: list[dict]) -> list[dict]:
    """A step's requests side by side by adapter (the scheduler's order) vs in arrival order,
    paired per step: the K-adapter workload runs, and every step's forward also runs with
    the segments arrival order would give (`arrival_order_runs`). Same tokens, same FLOPs;
    only the segments differ, as they did before the scheduler grouped requests by adapter."""
    return paired_points(args, reqs, order_point, lambda row: (
        f"forwards {row['grouped_forward_s']:.2f} s grouped vs {row['arrival_forward_s']:.2f} s in arrival "
        f"order -> grouped {row['speedup']:.3f}x the throughput"))


def order_point(args: argparse.Namespace, reqs: list[dict], k: int, ranks: tuple[int, ...], alpha: float) -> dict:
    adapters = make_adapters(args.model, k, ranks, QKVO, args.distinct_files)
    choice = adapter_choice(len(reqs), k, alpha, args.seed)
    llm = make_llm(args, args.max_loras, args.max_cpu_loras)
    preload(llm, [adapters[j] for j in sorted(set(choice))], args.max_cpu_loras)
    alternatives = {"arrival": lambda sched: step_segments(llm, arrival_order_runs(sched), merge_neighbours=False)}
    result, times = paired_run(llm, alternatives, lambda: run_online(
        llm, reqs, [adapters[j] for j in choice], arrivals(len(reqs), args.rate, args.seed)))
    grouped, arrival = one_sided_wall(result, times, "own"), one_sided_wall(result, times, "arrival")
    return {"num_adapters": k, "ranks": ranks_label(ranks), "alpha": alpha, "grouped_forward_s": times["own"],
            "arrival_forward_s": times["arrival"], "speedup": arrival / grouped}


def part_switch(args: argparse.Namespace, reqs: list[dict]) -> list[dict]:
    """All requests queued; request i uses adapter i mod K. Batched vs merge-and-switch."""
    rows = []
    for k in (2, 5, 20):
        adapters = make_adapters(args.model, k, (8,), QKVO, args.distinct_files, first_id=8000 + 100 * k)
        loras = [adapters[i % k] for i in range(len(reqs))]
        llm = make_llm(args, max(k, 4), max(k, 16))
        preload(llm, adapters, len(adapters))
        batched = run_online(llm, reqs, loras, [0.0] * len(reqs))
        # The same batch with no LoRA work at all: what heterogeneous batching would reach at
        # zero LoRA cost, so batched-base / merge-and-switch bounds the speed-up on this host.
        base = run_online(llm, reqs, [None] * len(reqs), [0.0] * len(reqs))
        start = time.monotonic()
        tokens = 0
        for j, adapter in enumerate(adapters):
            mine = [r for i, r in enumerate(reqs) if i % k == j]
            if not mine:
                continue
            merge_adapter(llm.llm_engine, adapter)
            tokens += run_online(llm, mine, [None] * len(mine), [0.0] * len(mine))["output_tokens"]
            merge_adapter(llm.llm_engine, adapter, -1.0)
        switch_s = time.monotonic() - start
        row = {"num_adapters": k, "batched_tok_s": batched["output_tok_s"], "switch_tok_s": tokens / switch_s,
               "speedup": batched["output_tok_s"] / (tokens / switch_s),
               "base_batched_tok_s": base["output_tok_s"], "ceiling": base["output_tok_s"] / (tokens / switch_s)}
        rows.append(row)
        print(f"  {k:2d} adapters: batched {row['batched_tok_s']:.1f} tok/s, merge-and-switch "
              f"{row['switch_tok_s']:.1f} tok/s, {row['speedup']:.2f}x; the batch with no LoRA work "
              f"{row['base_batched_tok_s']:.1f} tok/s, {row['ceiling']:.2f}x (the ceiling here)", flush=True)
        del llm
    return rows


# ---- cold loads -------------------------------------------------------------------------------


def part_coldload(args: argparse.Namespace, reqs: list[dict]) -> dict:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(args.model)
    dims = module_dims_for(hf)
    llm = make_llm(args, 32, 64)
    manager = llm.llm_engine.lora_manager
    per_rank = []
    for rank in MIXED_RANKS:
        disk, device = [], []
        for j in range(4):
            request = LoRARequest(f"cold-{rank}-{j}", 7000 + 10 * rank + j,
                                  str(adapter_folder(args.model, rank, QKVO, j)))
            t = time.perf_counter()
            adapter = load_peft_adapter(request, dims, hf.num_hidden_layers, 64)
            disk.append(time.perf_counter() - t)
            manager.register(request, adapter=adapter)
            t = time.perf_counter()
            manager.prepare(request.lora_int_id)
            device.append(time.perf_counter() - t)
            manager.unregister(request.lora_int_id)
        per_rank.append({"rank": rank, "disk_to_host_ms": 1000 * statistics.median(disk),
                         "host_to_device_ms": 1000 * statistics.median(device)})
        print(f"  rank {rank:2d}: disk->host {per_rank[-1]['disk_to_host_ms']:.1f} ms, host->device "
              f"{per_rank[-1]['host_to_device_ms']:.2f} ms", flush=True)
    # Hidden behind decodes: 16 base-model requests decode while 16 short requests arrive,
    # one every 0.2 s, each for its own adapter. Warm: those adapters were loaded into the
    # host cache and device pool beforehand; cold: they are on disk only (loaded by the
    # background thread). Same requests, same times; the difference is the load cost.
    # Short prompts, so that prefill does not hide what is measured (a 2048-token prefill
    # step takes ~2 s on this CPU).
    decoders = [{"prompt": r["prompt"][:16], "output_len": 256} for r in reqs[:16]]
    late = [{"prompt": r["prompt"][:32], "output_len": 16} for r in reqs[16:32]]
    times = [0.0] * 16 + [1.0 + 0.2 * i for i in range(len(late))]
    groups = {"decoders": range(16), "late": range(16, 16 + len(late))}
    out: dict[str, Any] = {"per_rank": per_rank}
    for label, first_id in (("warm", 7500), ("cold", 7600)):
        adapters = make_adapters(args.model, len(late), MIXED_RANKS, QKVO, 4, first_id=first_id)
        if label == "warm":
            for a in adapters:
                manager.register(a, load_now=True)
                manager.prepare(a.lora_int_id)
        loads_before = manager.num_disk_loads
        run = run_online(llm, decoders + late, [None] * 16 + adapters, times, groups)
        out[label] = {"decoder_tpot_ms": run["decoders"]["tpot_ms_mean"],
                      "late_ttft_ms_mean": run["late"]["ttft_ms_mean"],
                      "disk_loads_during_run": manager.num_disk_loads - loads_before}
        print(f"  {label}: decoders' TPOT {out[label]['decoder_tpot_ms']:.1f} ms, adapter requests' TTFT "
              f"{out[label]['late_ttft_ms_mean']:.0f} ms, disk loads during the run "
              f"{out[label]['disk_loads_during_run']}", flush=True)
    return out


# ---- main -----------------------------------------------------------------------------------


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label, name in (("output_tok_s", "output tokens/s", "lora_throughput.png"),
                             ("ttft_ms_mean", "mean TTFT (ms)", "lora_ttft.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            dtype = r.get("lora_dtype", "auto")
            series_name = f"ranks {r['ranks']}, alpha {r['alpha']:g}, {r['quantization']}"
            series.setdefault(series_name + ("" if dtype == "auto" else f", {dtype} adapters"), []).append(
                (r["num_adapters"], r[key]))
        for label_s, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label_s)
        ax.set_xscale("log")
        ax.set_ylim(bottom=0)
        ax.set_xlabel("number of adapters")
        ax.set_ylabel(label)
        ax.set_title(f"125M Llama, multi-LoRA: {label}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder (default: the bench-125m random Llama)")
    p.add_argument("--parts", default="sweep,merged,steps,switch,coldload,int8")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson req/s (0: all at once)")
    p.add_argument("--adapters", default="1,8,64,512,1000,2000")
    p.add_argument("--settings", default="8:1,mixed:1,mixed:0.3",
                   help="RANKS:ALPHA pairs; RANKS is one rank or 'mixed' (8/16/32/64)")
    p.add_argument("--max-loras", type=int, default=96, help="adapters resident in the KV pool at most")
    p.add_argument("--max-cpu-loras", type=int, default=256)
    p.add_argument("--distinct-files", type=int, default=8)
    p.add_argument("--kv-cache-bytes", type=int, default=3 << 30)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the model's dtype (auto: float32 on CPU)")
    p.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="adapters' dtype in the KV pool (the engine's lora_dtype)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="small workload (smoke test)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--plot-dir", default=str(ROOT / "docs" / "benchmarks"))
    p.add_argument("--plot-from", default=None,
                   help="only redraw the plots from --result-json files (comma-separated: their rows together)")
    args = p.parse_args()
    if args.plot_from:
        rows = []
        for path in args.plot_from.split(","):
            saved = json.loads(Path(path).read_text())
            rows += saved.get("sweep", []) + saved.get("sweep_int8", [])
        print(plot(rows, Path(args.plot_dir)))
        return
    from pagedserve.demo_models import get_model_path

    args.model = args.model or str(get_model_path("bench-125m"))
    if args.quick:
        args.num_requests, args.repeats = 12, 1
    from transformers import AutoConfig

    reqs = workload(args.num_requests, AutoConfig.from_pretrained(args.model).vocab_size, args.seed)
    if args.quick:
        reqs = [dict(r, output_len=min(r["output_len"], 32)) for r in reqs]
    parts = args.parts.split(",")
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "model": args.model,
                              "settings": {k: v for k, v in vars(args).items() if k != "quick"}}
    print(f"{len(reqs)} requests, rate {args.rate} req/s, model {args.model}", flush=True)
    runs = [  # (--parts name, heading, report key, the part)
        ("sweep", "sweep", "sweep", lambda: part_sweep(args, reqs)),
        ("int8", "sweep, int8 base", "sweep_int8", lambda: part_sweep(args, reqs, "int8")),
        ("merged", "merged", "merged", lambda: part_merged(args, reqs)),
        ("steps", "merged, paired per step", "steps", lambda: part_steps(args, reqs)),
        ("pairs", "K adapters vs 1, paired per step", "pairs", lambda: part_pairs(args, reqs)),
        ("order", "grouped by adapter vs arrival order, paired per step", "order", lambda: part_order(args, reqs)),
        ("switch", "merge-and-switch", "switch", lambda: part_switch(args, reqs)),
        ("coldload", "cold loads", "coldload", lambda: part_coldload(args, reqs)),
    ]
    for part, heading, key, run in runs:
        if part in parts:
            print(f"{heading}:", flush=True)
            report[key] = run()
    rows = report.get("sweep", []) + report.get("sweep_int8", [])
    if rows and not args.quick:
        report["plots"] = [str(p) for p in plot(rows, Path(args.plot_dir))]
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("sweep", "sweep_int8")}, indent=1))


if __name__ == "__main__":
    main()
