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
from pagedserve.bench.sim import run_simulated, summarize
from pagedserve.bench.workloads import arrival_times


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
