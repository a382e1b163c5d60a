"""Batch-1 decode of `pagedserve serve` over HTTP beside the offline engine on the same prompt.

    python benchmarks/server_decode.py --model gemma-3-270m [--runs 3] [--tokens 128]

Offline: `LLM(model)`'s engine stepped on the main thread, TPOT = the decode steps' wall time
over their count. Server: `pagedserve serve` in its own process, one streamed greedy request
at a time through bench/loadgen.py (ignore_eos), its TPOT p50. Both on a random 64-token
prompt, median of --runs. The gap is what serving adds per token (session 22: loading the
model on the main thread and stepping it on another left two OpenMP pools and cost
every op ~50 us; engine/engine_thread.py). Run a worktree of an older commit for "before".
The CPU heads the output.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from pagedserve.bench import loadgen
from pagedserve.bench.peer import PAGEDSERVE_SERVER_CMD, Server
from pagedserve.cpp_build import cpu_description
from pagedserve.models import catalog


def offline_tpot(path: str, prompt: list[int], tokens: int, runs: int) -> list[float]:
    from pagedserve import LLM, SamplingParams

    engine = LLM(path).llm_engine
    out = []
    for run in range(runs + 1):  # the first warms up
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        engine.add_request(f"r{run}", {"prompt_token_ids": prompt}, params)
        engine.step()  # the prefill and first token
        start, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        if run:
            out.append((time.perf_counter() - start) / steps * 1e3)
    return out


def server_tpot(path: str, prompt: list[int], tokens: int, runs: int) -> list[float]:
    server = Server(PAGEDSERVE_SERVER_CMD, path)
    try:
        model = asyncio.run(loadgen.default_model(server.base_url))
        request = loadgen.BenchRequest(prompt, len(prompt), tokens)
        asyncio.run(loadgen.run_benchmark(server.base_url, model, [request]))  # warm-up
        out = []
        for _ in range(runs):
            results, duration = asyncio.run(loadgen.run_benchmark(server.base_url, model, [request]))
            out.append(loadgen.summarize(results, duration)["tpot_ms"]["median"])
        return out
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m", help="a catalog name or a model path")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    path = str(catalog.local_path(args.model)) if args.model in catalog.CATALOG else args.model
    rng = random.Random(0)
    prompt = [rng.randrange(100, 20000) for _ in range(64)]
    print(cpu_description())
    offline = offline_tpot(path, prompt, args.tokens, args.runs)
    served = server_tpot(path, prompt, args.tokens, args.runs)
    print(f"{args.model}: batch-1 TPOT ms, median of {args.runs}")
    print(f"  offline LLM   {statistics.median(offline):7.2f}   ({', '.join(f'{v:.2f}' for v in offline)})")
    print(f"  serve (HTTP)  {statistics.median(served):7.2f}   ({', '.join(f'{v:.2f}' for v in served)})")


if __name__ == "__main__":
    main()
