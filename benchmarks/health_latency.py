"""/health latency while huge prompts are refused (issue #13.4): the event loop stays free.

    python benchmarks/health_latency.py [--chars 10000000] [--rounds 5] [--model demo]

Starts `pagedserve serve` on 127.0.0.1 and polls /health every 5 ms from one thread,
side by side in the same run:
    idle     nothing else happens
    refusing another thread sends --chars-long prompts (completions, chat, /tokenize), each
             refused with a 400 by its character count, without tokenizing it
and prints the median of the rounds of each phase's p50 / p99 / max /health latency, and
how long each refusal took. The issue's bar: max /health latency under 50 ms while
refusing a 10M-character prompt (the JSON body is still parsed on the event loop; that
parse is most of what remains).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll_health(base: str, stop: threading.Event, out: list[float]) -> None:
    with httpx.Client(base_url=base, timeout=30) as http:
        while not stop.is_set():
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            out.append(time.perf_counter() - start)
            time.sleep(0.005)


def phase(base: str, seconds: float, bodies: list[tuple[str, bytes]] | None) -> tuple[list[float], list[float]]:
    """(health latencies, refusal times) over one phase."""
    latencies: list[float] = []
    refusals: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(base, stop, latencies))
    poller.start()
    try:
        if bodies is None:
            time.sleep(seconds)
        else:
            with httpx.Client(base_url=base, timeout=120) as http:
                for path, body in bodies:
                    start = time.perf_counter()
                    resp = http.post(path, content=body, headers={"content-type": "application/json"})
                    refusals.append(time.perf_counter() - start)
                    assert resp.status_code == 400, resp.text[:300]
    finally:
        stop.set()
        poller.join()
    return latencies, refusals


def summary(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], ordered[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--chars", type=int, default=10_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    server = subprocess.Popen([sys.executable, "-m", "pagedserve", "serve", args.model, "--port", str(port),
                               "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "server exited"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        text = ("hello world " * (args.chars // 12 + 1))[: args.chars]
        bodies = [
            ("/v1/completions", json.dumps({"prompt": text, "max_tokens": 4}).encode()),
            ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": text}]}).encode()),
            ("/tokenize", json.dumps({"prompt": text}).encode()),
        ]
        rows = {"idle": [], "refusing": []}
        refusal_times: list[float] = []
        for _ in range(args.rounds):
            rows["idle"].append(summary(phase(base, 1.0, None)[0]))
            latencies, refusals = phase(base, 0.0, bodies)
            rows["refusing"].append(summary(latencies))
            refusal_times += refusals
    finally:
        server.terminate()
        server.wait(30)
    print(f"/health latency, median of {args.rounds} rounds (ms), prompts of {args.chars} characters:")
    print(f"{'phase':<10} {'p50':>8} {'p99':>8} {'max':>8}")
    for name, values in rows.items():
        p50, p99, worst = (statistics.median(v[i] for v in values) * 1e3 for i in range(3))
        print(f"{name:<10} {p50:8.2f} {p99:8.2f} {worst:8.2f}")
    print(f"refusal (400) time: median {statistics.median(refusal_times) * 1e3:.1f} ms, "
          f"max {max(refusal_times) * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
