"""Weight (int8, int4) and KV-cache (int8) quantization: kernels, quality and serving cost.

    python benchmarks/quantization.py                 # quality + perf (~15 min on 2 cores)
    python benchmarks/quantization.py --quick         # smoke run (tiny models, small workload)
    python benchmarks/quantization.py --kernels       # linear-kernel micro-benchmark only
    python benchmarks/quantization.py --quality       # quality table only
    python benchmarks/quantization.py --perf          # serving table only

Quality, per model and configuration, against the same model in fp32:
  * greedy agreement: 64 prompts x 64 tokens through the engine; per prompt the fraction of
    tokens before the first divergence from fp32, averaged;
  * mean KL(fp32 || config) of the next-token distributions over a fixed text (pseudo-English
    from demo_models' corpus generator, seed 99), teacher-forced;
  * perplexity on a held-out text (the source of Python's argparse module) vs fp32's.
The models have random weights, so absolute perplexities are meaningless; the ratio to fp32
and the KL are what quantization costs. Each quality forward goes through our loader and the
torch paged-attention backend (the one that stores int8 K/V).

Perf: each configuration serves the same ShareGPT-like workload in its own subprocess (its
own RSS): throughput, median TTFT / TPOT, weights and KV bytes, RSS after load and peak; and
the largest batch of max-length sequences that fits a fixed memory budget (weights + KV).
All configurations use the torch attention backend (the only one with an int8 KV path), so
the KV rows compare like with like.

Timings on a shared 2-core machine are noisy: kernels report the minimum over interleaved
repeats; perf runs each configuration --runs times (interleaved) and reports the median, and
also output tokens per CPU-second of the serving process (with --threads 1 that is the work
per token, which other processes holding the cores do not inflate the way wall time does).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# name -> LLM keyword arguments; "fp32" is the reference of the quality table.
CONFIGS: dict[str, dict] = {
    "fp32": {"dtype": "float32"},
    "bf16": {"dtype": "bfloat16"},
    "int8": {"dtype": "float32", "quantization": "int8"},
    "int4": {"dtype": "float32", "quantization": "int4"},
    "kv-int8": {"dtype": "float32", "kv_cache_dtype": "int8"},
    "int8+kv-int8": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "int8"},
    # Not in the default run: quantized weights in a bf16 model (bf16 activations, LM head, KV).
    "int8-bf16": {"dtype": "bfloat16", "quantization": "int8"},
    "int4-bf16": {"dtype": "bfloat16", "quantization": "int4"},
}
DEFAULT_CONFIGS = ["fp32", "bf16", "int8", "int4", "kv-int8", "int8+kv-int8"]
KERNEL_SHAPES = [(768, 2304), (768, 4096), (2048, 768), (768, 32000)]  # (in, out) of the 125M models
KERNEL_ROWS = [1, 16, 64, 256]


# ---- kernels --------------------------------------------------------------------------------


def _kernel_candidates(k: int, n: int) -> tuple[dict, dict]:
    """name -> fn(x) for every option, and the fp32 weight (for the error column)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from pagedserve.quantization.int4 import Int4LinearMethod
    from pagedserve.quantization.int8 import Int8LinearMethod
    from pagedserve.quantization.packed import PACKED, onednn_available

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) / math.sqrt(k)

    def layer_for(method, weight=w):
        layer = nn.Module()
        layer.input_size, layer.output_size, layer.bias = k, n, None
        layer.weight = nn.Parameter(weight.clone(), requires_grad=False)
        method.process_weights_after_loading(layer)
        return layer

    fns = {"fp32 F.linear (MKL)": lambda x: F.linear(x, w)}
    if onednn_available():
        fp32_packed, bf16_packed = layer_for(PACKED), layer_for(PACKED, w.bfloat16())
        fns["fp32 oneDNN prepacked"] = lambda x: PACKED.apply(fp32_packed, x)
        fns["bf16 oneDNN prepacked"] = lambda x: PACKED.apply(bf16_packed, x.bfloat16()).float()
    m8 = Int8LinearMethod()
    l8 = layer_for(m8)
    t8 = layer_for(Int8LinearMethod(kernel="torch"))
    always, never = Int8LinearMethod(1 << 30, "torch"), Int8LinearMethod(0, "torch")
    l4 = layer_for(Int4LinearMethod(128))
    always4, never4 = Int4LinearMethod(128, 1 << 30), Int4LinearMethod(128, 0)
    ones_f32 = torch.ones(n)
    fns.update({
        "int8 torch kernel, fp32 x": lambda x: torch.ops.aten._weight_int8pack_mm(x, t8.qweight, ones_f32)
        * t8.weight_scale,
        "int8 torch kernel, bf16 x": lambda x: always.apply(t8, x),
        "int8 -> bf16 GEMM": lambda x: never.apply(t8, x),
        # The engine's int8: the C++ AVX512-BF16 kernel where it runs, else the torch paths.
        "int8 engine": lambda x: m8.apply(l8, x),
        "int4 kernel, bf16 x": lambda x: always4.apply(l4, x),
        "int4 -> bf16 GEMM": lambda x: never4.apply(l4, x),
        "int4 engine": lambda x: Int4LinearMethod(128).apply(l4, x),
        "w8a8 torch._int_mm (dynamic act., ref.)": lambda x: _w8a8(x, t8),
    })
    return fns, {"w": w}


