"""`pagedserve bench lora`: many LoRA adapters served at once (S-LoRA style): throughput and
latency as the same requests spread over more distinct adapters.

K adapters (rank --rank on --targets, random weights in PEFT's format, cached on disk);
request i uses adapter i % K, and K = 0 is the base model with LoRA off. At most
--max-loras adapters are resident in the KV memory pool at once, so K above it makes the
engine evict and reload adapters. Per K: a calibration run with every request queued at
once (throughput, and the step-time model of bench/clock.py), then a Poisson run at
--rate-fraction x the base model's capacity on that fitted clock (latency).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from pagedserve.bench.clock import fit_step_model, modelled_makespan
from pagedserve.bench.common import (
    EngineSpec,
    add_workload_args,
    llm_accepts,
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
from pagedserve.bench.plots import plot_lora
from pagedserve.bench.sim import SimRun, run_simulated, summarize
from pagedserve.bench.workloads import WorkloadRequest, arrival_times


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_args(parser, workload="alpaca")
    parser.add_argument("--num-adapters", default="0,1,2,4,8,16", help="comma-separated K (0 = base model)")
    parser.add_argument("--max-loras", type=int, default=8, help="adapters resident in KV memory at once")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q_proj,k_proj,v_proj,o_proj", help="adapted modules")
    parser.add_argument("--rate-fraction", type=float, default=0.7, help="of the base model's capacity")


def run(args: argparse.Namespace) -> int:
    if not llm_accepts("enable_lora"):
        print("pagedserve bench lora: not available yet: needs LoRA serving (LLM(enable_lora=...))", file=sys.stderr)
        return 2
    if args.quick:
        args.num_requests, args.num_adapters, args.max_loras = min(args.num_requests, 24), "0,2,4", 2
    model = resolve_model_path(args.model)
    requests = requests_from_args(args, model)
    results: list[dict[str, Any]] = []
    base_capacity = None
    with torch_threads(args.threads), progress(len(parse_list(args.num_adapters)), "adapters", args.progress,
                                               True) as bar:
        for k in parse_list(args.num_adapters, int):
            result = _run_k(model, requests, k, args, base_capacity)
            base_capacity = base_capacity or result["capacity_req_s"]
            results.append(result)
            bar.update(1)
    settings = {"model": args.model, "workload": args.workload, "num_requests": len(requests),
                "max_loras": args.max_loras, "rank": args.rank, "targets": args.targets,
                "rate_fraction": args.rate_fraction, "kv_tokens": args.kv_tokens, "seed": args.seed}
    data = {"settings": settings, "results": results}
    paths = write_outputs(args.out_dir, args.name or "lora", data, markdown(data))
    paths.append(plot_lora(data, args.out_dir, args.name or "lora"))
    print(markdown(data))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _run_k(model: str, requests: list, k: int, args: argparse.Namespace, base_capacity: float | None) -> dict:
    spec = EngineSpec(model, kv_tokens=args.kv_tokens, max_model_len=args.max_model_len,
                      max_loras=args.max_loras if k else 0, max_lora_rank=max(args.rank, 8))
    adapters = build_adapters(model, k, args.rank, parse_list(args.targets), args.seed)
    loras = [adapters[i % k] for i in range(len(requests))] if k else None
    engine = make_engine(spec)
    warm_up(engine)
    calibration = run_simulated(engine, requests, [0.0] * len(requests), lora_requests=loras, id_prefix="c")
    step_model = fit_step_model(calibration.steps)
    capacity = len(requests) / modelled_makespan(calibration, step_model)
    rate = args.rate_fraction * (base_capacity or capacity)
    arrivals = arrival_times(len(requests), rate, seed=args.seed)
    online = run_simulated(engine, requests, arrivals, lora_requests=loras, id_prefix="o", step_time=step_model)
    manager = getattr(engine, "lora_manager", None)
    engine.assert_no_leaks()
    return {"num_adapters": k, "capacity_req_s": capacity, "request_rate": rate,
            "offline": summarize(calibration), "online": summarize(online), "step_model": step_model.as_dict(),
            "disk_loads": getattr(manager, "num_disk_loads", 0), "device_loads": getattr(manager, "num_device_loads", 0)}


def build_adapters(model_path: str, k: int, rank: int | list[int], targets: list[str], seed: int,
                   config: Any = None, first_id: int = 1) -> list[Any]:
    """K random LoRA adapters of the model, cached under the demo-model cache.

    `rank` may be a list: adapter i gets rank[i % len(rank)] (a mixed-rank population).
    `config`: the model's Hugging Face config (default: read from `model_path`'s config.json;
    a .gguf file has none, so callers with an engine pass `engine.runner.hf_config`).
    Adapter i is `LoRARequest` id first_id + i: an engine serving several populations needs
    them apart (an id names one adapter folder for the engine's life).
    """
    from pagedserve.demo_models import default_cache_dir
    from pagedserve.lora.request import LoRARequest

    ranks = rank if isinstance(rank, list) else [rank]
    root = default_cache_dir() / "adapters"
    adapters = []
    for i in range(k):
        r = ranks[i % len(ranks)]
        key = json.dumps([str(Path(model_path).resolve()), r, targets, seed + i, 2])
        folder = root / f"bench-r{r}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
        path = write_random_adapter(model_path, folder, r, targets, seed + i, config)
        adapters.append(LoRARequest(f"bench-{first_id + i}", first_id + i, str(path)))
    return adapters


def write_random_adapter(model_path: str, folder: Path, rank: int, targets: list[str], seed: int,
                         config: Any = None) -> Path:
    """A random LoRA adapter in PEFT's file layout for a Llama-style model; returns `folder`.

    A ~ N(0, 1/in), B ~ N(0, 0.01^2) (non-zero, so the adapter changes the outputs),
    lora_alpha = 2r. Written directly, without building the model (milliseconds per adapter,
    so thousands are cheap); reused if the folder exists; written atomically (rename).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from pagedserve.lora.peft_loader import PARENT_MODULE, module_dims_for

    if (folder / "adapter_config.json").is_file():
        return folder
    config = config if config is not None else AutoConfig.from_pretrained(model_path)
    dims = module_dims_for(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for name in targets:
            key = f"base_model.model.model.layers.{layer}.{PARENT_MODULE[name]}.{name}"
            d_in, d_out = dims[name]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=folder.parent))
    try:
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": targets, "bias": "none", "use_rslora": False, "fan_in_fan_out": False,
            "base_model_name_or_path": str(model_path),
        }))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process wrote it meanwhile: keep theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def markdown(data: dict[str, Any]) -> str:
    s = data["settings"]
    headers = ["adapters", "capacity (req/s)", "vs base", "rate (req/s)", "norm. latency (ms/tok)",
               "TTFT mean (ms)", "TPOT mean (ms)", "E2E mean (s)", "adapter loads (disk / device)"]
    base = data["results"][0]["capacity_req_s"] if data["results"] else 1.0
    rows = [[r["num_adapters"] or "base (LoRA off)", r["capacity_req_s"], f"{r['capacity_req_s'] / base:.2f}x",
             r["request_rate"], 1000 * r["online"]["normalized_latency_s"], r["online"]["ttft_ms"]["mean"],
             r["online"]["tpot_ms"]["mean"], r["online"]["e2e_ms"]["mean"] / 1000,
             f"{r['disk_loads']} / {r['device_loads']}"] for r in data["results"]]
    title = (f"Multi-LoRA serving, {s['num_requests']} {s['workload']} requests, model {s['model']}, rank "
             f"{s['rank']} on {s['targets']}, {s['max_loras']} adapters resident at most; request i uses "
             f"adapter i % K. Capacity: all queued, fitted clock; latency: Poisson at "
             f"{s['rate_fraction']} x the base capacity.")
    return f"{title}\n\n{md_table(headers, rows)}"


