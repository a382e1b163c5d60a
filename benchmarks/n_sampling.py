"""n = 8 samples of a 1,000-token prompt over HTTP: the engine's n vs the old fan-out (issue #15.1).

    python benchmarks/n_sampling.py [--model demo] [--rounds 5] [--max-tokens 32] [--prompt-len 1000]
                                    [--no-prefix-caching] [--quick]

Starts `pagedserve serve MODEL` on 127.0.0.1 and times, side by side in each round (order
alternating):
    engine    one /v1/completions call with n=8, seed s: one engine request, the samples
              fork the prompt's KV blocks after one prefill
    fan-out   eight concurrent n=1 calls with seeds s+0..s+7: what the server did before,
              eight engine requests (with prefix caching they share the prompt's full
              blocks but each computes its partial last block; without it each prefills all)
Both generate the same tokens (the engine's sample i uses seed s+i); the script checks
that. Prints the median wall time of each and the ratio fan-out / engine.
--quick: the tiny test model, 2 rounds, 8 tokens (proves the script works; not a measurement).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

N = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    server = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", model, "--port", str(port),
                               "--log-level", "warning", *extra],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert server.poll() is None, "server exited"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def body(prompt: list[int], n: int, seed: int, max_tokens: int) -> dict:
    return {"prompt": prompt, "n": n, "seed": seed, "max_tokens": max_tokens, "temperature": 1.0,
            "ignore_eos": True, "return_token_ids": True}


def engine_native(http: httpx.Client, prompt: list[int], seed: int, max_tokens: int) -> tuple[float, list]:
    start = time.perf_counter()
    resp = http.post("/v1/completions", json=body(prompt, N, seed, max_tokens))
    elapsed = time.perf_counter() - start
    resp.raise_for_status()
    return elapsed, [c["token_ids"] for c in resp.json()["choices"]]


def fan_out(http: httpx.Client, pool: concurrent.futures.Executor, prompt: list[int], seed: int,
            max_tokens: int) -> tuple[float, list]:
    start = time.perf_counter()
    futures = [pool.submit(http.post, "/v1/completions", json=body(prompt, 1, seed + i, max_tokens)) for i in range(N)]
    responses = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    for resp in responses:
        resp.raise_for_status()
    return elapsed, [r.json()["choices"][0]["token_ids"] for r in responses]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--no-prefix-caching", action="store_true", help="serve with --no-enable-prefix-caching")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.model, args.rounds, args.max_tokens = "llama-gqa", 2, 8
    extra = ["--no-enable-prefix-caching"] if args.no_prefix_caching else []
    port = free_port()
    server = start_server(args.model, port, extra)
    rng = random.Random(0)
    times: dict[str, list[float]] = {"engine": [], "fan-out": []}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as http, \
                concurrent.futures.ThreadPoolExecutor(N) as pool:
            engine_native(http, [5] * 16, 0, 2)  # warm-up: kernels, first allocation
            # Same prompt, same seeds: the two paths must sample the same tokens (untimed).
            check = [rng.randrange(100, 1000) for _ in range(args.prompt_len)]
            _, native_tokens = engine_native(http, check, 7, args.max_tokens)
            _, fan_tokens = fan_out(http, pool, check, 7, args.max_tokens)
            assert native_tokens == fan_tokens, "the two paths sampled different tokens"
            for round_index in range(args.rounds):
                seed = 1000 * round_index
                order = ["engine", "fan-out"] if round_index % 2 == 0 else ["fan-out", "engine"]
                for name in order:
                    # A fresh prompt for every timed call: no prefix-cache hit from an earlier
                    # call (a shared prompt would hand the second path of a round the first's cache).
                    prompt = [rng.randrange(100, 1000) for _ in range(args.prompt_len)]
                    run = engine_native if name == "engine" else functools.partial(fan_out, pool=pool)
                    elapsed, _ = run(http, prompt=prompt, seed=seed, max_tokens=args.max_tokens)
                    times[name].append(elapsed)
    finally:
        server.terminate()
        server.wait(30)
    caching = "off" if args.no_prefix_caching else "on"
    print(f"model {args.model}, n={N}, prompt {args.prompt_len} tokens, {args.max_tokens} tokens per sample, "
          f"prefix caching {caching}; median of {args.rounds} rounds:")
    engine_s, fan_s = statistics.median(times["engine"]), statistics.median(times["fan-out"])
    print(f"{'engine n=8':<22} {engine_s * 1e3:10.1f} ms")
    print(f"{'fan-out 8 x n=1':<22} {fan_s * 1e3:10.1f} ms")
    print(f"ratio fan-out / engine: {fan_s / engine_s:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
