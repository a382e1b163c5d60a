"""Cold start of `pagedserve serve` with an empty C++ extension cache (issue 15, point 6).

    python benchmarks/startup.py --baseline main                  # main vs this checkout
    python benchmarks/startup.py --baseline main --model demo --runs 1 --max-tokens 8   # quick

Per run, for each source tree: a fresh TORCH_EXTENSIONS_DIR (nothing compiled), start
`python -m pagedserve.entrypoints.cli serve MODEL` from that tree (PYTHONPATH), then time

  * health:  process start -> first `GET /health` answering 200;
  * first:   the first /v1/completions request (greedy, --max-tokens), once healthy;
  * second:  the same request again (the warm cost the first is compared with).

A kernel built on a request shows as first >> second; built during start-up, it moves into
`health`. Trees alternate run by run, so both see the same machine; medians are printed
side by side. `--baseline REV` exports that git revision (`git archive`) as the "before"
tree; `--trees A B` names source trees directly. Timings depend on the machine's load and
compiler; record them only from a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _complete(base: str, model: str, max_tokens: int) -> float:
    body = json.dumps({"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{base}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        json.loads(response.read())
    return time.perf_counter() - start


def one_run(tree: Path, model: str | None, max_tokens: int, timeout_s: float) -> dict[str, float]:
    """Start a server from `tree` with an empty extension cache; its three timings (s)."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="pagedserve-ext-") as ext_dir:
        env = {**os.environ, "PYTHONPATH": str(tree), "TORCH_EXTENSIONS_DIR": ext_dir}
        cmd = [sys.executable, "-m", "pagedserve.entrypoints.cli", "serve",
               *([model] if model else []), "--port", str(port), "--served-model-name", "m"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=tempfile.gettempdir(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            while not _healthy(base):
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
                if time.perf_counter() - start > timeout_s:
                    raise TimeoutError(f"not healthy after {timeout_s} s")
                time.sleep(0.1)
            health = time.perf_counter() - start
            first = _complete(base, "m", max_tokens)
            second = _complete(base, "m", max_tokens)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return {"health": health, "first": first, "second": second}


def export_revision(rev: str, into: Path) -> Path:
    """`git archive REV` of this repository unpacked under `into`; the tree's path."""
    tree = into / f"rev-{rev.replace('/', '_')}"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="git revision to compare with (exported with git archive)")
    parser.add_argument("--trees", nargs="+", type=Path, help="source trees to compare (default: this checkout)")
    parser.add_argument("--model", default=None, help="MODEL argument of `pagedserve serve` (default: SmolLM2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for /health")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="pagedserve-startup-") as tmp:
        trees = list(args.trees or [])
        if args.baseline:
            trees.insert(0, export_revision(args.baseline, Path(tmp)))
        if not args.trees:
            trees.append(ROOT)
        results: dict[Path, list[dict[str, float]]] = {tree: [] for tree in trees}
        for run in range(args.runs):
            for tree in trees:  # alternating: both trees see the same machine
                timings = one_run(tree, args.model, args.max_tokens, args.timeout)
                results[tree].append(timings)
                print(f"run {run + 1} {tree.name}: " + "  ".join(f"{k} {v:.2f} s" for k, v in timings.items()),
                      flush=True)
        print(f"\nmedians over {args.runs} run(s), empty extension cache each time (seconds):")
        print(f"{'tree':<28}{'to /health 200':>16}{'first request':>16}{'second request':>16}")
        for tree, runs in results.items():
            med = {k: statistics.median(r[k] for r in runs) for k in ("health", "first", "second")}
            print(f"{tree.name:<28}{med['health']:>16.2f}{med['first']:>16.2f}{med['second']:>16.2f}")


if __name__ == "__main__":
    main()
