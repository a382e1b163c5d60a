"""Issue 35.6: a GGUF file served by pagedserve beside llama.cpp on the same file, the same
threads, in one script (run it on a quiet machine: two CPU-heavy jobs distort both sides).

    python benchmarks/gguf_vs_llamacpp.py --model qwen2.5-coder-1.5b-instruct \\
        --llama-bin /work/scratch/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin

llama.cpp is a benchmark peer built in a scratch folder (never a project dependency): the
vendored llama.cpp of the llama-cpp-python sdist on PyPI, `cmake -B build -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF && cmake --build build --target llama-bench llama-server`.

Sections (--sections, each side by side, the two engines taking turns run by run where both run):
  * decode: batch-1 decode tok/s. llama.cpp: `llama-bench -n 128 -p 0` (tg128); pagedserve:
    a 1-token prompt, 128 greedy tokens (EOS ignored), the steps after the first token. With the
    file's bytes over the measured read bandwidth (a float32 sum over 512 MiB, best of 5): the
    weight-read roofline;
  * prefill: pp512. llama.cpp: `llama-bench -p 512 -n 0`; pagedserve: a fresh random 512-token
    prompt to its first token (no prefix-cache hit);
  * serve: --serve-requests concurrent requests (prompts U[32,512] token ids, outputs U[16,256],
    ignore_eos) through the same HTTP client (bench/loadgen.py) against `llama-server` with
    --slots slots and against `pagedserve serve`: output tok/s over the whole run;
  * lora: pagedserve alone, 4 rank-16 random adapters (PEFT's layout, q/k/v/o) mixed in one
    batch of 16 against the base model alone on the same batch: output tok/s;
  * coder: batch 1, the model rewrites a 60-line function with one small change; llama.cpp's
    plain decode (`llama-server`, its /completion timings) against pagedserve with n-gram
    speculation (prompt lookup), whose output must equal its unspeculated greedy run.
Each figure is the median of --runs; ratios are pagedserve / llama.cpp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import pagedserve.bench.loadgen as loadgen
from pagedserve.bench.peer import PAGEDSERVE_SERVER_CMD, Server
from pagedserve.bench.roofline import read_bandwidth

CODER_FUNCTION = '''def summarize_orders(orders, customers, min_total=0.0, currency="EUR"):
    """Per-customer totals of paid orders, largest first."""
    by_id = {}
    for customer in customers:
        by_id[customer["id"]] = {
            "name": customer["name"],
            "email": customer.get("email", ""),
            "orders": 0,
            "total": 0.0,
            "first": None,
            "last": None,
        }
    skipped = 0
    for order in orders:
        if order.get("status") != "paid":
            skipped += 1
            continue
        entry = by_id.get(order["customer_id"])
        if entry is None:
            skipped += 1
            continue
        amount = float(order["amount"])
        if order.get("currency", currency) != currency:
            rate = order.get("rate")
            if rate is None:
                skipped += 1
                continue
            amount = amount * float(rate)
        entry["orders"] += 1
        entry["total"] += amount
        day = order["date"]
        if entry["first"] is None or day < entry["first"]:
            entry["first"] = day
        if entry["last"] is None or day > entry["last"]:
            entry["last"] = day
    rows = []
    for customer_id, entry in by_id.items():
        if entry["orders"] == 0:
            continue
        if entry["total"] < min_total:
            continue
        average = entry["total"] / entry["orders"]
        rows.append({
            "customer_id": customer_id,
            "name": entry["name"],
            "email": entry["email"],
            "orders": entry["orders"],
            "total": round(entry["total"], 2),
            "average": round(average, 2),
            "first": entry["first"],
            "last": entry["last"],
        })
    rows.sort(key=lambda row: row["total"], reverse=True)
    report = {
        "currency": currency,
        "customers": len(rows),
        "skipped": skipped,
        "rows": rows,
    }
    return report
'''
CODER_REQUEST = ("Rewrite this Python function so that it also skips orders whose status is \"refunded\" "
                 "and counts them in a new \"refunded\" entry of the report. Reply with the whole "
                 "function in one code block and nothing else.\n\n```python\n" + CODER_FUNCTION + "```")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---- llama.cpp ----------------------------------------------------------------------------------


def llama_bench(bin_dir: Path, model: str, threads: int, runs: int, prompt: int, gen: int) -> float:
    """llama-bench's average tok/s for one test (pp<prompt> or tg<gen>), --runs repetitions."""
    cmd = [str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(prompt), "-n", str(gen),
           "-r", str(runs), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rows = json.loads(done.stdout)
    return float(rows[0]["avg_ts"])


def llama_server_cmd(bin_dir: Path, threads: int, slots: int, ctx_per_slot: int) -> str:
    # -np slots sharing -c: llama-server gives each slot c / np tokens; continuous batching is on.
    return (f"{shlex.quote(str(bin_dir / 'llama-server'))} -m {{model}} --host 127.0.0.1 --port {{port}} "
            f"-t {threads} -tb {threads} -np {slots} -c {slots * ctx_per_slot} --no-webui")


def llama_completion(base_url: str, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """llama-server's /completion, greedy, `tokens` tokens: (the token ids, its decode tok/s)."""
    import httpx

    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True, "ignore_eos": False}
    got = httpx.post(base_url + "/completion", json=body, timeout=3600).json()
    return list(got.get("tokens", [])), float(got["timings"]["predicted_per_second"])


# ---- pagedserve -----------------------------------------------------------------------------------


def build_llm(model: str, **kwargs: Any):
    from pagedserve import LLM

    return LLM(model, max_model_len=2048, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False, **kwargs)


def engine_decode(llm, tokens: int, seed: int) -> float:
    """Steady-state batch-1 decode tok/s: the steps after the first token."""
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    engine.add_request(f"decode-{seed}", {"prompt_token_ids": [100 + seed]},
                       SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True))
    engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return tokens / (time.perf_counter() - start)