def _w8a8(x, layer):
    """Dynamic per-row int8 activations x int8 weights (oneDNN VNNI): not weight-only."""
    import torch

    sx = x.abs().amax(1, keepdim=True).clamp(min=1e-8) / 127
    qx = torch.round(x / sx).to(torch.int8)
    m = qx.shape[0]
    if m <= 16:  # torch._int_mm wants more than 16 rows
        qx = torch.cat([qx, qx.new_zeros(17 - m, qx.shape[1])])
    return torch._int_mm(qx, layer.qweight.t())[:m].float() * sx * layer.weight_scale


def run_kernels(args: argparse.Namespace) -> list[dict]:
    import torch

    rows_out = []
    for k, n in KERNEL_SHAPES if not args.quick else KERNEL_SHAPES[:1]:
        fns, ref = _kernel_candidates(k, n)
        for m in KERNEL_ROWS:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            exact = x @ ref["w"].t()
            live = {name: f for name, f in fns.items() if not ("fp32 x" in name and m > 16)}
            best = {name: float("inf") for name in live}
            err = {name: ((f(x) - exact).norm() / exact.norm()).item() for name, f in live.items()}
            for _ in range(args.kernel_reps):  # interleaved, so load spikes hit every option
                for name, f in live.items():
                    t = time.perf_counter()
                    f(x)
                    best[name] = min(best[name], time.perf_counter() - t)
            for name in live:
                rows_out.append({"in": k, "out": n, "rows": m, "kernel": name,
                                 "ms": best[name] * 1e3, "rel_err": err[name]})
            print(f"  {k}->{n} rows={m}: " + ", ".join(f"{nm} {best[nm] * 1e3:.3f}" for nm in live),
                  file=sys.stderr, flush=True)
    return rows_out