# ---- the study's switching-overhead and baseline cells (issue #39.4) ------------------------


def merge_adapter(engine: Any, adapter_request: Any, sign: float = 1.0) -> None:
    """W += sign * scale * B A for every adapted projection, in `engine`'s own weights.

    `engine` is an `LLMEngine` with LoRA enabled: the projections are found through its LoRA
    wrappers (each knows its layer and the column slice of every projection it fuses), so
    the mapping is the engine's own. Raises NotImplementedError on quantized weights (int8,
    int4, GGUF blocks cannot hold W + delta exactly), before any weight changes.
    """
    import torch

    from pagedserve.lora.layers import LoRALinear
    from pagedserve.lora.peft_loader import TARGETABLE, load_peft_adapter
    from pagedserve.quantization.base import LinearMethod

    manager = engine.lora_manager
    adapter = load_peft_adapter(adapter_request, manager.module_dims, manager.num_layers,
                                manager.config.max_lora_rank)
    wrappers: list[Any] = [m for m in engine.runner.model.modules() if isinstance(m, LoRALinear)]
    for wrapper in wrappers:  # refuse before touching anything: no half-merged model
        method = wrapper.base.quant_method
        if type(method).add_to_weight is LinearMethod.add_to_weight:
            raise NotImplementedError(f"{method.name} weights cannot be changed in place (merging needs "
                                      "float weights)")
    for wrapper in wrappers:
        base = wrapper.base
        delta = None
        for module, start, end in wrapper.slices:
            w = adapter.weights.get((wrapper.layer_idx, TARGETABLE[module]))
            if w is not None:
                delta = delta if delta is not None else torch.zeros(base.output_size, base.input_size)
                delta[start:end] += sign * w.scale * (w.lora_b @ w.lora_a)
        if delta is not None:
            base.quant_method.add_to_weight(base, delta)