def engine_prefill(llm, length: int, vocab: int, seed: int) -> float:
    """Tokens/s of a fresh `length`-token prompt to its first token."""
    from pagedserve import SamplingParams

    rng = random.Random(seed)
    prompt = [rng.randrange(100, vocab - 1) for _ in range(length)]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    return length / (time.perf_counter() - start)


def engine_batch(llm, prompts: list[list[int]], outputs: list[int], loras: list[Any] | None = None) -> float:
    """Output tok/s of `prompts` submitted together (greedy, EOS ignored)."""
    from pagedserve import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    return sum(outputs) / (time.perf_counter() - start)


def engine_reply(llm, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedy reply to `prompt` and its decode tok/s (the tokens after the first over their time)."""
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    engine.add_request("coder", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=tokens))
    out: list[int] = []
    outputs = engine.step()
    start = time.perf_counter()
    first = len(outputs[0].outputs[0].token_ids) if outputs else 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
    for output in outputs:
        if output.finished:
            out = list(output.outputs[0].token_ids)
    return out, (len(out) - first) / (time.perf_counter() - start)


# ---- sections ---------------------------------------------------------------------------------


def section_speed(args: argparse.Namespace, model_path: str, vocab: int, results: dict) -> None:
    llm = build_llm(model_path)
    engine_decode(llm, 8, 0)  # warm-up
    engine_prefill(llm, 64, vocab, 0)
    ours_tg, ours_pp, theirs_tg, theirs_pp = [], [], [], []
    for run in range(args.runs):
        if "decode" in args.sections:
            ours_tg.append(engine_decode(llm, 128, run + 1))
            theirs_tg.append(llama_bench(args.llama_bin, model_path, args.threads, 1, 0, 128))
        if "prefill" in args.sections:
            ours_pp.append(engine_prefill(llm, 512, vocab, run + 1))
            theirs_pp.append(llama_bench(args.llama_bin, model_path, args.threads, 1, 512, 0))
        print(f"# run {run + 1}: tg {ours_tg[-1:]} vs {theirs_tg[-1:]}, pp {ours_pp[-1:]} vs {theirs_pp[-1:]}",
              flush=True)
    del llm
    bandwidth = read_bandwidth()
    file_bytes = Path(model_path).stat().st_size
    results["decode"] = {"pagedserve": median(ours_tg), "llama.cpp": median(theirs_tg),
                         "roofline": bandwidth / file_bytes, "bandwidth_gbs": bandwidth / 1e9}
    results["prefill"] = {"pagedserve": median(ours_pp), "llama.cpp": median(theirs_pp)}


def serve_requests(n: int, vocab: int, seed: int) -> list[loadgen.BenchRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(32, 512)
        out.append(loadgen.BenchRequest([rng.randrange(100, vocab - 1) for _ in range(length)], length,
                                        rng.randint(16, 256)))
    return out


def serve_once(command: str, model_path: str, requests: list[loadgen.BenchRequest]) -> float:
    server = Server(command, model_path)
    try:
        model = asyncio.run(loadgen.default_model(server.base_url))
        asyncio.run(loadgen.run_benchmark(server.base_url, model, requests[:1]))  # warm-up
        got, duration = asyncio.run(loadgen.run_benchmark(server.base_url, model, requests))
        failed = [r.error for r in got if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
        return sum(r.output_len for r in got) / duration
    finally:
        server.close()


def section_serve(args: argparse.Namespace, model_path: str, vocab: int, results: dict) -> None:
    requests = serve_requests(args.serve_requests, vocab, 0)
    ours_cmd = PAGEDSERVE_SERVER_CMD + " --max-num-seqs 64 --max-model-len 1024"
    theirs_cmd = llama_server_cmd(args.llama_bin, args.threads, args.slots, 1024)
    ours, theirs = [], []
    for run in range(args.serve_runs):
        ours.append(serve_once(ours_cmd, model_path, requests))
        theirs.append(serve_once(theirs_cmd, model_path, requests))
        print(f"# serve run {run + 1}: {ours[-1]:.1f} vs {theirs[-1]:.1f} output tok/s", flush=True)
    results["serve"] = {"pagedserve": median(ours), "llama.cpp": median(theirs), "requests": len(requests),
                        "slots": args.slots}


def section_lora(args: argparse.Namespace, model_path: str, vocab: int, results: dict) -> None:
    from pagedserve import LoRARequest
    from pagedserve.bench.lora import write_random_adapter
    from pagedserve.envs import cache_dir
    from pagedserve.models.loader import load_hf_config

    config = load_hf_config(Path(model_path))
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    adapters = [LoRARequest(f"r16-{i}", i + 1, str(write_random_adapter(
        model_path, cache_dir() / "adapters" / "gguf-vs-llamacpp" / f"{Path(model_path).stem}-r16-{i}", 16,
        targets, 100 + i, config))) for i in range(4)]
    llm = build_llm(model_path, enable_lora=True, max_loras=4, max_lora_rank=16)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, vocab - 1) for _ in range(rng.randint(32, 256))] for _ in range(16)]
    outputs = [64] * len(prompts)
    engine_batch(llm, prompts[:2], [4, 4], [adapters[0], adapters[1]])  # warm-up: adapters resident
    base, mixed = [], []
    for _ in range(args.runs):
        base.append(engine_batch(llm, prompts, outputs))
        mixed.append(engine_batch(llm, prompts, outputs, [adapters[i % 4] for i in range(len(prompts))]))
    results["lora"] = {"base": median(base), "mixed": median(mixed)}


def section_coder(args: argparse.Namespace, model_path: str, results: dict) -> None:
    from pagedserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": CODER_REQUEST}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
    tokens = args.coder_tokens
    plain = build_llm(model_path)
    reference, _ = engine_reply(plain, prompt, tokens)
    del plain
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    spec = build_llm(model_path, speculative_config=ngram)
    server = Server(llama_server_cmd(args.llama_bin, args.threads, 1, 4096), model_path)
    ours, theirs = [], []
    try:
        for run in range(args.runs):
            out, rate = engine_reply(spec, prompt, tokens)
            if out != reference:
                raise SystemExit(f"speculated output differs from the unspeculated run at token "
                                 f"{next(i for i, (a, b) in enumerate(zip(out, reference, strict=False)) if a != b)}")
            ours.append(rate)
            _, llama_rate = llama_completion(server.base_url, prompt, len(reference))
            theirs.append(llama_rate)
            print(f"# coder run {run + 1}: {rate:.1f} vs {llama_rate:.1f} tok/s", flush=True)
    finally:
        server.close()
    results["coder"] = {"pagedserve_ngram": median(ours), "llama.cpp": median(theirs), "prompt_tokens": len(prompt),
                        "reply_tokens": len(reference), "reply": tokenizer.decode(reference)}


def report(results: dict, args: argparse.Namespace, model_path: str) -> None:
    print(f"\n{Path(model_path).name} ({Path(model_path).stat().st_size / 1e6:,.0f} MB), {args.threads} threads, "
          f"median of {args.runs} runs; {platform.processor() or platform.machine()}")
    print("| measure | pagedserve | llama.cpp | ratio | target |")
    print("|---|---:|---:|---:|---|")
    rows = [("decode", "batch-1 decode (tok/s)", "≥ 1.0x"), ("prefill", "pp512 (tok/s)", "≥ 1.0x"),
            ("serve", "64 concurrent requests, output tok/s", "≥ 2.0x")]
    for key, label, target in rows:
        if key in results:
            r = results[key]
            print(f"| {label} | {r['pagedserve']:.1f} | {r['llama.cpp']:.1f} | {r['pagedserve'] / r['llama.cpp']:.2f}x | "
                  f"{target} |")
    if "decode" in results:
        d = results["decode"]
        print(f"| decode against the file's weight-read roofline ({d['bandwidth_gbs']:.1f} GB/s: "
              f"{d['roofline']:.1f} tok/s) | {d['pagedserve'] / d['roofline']:.0%} | "
              f"{d['llama.cpp'] / d['roofline']:.0%} | | ≥ 70% |")
    if "lora" in results:
        r = results["lora"]
        print(f"| 4 rank-16 adapters mixed vs the base (batch 16, output tok/s) | {r['mixed']:.1f} / {r['base']:.1f} "
              f"| | {r['mixed'] / r['base']:.2f}x | ≥ 0.85x |")
    if "coder" in results:
        r = results["coder"]
        print(f"| coder rewrite ({r['prompt_tokens']} prompt, {r['reply_tokens']} reply tokens), batch 1: n-gram "
              f"speculation vs plain decode (tok/s) | {r['pagedserve_ngram']:.1f} | {r['llama.cpp']:.1f} | "
              f"{r['pagedserve_ngram'] / r['llama.cpp']:.2f}x | ≥ 2.0x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="a catalog name or a .gguf file")
    parser.add_argument("--llama-bin", type=Path, required=True, help="llama.cpp's build/bin (llama-bench, llama-server)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--sections", default="decode,prefill,serve,lora,coder")
    parser.add_argument("--serve-requests", type=int, default=64)
    parser.add_argument("--serve-runs", type=int, default=1, help="the serve section's runs (minutes each)")
    parser.add_argument("--slots", type=int, default=16, help="llama-server's parallel slots")
    parser.add_argument("--k", type=int, default=8, help="n-gram speculation: tokens proposed a step")
    parser.add_argument("--coder-tokens", type=int, default=768)
    parser.add_argument("--results", default=None, help="also write the figures here (JSON)")
    args = parser.parse_args()
    args.sections = set(args.sections.split(","))
    from pagedserve.models.hub import resolve_model_path
    from pagedserve.models.loader import load_hf_config

    model_path = resolve_model_path(args.model)
    vocab = load_hf_config(Path(model_path)).vocab_size
    results: dict[str, Any] = {}
    if args.sections & {"decode", "prefill"}:
        section_speed(args, model_path, vocab, results)
    if "serve" in args.sections:
        section_serve(args, model_path, vocab, results)
    if "lora" in args.sections:
        section_lora(args, model_path, vocab, results)
    if "coder" in args.sections:
        section_coder(args, model_path, results)
    if args.results:
        Path(args.results).write_text(json.dumps(results, indent=1))
    report(results, args, model_path)


if __name__ == "__main__":
    main()