def print_kernels(rows: list[dict]) -> None:
    names = list(dict.fromkeys(r["kernel"] for r in rows))
    print("\n### Linear kernels: ms per call (min of interleaved repeats), error vs fp32 weights\n")
    print("| in->out | rows | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    keyed = {(r["in"], r["out"], r["rows"], r["kernel"]): r for r in rows}
    for k, n, m in dict.fromkeys((r["in"], r["out"], r["rows"]) for r in rows):
        cells = []
        for name in names:
            r = keyed.get((k, n, m, name))
            cells.append("-" if r is None else f"{r['ms']:.3f} ({r['rel_err']:.1e})")
        print(f"| {k}->{n} | {m} | " + " | ".join(cells) + " |")


# ---- quality --------------------------------------------------------------------------------


def _texts(tokenizer, kl_tokens: int, ppl_tokens: int) -> tuple[list[int], list[int]]:
    import argparse as stdlib_argparse

    from pagedserve.demo_models import _make_corpus

    fixed = "".join(_make_corpus(4000, 1000, seed=99))
    held_out = Path(stdlib_argparse.__file__).read_text()
    return (tokenizer.encode(fixed, add_special_tokens=False)[:kl_tokens],
            tokenizer.encode(held_out, add_special_tokens=False)[:ppl_tokens])


class TeacherForced:
    """One model of a configuration, fed a text chunk by chunk through the paged cache."""

    def __init__(self, path: str, config: dict, max_len: int, chunk: int = 256) -> None:
        import torch

        from pagedserve.attention.torch_paged import TorchPagedAttentionBackend
        from pagedserve.config import ModelConfig
        from pagedserve.dtypes import serving_dtype
        from pagedserve.models.layers.attention import Attention
        from pagedserve.models.loader import load_model
        from pagedserve.worker.kv_cache import KVCacheSpec, allocate_kv_caches, kv_cache_torch_dtype

        mc = ModelConfig(path, dtype=config.get("dtype", "float32"),
                         quantization=config.get("quantization"))
        dtype = serving_dtype(mc.dtype, torch.device("cpu"))
        self.model, _ = load_model(path, dtype, torch.device("cpu"), mc.quant_config())
        self.backend, self.chunk, self.block = TorchPagedAttentionBackend(), chunk, 16
        attn = sorted((m for m in self.model.modules() if isinstance(m, Attention)),
                      key=lambda m: m.layer_idx)
        kv_dtype = kv_cache_torch_dtype(config.get("kv_cache_dtype", "auto"), dtype)
        spec = KVCacheSpec(len(attn), attn[0].num_kv_heads, attn[0].head_dim, self.block, kv_dtype)
        for layer, cache in zip(attn, allocate_kv_caches(spec, -(-max_len // self.block), torch.device("cpu")), strict=True):
            layer.kv_cache = cache

    def log_probs(self, tokens: list[int]):
        """Yields (positions, log-softmax (n, vocab) float32) chunk by chunk."""
        import torch

        from pagedserve.attention.metadata import CommonAttentionMetadata

        table = torch.arange(-(-len(tokens) // self.block))[None]
        with torch.inference_mode():
            for start in range(0, len(tokens), self.chunk):
                ids = tokens[start : start + self.chunk]
                pos = torch.arange(start, start + len(ids))
                end = start + len(ids)
                common = CommonAttentionMetadata(
                    num_tokens=len(ids), num_seqs=1, block_size=self.block, slot_mapping=pos,
                    query_start_loc=torch.tensor([0, len(ids)]), seq_lens=torch.tensor([end]),
                    block_tables=table, query_lens_list=[len(ids)], seq_lens_list=[end],
                    max_query_len=len(ids), max_seq_len=end)
                hidden = self.model(torch.tensor(ids), pos, self.backend.build_metadata(common))
                yield pos, torch.log_softmax(self.model.compute_logits(hidden), dim=-1)


def _kl_and_nll(path: str, config: dict, ref: TeacherForced | None, kl_text, ppl_text):
    """(mean KL(ref || config) on kl_text or None, mean NLL on ppl_text) for one config."""
    import torch

    model = TeacherForced(path, config, max(len(kl_text), len(ppl_text)))
    kl = None
    if ref is not None:
        total = 0.0
        for (_, lp), (_, lq) in zip(ref.log_probs(kl_text), model.log_probs(kl_text), strict=True):
            total += (lp.exp() * (lp - lq)).sum().item()
        kl = total / len(kl_text)
    nll = 0.0
    for pos, lq in model.log_probs(ppl_text):
        nxt = pos + 1
        keep = nxt < len(ppl_text)
        targets = torch.tensor(ppl_text)[nxt[keep]]
        nll -= lq[keep].gather(1, targets[:, None]).sum().item()
    return kl, nll / (len(ppl_text) - 1)


def _greedy(path: str, config: dict, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes=256 << 20, **config)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Mean over prompts of (tokens before the first divergence) / length."""
    fractions = []
    for a, b in zip(ref, got, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        fractions.append(same / len(a))
    return sum(fractions) / len(fractions)


def run_quality(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoTokenizer

    from pagedserve.demo_models import get_model_path

    os.environ.setdefault("PAGEDSERVE_ATTENTION_BACKEND", "torch")
    rows = []
    for name in args.quality_models.split(","):
        path = str(get_model_path(name))
        tok = AutoTokenizer.from_pretrained(path)
        kl_text, ppl_text = _texts(tok, args.kl_tokens, args.ppl_tokens)
        step = max(1, (len(kl_text) - 32) // args.num_prompts)
        prompts = [kl_text[i * step : i * step + 32] for i in range(args.num_prompts)]
        ref_model = TeacherForced(path, CONFIGS["fp32"], max(len(kl_text), len(ppl_text)))
        ref_greedy = _greedy(path, CONFIGS["fp32"], prompts, args.new_tokens)
        _, ref_nll = _kl_and_nll(path, CONFIGS["fp32"], None, kl_text, ppl_text)
        for config in args.configs.split(","):
            t = time.perf_counter()
            kl, nll = _kl_and_nll(path, CONFIGS[config], ref_model, kl_text, ppl_text)
            agree = _agreement(ref_greedy, _greedy(path, CONFIGS[config], prompts, args.new_tokens))
            rows.append({"model": name, "config": config, "greedy_agreement": agree, "mean_kl": kl,
                         "ppl": math.exp(nll), "ppl_fp32": math.exp(ref_nll),
                         "ppl_ratio": math.exp(nll - ref_nll)})
            print(f"  {name} {config}: agree {agree:.3f} kl {kl:.4f} ppl x{math.exp(nll - ref_nll):.4f}"
                  f" ({time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
    return rows


def print_quality(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n### Quality vs fp32 ({args.num_prompts} prompts x {args.new_tokens} greedy tokens; "
          f"KL over {args.kl_tokens} tokens; perplexity over {args.ppl_tokens} tokens)\n")
    print("| model | config | greedy agreement | mean KL (nats) | perplexity | ppl / fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['config']} | {r['greedy_agreement']:.3f} | {r['mean_kl']:.5f} "
              f"| {r['ppl']:.1f} | {r['ppl_ratio']:.4f} |")


# ---- serving performance --------------------------------------------------------------------


def _rss_mib() -> tuple[float, float]:
    """(anonymous, total) resident MiB. The total also counts clean file pages (the mmapped
    checkpoint while loading), which the kernel can drop; anonymous memory is what we own."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon", "VmRSS")):
            name, kib, _ = line.split()
            fields[name.rstrip(":")] = int(kib) / 1024
    return fields.get("RssAnon", float("nan")), fields.get("VmRSS", float("nan"))


def _cpu_seconds() -> float:
    """User + system CPU time of this process: on a shared machine, the work done, which
    (unlike wall time) does not grow while other processes hold the cores."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _perf_worker(args: argparse.Namespace) -> dict:
    """One configuration serving the workload file; runs in its own process."""
    import resource

    from pagedserve import LLM, SamplingParams
    from pagedserve.models.loader import weight_bytes

    _set_threads(args.threads)
    workload = json.loads(Path(args.workload).read_text())
    llm = LLM(args.model, max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_bytes,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, **CONFIGS[args.worker])
    engine = llm.llm_engine
    anon_loaded, rss_loaded = _rss_mib()
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=4), use_tqdm=False)
    prompts = [{"prompt_token_ids": r["prompt"]} for r in workload]
    params = [SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True) for r in workload]
    cpu_start, start = _cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    tpot = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outputs if len(o.outputs[0].token_ids) > 1]
    spec = engine.runner.kv_cache_spec()
    return {
        "elapsed_s": elapsed,
        "cpu_s": cpu,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "ttft_median_s": statistics.median(ttft),
        "tpot_median_s": statistics.median(tpot),
        "weight_bytes": weight_bytes(engine.runner.model),
        "kv_bytes_per_token": spec.bytes_per_token,
        "num_blocks": engine.num_blocks,
        "kv_bytes": engine.num_blocks * spec.bytes_per_block,
        "anon_loaded_mib": anon_loaded,
        "rss_loaded_mib": rss_loaded,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _spawn(config: str, args: argparse.Namespace, workload_file: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", config, "--workload", workload_file,
           "--model", args.model, "--kv-cache-bytes", str(args.kv_cache_bytes),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--threads", str(args.threads)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false",
           "PAGEDSERVE_ATTENTION_BACKEND": args.attention_backend}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker {config} failed:\n{proc.stderr[-4000:]}")


def run_perf(args: argparse.Namespace) -> list[dict]:
    import tempfile

    from transformers import AutoConfig

    from pagedserve.bench.workloads import synthetic

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    requests = synthetic("sharegpt", args.num_requests, vocab, seed=0, max_total_len=args.max_model_len)
    workload = [{"prompt": r.prompt_token_ids, "output_len": r.output_len} for r in requests]
    configs = args.configs.split(",")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload, f)
    try:
        for run in range(args.runs):  # interleaved: a load spike hits every configuration
            for config in configs:
                results[config].append(_spawn(config, args, f.name))
                r = results[config][-1]
                print(f"  run {run} {config}: {r['output_tokens'] / r['elapsed_s']:.1f} tok/s, "
                      f"{r['output_tokens'] / r['cpu_s']:.1f} tok/CPU-s", file=sys.stderr, flush=True)
    finally:
        os.unlink(f.name)
    return [_summarise(c, results[c], args) for c in configs]


def _summarise(config: str, runs: list[dict], args: argparse.Namespace) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    budget = args.memory_budget
    per_seq = med["kv_bytes_per_token"] * args.batch_seq_len
    return {"config": config, **med, "runs": len(runs),
            "throughput_tok_s": med["output_tokens"] / med["elapsed_s"],
            "tok_per_cpu_s": med["output_tokens"] / med["cpu_s"],
            "max_batch_in_budget": max(0, int((budget - med["weight_bytes"]) // per_seq))}


def print_perf(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n### Serving {Path(args.model).name}: {args.num_requests} ShareGPT-like requests "
          f"(median of {args.runs}), KV budget {args.kv_cache_bytes / 2**20:.0f} MiB, "
          f"attention backend {args.attention_backend}, threads {args.threads or 'default'}\n")
    print("| config | out tok/s (wall) | out tok / CPU s | TTFT p50 (s) | TPOT p50 (ms) | weights (MiB) | KV B/token "
          "| KV blocks | anon / RSS loaded, peak RSS (MiB) | max batch in "
          f"{args.memory_budget / 2**20:.0f} MiB @ {args.batch_seq_len} tok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['throughput_tok_s']:.1f} | {r['tok_per_cpu_s']:.1f} "
              f"| {r['ttft_median_s']:.2f} "
              f"| {r['tpot_median_s'] * 1e3:.1f} | {r['weight_bytes'] / 2**20:.1f} "
              f"| {r['kv_bytes_per_token']} | {r['num_blocks']} "
              f"| {r['anon_loaded_mib']:.0f} / {r['rss_loaded_mib']:.0f}, {r['peak_rss_mib']:.0f} "
              f"| {r['max_batch_in_budget']} |")


# ---- main -----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", action="store_true", help="only the linear-kernel micro-benchmark")
    p.add_argument("--quality", action="store_true", help="only the quality table")
    p.add_argument("--perf", action="store_true", help="only the serving table")
    p.add_argument("--quick", action="store_true", help="tiny models and workload (smoke test)")
    p.add_argument("--result-json", default=None)
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help="comma-separated, from: " + ", ".join(CONFIGS))
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads everywhere (0: torch's default); 1 is steadier on a busy machine")
    p.add_argument("--kernel-reps", type=int, default=15)
    p.add_argument("--quality-models", default="llama-gqa,opt,gpt2,bench-125m")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--kl-tokens", type=int, default=1024)
    p.add_argument("--ppl-tokens", type=int, default=1024)
    p.add_argument("--model", default=None, help="perf model folder (default: bench-125m)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--batch-seq-len", type=int, default=1024,
                   help="sequence length (tokens) of the max-batch-in-budget column")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument("--memory-budget", type=int, default=1 << 30, help="weights + KV, for max batch")
    p.add_argument("--attention-backend", default="torch", help="PAGEDSERVE_ATTENTION_BACKEND for perf")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    return p


def _apply_quick(args: argparse.Namespace) -> None:
    args.quality_models, args.num_prompts, args.new_tokens = "llama-gqa,opt", 8, 16
    args.kl_tokens = args.ppl_tokens = 256
    args.num_requests, args.kernel_reps, args.kv_cache_bytes = 8, 3, 64 << 20
    args.max_model_len, args.batch_seq_len, args.memory_budget = 256, 256, 256 << 20


def _set_threads(threads: int) -> None:
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def main() -> None:
    args = _parser().parse_args()
    _set_threads(args.threads)
    if args.worker:
        print("RESULT " + json.dumps(_perf_worker(args)), flush=True)
        return
    from pagedserve.demo_models import get_model_path

    if args.quick:
        _apply_quick(args)
    args.model = args.model or str(get_model_path("llama-gqa" if args.quick else "bench-125m"))
    parts = [p for p in ("kernels", "quality", "perf") if getattr(args, p)] or ["quality", "perf"]
    report: dict = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "workload")}}
    if "kernels" in parts:
        report["kernels"] = run_kernels(args)
        print_kernels(report["kernels"])
    if "quality" in parts:
        report["quality"] = run_quality(args)
        print_quality(report["quality"], args)
    if "perf" in parts:
        report["perf"] = run_perf(args)
        print_perf(report["perf"], args)
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
