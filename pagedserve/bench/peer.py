"""The study's peer cells: pagedserve's server and a peer server (llama.cpp's `llama-server`)
on the same requests at the same Poisson rates, through the same HTTP client
(`bench/loadgen.py`), on the wall clock.

    --peer-server-cmd "llama-server -m {model} --host 127.0.0.1 --port {port} -c 4096"

`{model}` is the model's file (a catalog model's GGUF: the same file pagedserve serves) and
`{port}` a free port. The peer is a benchmark peer built in a scratch folder, never a project
dependency. pagedserve's side runs `pagedserve serve` the same way, so both columns pay for
HTTP, streaming and detokenization; the in-process latency cells (simulated clock) do not.
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any

from pagedserve.bench.workloads import WARM_UP

PAGEDSERVE_SERVER_CMD = f"{shlex.quote(sys.executable)} -m pagedserve.entrypoints.cli serve {{model}} " \
                        "--host 127.0.0.1 --port {port}"
START_TIMEOUT_S = 900.0  # a 1.5B model's first start builds the C++ kernels and loads ~1 GB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class Server:
    """One server process from a command template; `base_url` once it answers /health."""

    def __init__(self, command: str, model_path: str) -> None:
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        argv = shlex.split(command.format(model=shlex.quote(model_path), port=port))
        # Its log goes to a file, not a pipe: nobody reads a pipe while the server runs, and a
        # server that filled one (64 KiB: llama-server logs every request) blocked in its next
        # write with every open stream waiting on it.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self.log, text=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not healthy(self.base_url):
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode} before /health: "
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server not healthy after {START_TIMEOUT_S:.0f} s: {command}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 800) -> str:
        """The end of what the server wrote to stderr so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-chars:]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def serve_trace(base_url: str, requests: list[Any], rate: float, seed: int) -> dict[str, Any]:
    """`requests` (WorkloadRequest: token ids and output lengths) streamed to the server at
    Poisson `rate`, after one warm-up request; loadgen's summary (TTFT / TPOT / E2E in ms).

    loadgen draws the gaps from the same seeded generator as `workloads.arrival_times`, so the
    arrivals are those of the in-process latency cell at this rate.
    """
    import asyncio

    from pagedserve.bench import loadgen  # httpx: the [bench] extra

    def bench(rs: list[Any]) -> list[Any]:
        return [loadgen.BenchRequest(list(r.prompt_token_ids), len(r.prompt_token_ids), r.output_len) for r in rs]

    model = asyncio.run(loadgen.default_model(base_url))
    # Not the trace's first request: both servers keep a prefix cache, and it would serve that
    # request's measured prefill.
    asyncio.run(loadgen.run_benchmark(base_url, model, bench([WARM_UP]), seed=seed))
    results, duration = asyncio.run(loadgen.run_benchmark(base_url, model, bench(requests), rate, seed=seed))
    summary = loadgen.summarize(results, duration)
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} requests failed: {'; '.join(summary['errors'])}")
    return summary
