"""Online serving benchmark: a load generator for any OpenAI-compatible /v1/completions endpoint.

    python -m pagedserve.bench.loadgen --base-url http://127.0.0.1:8000 --num-prompts 200 --request-rate 4
    python benchmarks/serve.py --sweep-rates 1,2,4,8 --result-json sweep.json     # the same script

Requests arrive as a Poisson process at --request-rate (a gamma process with --burstiness
!= 1; rate inf = all at once), optionally capped at --max-concurrency in flight. Prompts
come from a ShareGPT-format JSON (--dataset) or are synthetic: lognormal, ShareGPT-like
lengths (prompt mean ~160, output mean ~340 tokens), sent as token ids so lengths are
exact, with ignore_eos and max_tokens = the output length. Each request streams; the
arrival time of each chunk gives TTFT, ITL, TPOT = (E2E - TTFT) / (output tokens - 1), E2E.

The helpers (synthetic_requests, load_sharegpt, run_benchmark, summarize, format_table)
are importable; `pagedserve bench serve --base-url` (bench/http.py) wraps them. httpx comes with
the `[bench]` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

try:
    import httpx
except ImportError as exc:  # the [bench] extra
    raise ImportError("the HTTP load generator needs httpx: pip install 'pagedserve[bench]'") from exc

MAX_NUM_PROMPTS = 100_000
# Synthetic ids come from this range: valid for any vocabulary of >= 1000 tokens and clear
# of the low ids where tokenizers keep their special tokens.
SYNTHETIC_TOKEN_RANGE = (10, 1000)


@dataclass(slots=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_len: int
    output_len: int = 0  # tokens generated (from the usage chunk when the server sends one)
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_len - 1) if self.output_len > 1 else None


# ---- workloads ---------------------------------------------------------------------------------


def _lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float, lo: int, hi: int) -> list[int]:
    # A lognormal with E[X] = mean has mu = ln(mean) - sigma^2 / 2; long right tail, capped.
    mu = math.log(mean) - sigma * sigma / 2
    return [min(hi, max(lo, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def synthetic_requests(
    num: int, seed: int = 0, prompt_mean: float = 160, output_mean: float = 340,
    max_prompt_len: int = 1024, max_output_len: int = 1024,
) -> list[BenchRequest]:
    """ShareGPT-like synthetic requests: token-id prompts of exact, long-tailed lengths."""
    rng = random.Random(seed)
    prompt_lens = _lognormal_lengths(rng, num, prompt_mean, 0.9, 4, max_prompt_len)
    output_lens = _lognormal_lengths(rng, num, output_mean, 0.9, 2, max_output_len)
    low, high = SYNTHETIC_TOKEN_RANGE
    return [
        BenchRequest([rng.randrange(low, high) for _ in range(p)], p, o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def load_sharegpt(path: str, num: int, tokenizer: Any, seed: int = 0, max_len: int = 2048) -> list[BenchRequest]:
    """ShareGPT JSON: the first human turn is the prompt, the reply's length is the output length."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rng = random.Random(seed)
    rng.shuffle(data)
    requests: list[BenchRequest] = []
    for item in data:
        turns = item.get("conversations") or item.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, reply = turns[0]["value"], turns[1]["value"]
        prompt_len = len(tokenizer.encode(prompt))
        output_len = len(tokenizer.encode(reply, add_special_tokens=False))
        # vLLM's filter: drop degenerate and over-long pairs.
        if prompt_len < 4 or output_len < 4 or prompt_len + output_len > max_len:
            continue
        requests.append(BenchRequest(prompt, prompt_len, output_len))
        if len(requests) == num:
            break
    if not requests:
        raise ValueError(f"{path}: no usable ShareGPT conversations")
    return requests


def arrival_delays(num: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Gaps between arrivals: gamma(shape=burstiness, mean=1/rate); burstiness 1 = Poisson."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(num)]


# ---- running -----------------------------------------------------------------------------------


async def send_request(
    http: httpx.AsyncClient, url: str, model: str, req: BenchRequest, headers: dict[str, str]
) -> RequestResult:
    """One streamed completion; chunk arrival times give TTFT and ITL."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(ok=False, prompt_len=req.prompt_len)
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with http.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    result.error = data["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if data.get("choices"):
                    if chunks == 0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    chunks, last = chunks + 1, now
                if data.get("usage"):
                    result.output_len = data["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = last - start
    result.output_len = result.output_len or chunks  # servers without include_usage: one chunk ~ one token
    result.ok = chunks > 0
    return result


# A request that receives nothing for this long fails (ReadTimeout) instead of holding the run
# (a server blocked on its full stderr pipe once held a study with its streams open: peer.py).
# Longer than any prefill here (an 8k-token prompt on the 1.5B model: ~130 s to its first token).
READ_TIMEOUT_S = 900.0


async def run_benchmark(
    base_url: str, model: str, requests: list[BenchRequest], request_rate: float = math.inf,
    burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0, api_key: str | None = None,
) -> tuple[list[RequestResult], float]:
    """Sends every request on schedule; returns the results (in request order) and the duration."""
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

    async with httpx.AsyncClient(timeout=httpx.Timeout(6 * 3600.0, read=READ_TIMEOUT_S), limits=limits) as http:
        async def one(req: BenchRequest) -> RequestResult:
            if limit is None:
                return await send_request(http, url, model, req, headers)
            async with limit:
                return await send_request(http, url, model, req, headers)

        start = time.perf_counter()
        tasks = []
        for req, delay in zip(requests, arrival_delays(len(requests), request_rate, burstiness, seed), strict=True):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


async def default_model(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.get(base_url.rstrip("/") + "/v1/models", headers=headers)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


# ---- reporting ---------------------------------------------------------------------------------


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy.percentile
        k = (len(ordered) - 1) * p / 100
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": 1000 * sum(ordered) / len(ordered), "median": 1000 * pct(50),
            "p90": 1000 * pct(90), "p99": 1000 * pct(99)}


def summarize(
    results: list[RequestResult], duration_s: float,
    slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    """Latency percentiles (ms), throughput, and goodput (requests/s meeting every SLO given)."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_len for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)

    def meets_slo(r: RequestResult) -> bool:
        ttft_ok = slo_ttft_ms is None or r.ttft_s * 1000 <= slo_ttft_ms
        tpot_ok = slo_tpot_ms is None or (r.tpot_s or 0.0) * 1000 <= slo_tpot_ms
        return ttft_ok and tpot_ok

    good = [r for r in ok if meets_slo(r)]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s if duration_s else 0.0,
        "output_throughput": output_tokens / duration_s if duration_s else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s if duration_s else 0.0,
        "goodput": len(good) / duration_s if duration_s and (slo_ttft_ms or slo_tpot_ms) else None,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": _stats_ms([r.e2e_s for r in ok]),
    }