def one_adapter_at_a_time(engine: Any, requests: list[Any], loras: list[Any], id_prefix: str = "one-") -> Any:
    """Serves `requests` (all queued at time 0) one adapter's group after another, so no
    step ever holds two adapters' requests: the batching a server without heterogeneous
    LoRA batches can do. Returns one `SimRun` of the whole: group g starts when group g-1
    ends, so a request's TTFT includes the groups served before its own."""
    groups: dict[int, list[int]] = {}
    for i, lora in enumerate(loras):
        groups.setdefault(lora.lora_int_id, []).append(i)
    total = SimRun([])
    for g, indices in enumerate(groups.values()):
        run = run_simulated(engine, [requests[i] for i in indices], [0.0] * len(indices),
                            id_prefix=f"{id_prefix}{g}-", lora_requests=[loras[i] for i in indices])
        for record in run.records:
            record.first_token_s = None if record.first_token_s is None else record.first_token_s + total.makespan_s
            record.finish_s = None if record.finish_s is None else record.finish_s + total.makespan_s
        total.records += run.records
        total.makespan_s += run.makespan_s
        total.busy_s += run.busy_s
        total.wall_s += run.wall_s
        total.num_steps += run.num_steps
        total.seq_seconds += run.seq_seconds
        total.num_preemptions += run.num_preemptions
        total.peak_blocks_used = max(total.peak_blocks_used, run.peak_blocks_used)
    total.extra["groups"] = len(groups)
    return total


def time_adapter_loads(engine: Any, adapters: list[Any]) -> dict[str, Any]:
    """Per adapter: disk -> host (read and validate the PEFT folder: `load_peft_adapter`) and
    host -> KV pool (the manager's `prepare`: allocate a run of KV blocks and write the
    weights into it), with no adapter resident before (nothing to evict in the timing).
    Each adapter is unregistered after (its blocks go back). Medians in ms."""
    import statistics
    import time

    from pagedserve.core.protocols import Residency
    from pagedserve.lora.peft_loader import load_peft_adapter

    manager = engine.lora_manager
    manager.free_all()
    disk, pool, mib, blocks = [], [], 0.0, 0
    for request in adapters:
        start = time.perf_counter()
        adapter = load_peft_adapter(request, manager.module_dims, manager.num_layers, manager.config.max_lora_rank)
        disk.append(time.perf_counter() - start)
        manager.register(request, adapter=adapter)
        start = time.perf_counter()
        state = manager.prepare(request.lora_int_id)
        pool.append(time.perf_counter() - start)
        if state is not Residency.READY:
            raise RuntimeError(f"adapter {request.lora_name} did not become resident ({state})")
        blocks = manager.resident(request.lora_int_id).layout.num_blocks
        mib = sum(w.lora_a.numel() + w.lora_b.numel() for w in adapter.weights.values()) * 4 / 2**20
        manager.unregister(request.lora_int_id)
    return {"adapters": len(adapters), "disk_to_host_ms": 1000 * statistics.median(disk),
            "host_to_pool_ms": 1000 * statistics.median(pool), "disk_to_host_all_ms": [1000 * t for t in disk],
            "host_to_pool_all_ms": [1000 * t for t in pool], "adapter_mib_fp32": mib, "kv_blocks": blocks}


def warm_up_lora(engine: Any, model_path: str, targets: list[str]) -> None:
    """Two short requests, one on a throwaway adapter, so the LoRA path's first-call costs
    (its kernel loads on first use) stay out of the first LoRA cell's timing; the adapter is
    unregistered after (its KV blocks go back)."""
    adapter = build_adapters(model_path, 1, 8, targets, 99_999, engine.runner.hf_config, first_id=999_999)[0]
    run_simulated(engine, [WorkloadRequest([11, 12, 13, 14], 4)] * 2, [0.0, 0.0], id_prefix="warmup-lora-",
                  lora_requests=[None, adapter])
    engine.lora_manager.unregister(adapter.lora_int_id)
