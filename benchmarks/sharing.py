"""KV block sharing: memory saved by parallel sampling and beam search, and the speed-up
of prefix caching on a few-shot workload.

    python benchmarks/sharing.py            # ~5 min on 2 cores
    python benchmarks/sharing.py --quick

Blocks saved (the PagedAttention paper's Fig. 15 measure): at every step, the blocks the
live sequences would hold without sharing (the sum of their block-table lengths) against
the blocks actually in use; saved = 1 - used / unshared, averaged over steps weighted by
`unshared` (so the figure is a share of block-steps). Alpaca-like lengths (prompt ~19,
output ~58 tokens), `ignore_eos` so every sequence reaches its length.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from pagedserve import LLM, BeamSearchParams, SamplingParams  # noqa: E402
from pagedserve.bench.workloads import synthetic  # noqa: E402
from pagedserve.demo_models import get_model_path  # noqa: E402

PAPER = {"parallel": "6.1% - 9.8%", "beam": "37.6% - 55.2%"}


def _step_all(llm: LLM, done) -> tuple[int, int]:
    """Steps the engine until `done()`; returns (block-steps used, block-steps without sharing)."""
    engine = llm.llm_engine
    kv = engine.kv_manager
    used = unshared = 0
    while not done():
        engine.step()
        tables = kv.block_tables.values()
        used += kv.pool.num_used_blocks
        unshared += sum(len(t) for t in tables)
    return used, unshared


def blocks_saved(model: str, mode: str, width: int, num_requests: int, block_size: int) -> dict:
    llm = LLM(model, max_model_len=1024, kv_cache_memory_bytes=256 << 20, block_size=block_size,
              enable_prefix_caching=False)
    engine = llm.llm_engine
    workload = synthetic("alpaca", num_requests, engine.vocab_size, seed=1)
    ids = []
    for i, req in enumerate(workload):
        prompt = {"prompt_token_ids": req.prompt_token_ids}
        if mode == "parallel":
            params = SamplingParams(n=width, temperature=1.0, seed=i, max_tokens=req.output_len, ignore_eos=True)
            ids.append(engine.add_request(None, prompt, params))
        else:
            ids.append(engine.add_beam_search(None, prompt, BeamSearchParams(width, req.output_len, ignore_eos=True)))
    if mode == "parallel":
        used, unshared = _step_all(llm, lambda: not engine.has_unfinished_requests())
    else:
        used, unshared = _step_all(llm, lambda: all(i in engine.beam_search.results for i in ids))
        engine.beam_search.results.clear()
    engine.assert_no_leaks()
    return {"mode": mode, "width": width, "saved": 1 - used / unshared, "block_size": block_size}


def few_shot_prompts(vocab: int, shots: int, num_questions: int, seed: int = 0) -> list[list[int]]:
    """A shared few-shot prefix (~68 tokens per example) before short distinct questions."""
    rng = random.Random(seed)
    prefix = [rng.randrange(8, vocab) for _ in range(12 + 68 * shots)]
    return [prefix + [rng.randrange(8, vocab) for _ in range(rng.randint(8, 24))] for _ in range(num_questions)]


def prefix_caching_speedup(model: str, shots: int, num_questions: int, runs: int) -> dict:
    """Tokens/s with prefix caching off vs on, two warm engines measured alternately.

    Each run starts from an empty cache plus one earlier request that computed the shared
    prefix (untimed): the steady state of a few-shot service. Alternating the two engines
    keeps slow phases of a shared machine from landing on one side only.
    """
    llms = {c: LLM(model, max_model_len=1024, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=c) for c in (False, True)}
    vocab = llms[False].llm_engine.vocab_size
    prompts = [{"prompt_token_ids": p} for p in few_shot_prompts(vocab, shots, num_questions)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    warm = [{"prompt_token_ids": prompts[0]["prompt_token_ids"][:-8]}]
    times: dict[bool, list[float]] = {False: [], True: []}
    tokens = 0
    for _ in range(runs):
        for caching, llm in llms.items():
            llm.llm_engine.kv_manager.pool.reset_prefix_cache()
            llm.generate(warm, params, use_tqdm=False)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            times[caching].append(time.perf_counter() - start)
            tokens = sum(len(p["prompt_token_ids"]) + len(o.outputs[0].token_ids) for p, o in zip(prompts, outputs, strict=True))
    stats = llms[True].llm_engine.get_stats().scheduler
    result = {
        "shots": shots,
        "prefix_tokens": len(prompts[0]["prompt_token_ids"]) - 16,
        "no_caching": tokens / statistics.median(times[False]),
        "caching": tokens / statistics.median(times[True]),
        "hit_rate_True": stats.prefix_cache_hits / max(1, stats.prefix_cache_queries),
        "times_s": {str(k): v for k, v in times.items()},
    }
    result["speedup"] = result["caching"] / result["no_caching"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="for blocks saved (lengths matter, not weights): default llama-gqa")
    parser.add_argument("--speed-model", default=None, help="for the prefix-caching speed-up: default bench-125m")
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    model = args.model or str(get_model_path("llama-gqa"))
    speed_model = args.speed_model or str(get_model_path("llama-gqa" if args.quick else "bench-125m"))
    num_requests, runs, questions = (8, 1, 8) if args.quick else (args.num_requests, args.runs, 32)
    saved = [blocks_saved(model, mode, w, num_requests, 16) for mode in ("parallel", "beam") for w in (2, 4, 6)]
    speed = [prefix_caching_speedup(speed_model, shots, questions, runs) for shots in (1, 5)]
    print("| sharing | width | KV blocks saved | paper |\n|---|---|---|---|")
    for r in saved:
        print(f"| {'parallel sampling n' if r['mode'] == 'parallel' else 'beam search width'} | {r['width']} | "
              f"{r['saved']:.1%} | {PAPER[r['mode']]} |")
    print("\n| workload | prefix tokens | tok/s caching off | tok/s caching on | speed-up | hit rate |\n|---|---|---|---|---|---|")
    for r in speed:
        print(f"| {r['shots']}-shot | {r['prefix_tokens']} | {r['no_caching']:.0f} | {r['caching']:.0f} | "
              f"{r['speedup']:.2f}x | {r['hit_rate_True']:.1%} |")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"blocks_saved": saved, "prefix_caching": speed}, indent=2))


if __name__ == "__main__":
    main()