def format_table(summary: dict[str, Any], title: str = "Serving benchmark") -> str:
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}"),
    ]
    if summary.get("goodput") is not None:
        rows.append(("Goodput (req/s)", f"{summary['goodput']:.2f}"))
    for key, name in [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")]:
        stats = summary[key]
        rows += [(f"{name} {stat} (ms)", f"{stats[stat]:.2f}") for stat in ("mean", "median", "p90", "p99")]
    width = max(len(name) for name, _ in rows) + 4
    lines = [f"{' ' + title + ' ':=^{width + 12}}"]
    lines += [f"{name:<{width}}{value:>12}" for name, value in rows]
    lines.append("=" * (width + 12))
    return "\n".join(lines)


# ---- command line ------------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    parser.add_argument("--model", default=None, help="model name (default: the server's first model)")
    parser.add_argument("--api-key", default=None, help="Bearer key, if the server wants one")
    parser.add_argument("--num-prompts", type=int, default=200, help=f"requests to send (<= {MAX_NUM_PROMPTS})")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    parser.add_argument("--sweep-rates", default=None, help="comma-separated rates, one run each (e.g. 1,2,4,8)")
    parser.add_argument("--dataset", default=None, help="ShareGPT-format JSON (default: synthetic lengths)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for --dataset lengths (default: demo model's)")
    parser.add_argument("--prompt-mean", type=float, default=160, help="synthetic prompt length mean")
    parser.add_argument("--output-mean", type=float, default=340, help="synthetic output length mean")
    parser.add_argument("--max-prompt-len", type=int, default=1024, help="synthetic prompt length cap")
    parser.add_argument("--max-output-len", type=int, default=1024, help="synthetic output length cap")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and the arrivals")
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT limit")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT limit")
    parser.add_argument("--result-json", default=None, help="write the results here")
    return parser


def make_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if not 0 < args.num_prompts <= MAX_NUM_PROMPTS:
        raise SystemExit(f"--num-prompts must be in [1, {MAX_NUM_PROMPTS}]")
    if args.dataset is None:
        return synthetic_requests(args.num_prompts, args.seed, args.prompt_mean, args.output_mean,
                                  args.max_prompt_len, args.max_output_len)
    from transformers import AutoTokenizer

    tokenizer_path = args.tokenizer
    if tokenizer_path is None:
        from pagedserve.demo_models import DEMO_MODEL, get_model_path

        tokenizer_path = str(get_model_path(DEMO_MODEL))
    return load_sharegpt(args.dataset, args.num_prompts, AutoTokenizer.from_pretrained(tokenizer_path), args.seed)


async def run_from_args(args: argparse.Namespace) -> dict[str, Any]:
    requests = make_requests(args)
    model = args.model or await default_model(args.base_url, args.api_key)
    rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else [args.request_rate]
    runs = []
    for rate in rates:
        results, duration = await run_benchmark(args.base_url, model, requests, rate, args.burstiness,
                                                args.max_concurrency, args.seed, args.api_key)
        summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        summary.update(request_rate=rate, burstiness=args.burstiness, max_concurrency=args.max_concurrency)
        print(format_table(summary, f"rate {rate} req/s"), flush=True)
        runs.append({"summary": summary, "requests": [asdict(r) for r in results]})
    config = {k: v for k, v in vars(args).items() if k != "api_key"}
    return {"model": model, "config": config, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = asyncio.run(run_from_args(args))
    if args.result_json:
        with open(args.result_json, "w", encoding="utf-8") as f:
            f.write(_to_json(report))
    return 0 if all(run["summary"]["failed"] == 0 for run in report["runs"]) else 1


def _to_json(obj: Any) -> str:
    # JSON has no inf (the default --request-rate): record non-finite floats as strings.
    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(obj), indent=2)


if __name__ == "__main__":
    sys.exit(main())
