"""Soak test (not a test in the suite): steady mixed traffic against a real server process.

    python scripts/soak.py                      # 3 minutes, the demo model, 4 requests/s
    python scripts/soak.py --duration 20 --rate 3 --model llama-gqa    # a quick check
    python scripts/soak.py -- --swap-space 0        # flags after -- go to `pagedserve serve`

Starts `pagedserve serve` as a child process on 127.0.0.1, then for --duration seconds
starts requests at a steady --rate (each on its own, not waiting for the previous):
    40%  non-streamed completions
    30%  streamed chat completions, read to the end
    30%  streamed completions the client cancels after its first chunks (a disconnect)
and reports sent / ok / failed / cancelled, the latency percentiles of the completed
requests, the server's resident memory (RSS) at the start, after the first minute and at
the end, and the KV-cache usage once the traffic is over and the server idle (0 unless a
block leaked; blocks kept only by the prefix cache count as free).

RSS growth over the last two minutes is the figure to watch: ~0 means nothing accumulates
per request. Exit status 1 if any request failed or the KV usage at the end is not 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

WORDS = "the quick brown fox jumps over a lazy dog while paged attention stores keys and values".split()


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    failed: int = 0
    cancelled: int = 0
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.errors) < 10:
            self.errors.append(why)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"{re.escape(name)}(\{{.*\}})? ", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))


async def one_request(http: httpx.AsyncClient, model: str, rng: random.Random, tally: Tally) -> None:
    kind = rng.choices(["plain", "chat_stream", "cancel"], weights=[4, 3, 3])[0]
    max_tokens = rng.randint(8, 48)
    start = time.monotonic()
    tally.sent += 1
    try:
        if kind == "plain":
            resp = await http.post("/v1/completions", json={
                "model": model, "prompt": prompt(rng), "max_tokens": max_tokens, "temperature": 0.8})
            if resp.status_code != 200:
                return tally.fail(f"{resp.status_code} {resp.text[:200]}")
        else:
            path, body = ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt(rng)}]}) \
                if kind == "chat_stream" else ("/v1/completions", {"prompt": prompt(rng)})
            body = {**body, "model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
            chunks = 0
            async with http.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    return tally.fail(f"{resp.status_code} {(await resp.aread())[:200]!r}")
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        return tally.fail(line[:200])
                    chunks += line.startswith("data: ")
                    if kind == "cancel" and chunks >= 3:
                        tally.cancelled += 1
                        return None  # leaving the block closes the connection: a disconnect
            if chunks == 0:
                return tally.fail("empty stream")
        tally.ok += 1
        tally.latencies.append(time.monotonic() - start)
    except httpx.HTTPError as exc:
        tally.fail(repr(exc))
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedserve", "serve", args.model, "--port", str(port),
               "--log-level", "warning", "--kv-cache-memory", args.kv_cache_memory, *args.server_args]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


async def soak(args: argparse.Namespace, base: str, pid: int) -> tuple[Tally, dict[str, float]]:
    rng = random.Random(args.seed)
    tally = Tally()
    rss: dict[str, float] = {"start": rss_bytes(pid)}
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:
        tasks: set[asyncio.Task] = set()
        start = time.monotonic()
        next_at = start
        while (now := time.monotonic()) - start < args.duration:
            if "minute_1" not in rss and now - start >= min(60.0, args.duration / 3):
                rss["minute_1"] = rss_bytes(pid)
            if now >= next_at:
                task = asyncio.ensure_future(one_request(http, args.served_name, rng, tally))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_at += 1.0 / args.rate
            await asyncio.sleep(min(0.01, max(0.0, next_at - time.monotonic())))
        await asyncio.gather(*tasks)
        # Idle: the KV usage must be back to zero (a disconnect frees its blocks within a step).
        deadline = time.monotonic() + 10
        while True:
            text = (await http.get("/metrics")).text
            kv, running = metric(text, "vllm:kv_cache_usage_perc"), metric(text, "vllm:num_requests_running")
            if (kv == 0 and running == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
    rss["end"] = rss_bytes(pid)
    rss["kv_usage_end"] = kv
    rss["running_end"] = running
    rss["preemptions"] = metric(text, "vllm:num_preemptions_total")
    return tally, rss


def report(args: argparse.Namespace, tally: Tally, rss: dict[str, float]) -> None:
    lat = sorted(tally.latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")

    mib = 2**20
    first = "minute_1" if args.duration >= 90 else "minute_1 (1/3 of the run)"
    print(f"soak: {args.duration:.0f} s at {args.rate}/s, model {args.model}")
    print(f"  requests   sent {tally.sent}  ok {tally.ok}  failed {tally.failed}  cancelled {tally.cancelled}")
    if lat:
        print(f"  latency    p50 {pct(0.5):.3f} s  p99 {pct(0.99):.3f} s  mean {statistics.mean(lat):.3f} s "
              "(completed requests)")
    print(f"  RSS        start {rss['start'] / mib:.1f} MiB  {first} {rss['minute_1'] / mib:.1f} MiB  "
          f"end {rss['end'] / mib:.1f} MiB  growth after {first.split()[0]} {(rss['end'] - rss['minute_1']) / mib:+.1f} MiB")
    print(f"  KV usage at the end {rss['kv_usage_end']:.4f}  running {rss['running_end']:.0f}  "
          f"preemptions {rss['preemptions']:.0f}")
    for error in tally.errors:
        print("  error:", error)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo", help="model folder or demo model name")
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of traffic")
    parser.add_argument("--rate", type=float, default=4.0, help="requests started per second")
    parser.add_argument("--kv-cache-memory", default="64MiB")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("server_args", nargs="*", help="more `pagedserve serve` flags (after --)")
    args = parser.parse_args()
    args.served_name = Path(args.model).name if os.path.isdir(args.model) else args.model
    port = free_port()
    server = start_server(args, port)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                print(server.stderr.read() if server.stderr else "", file=sys.stderr)
                raise SystemExit("soak: the server exited during start-up")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("soak: the server did not become healthy")
            time.sleep(0.2)
        args.served_name = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        tally, rss = asyncio.run(soak(args, base, server.pid))
        healthy = httpx.get(base + "/health").status_code == 200
    finally:
        server.terminate()
        server.wait(30)
    report(args, tally, rss)
    print(f"  /health after the run: {'200' if healthy else 'NOT 200'}")
    return 0 if tally.failed == 0 and rss["kv_usage_end"] == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
