"""Seeded synthetic workloads whose length distributions match public traces.

ShareGPT (as used in the vLLM paper): prompt mean ~161, output mean ~338 tokens, long-tailed.
Alpaca: prompt mean ~19, output mean ~58. Lengths are drawn from log-normals whose
location is calibrated so that the mean *after* capping hits the target.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int


# The request that warms an engine or a server up before a timed run: a prompt no measured
# request starts with, so no prefix cache serves a measured prefill from it.
WARM_UP = WorkloadRequest([11, 12, 13, 14], 4)


@dataclass(frozen=True, slots=True)
class LengthDist:
    mean: float
    sigma: float
    low: int
    cap: int


SHAREGPT = (LengthDist(161, 1.0, 4, 1024), LengthDist(338, 0.9, 4, 1024))
ALPACA = (LengthDist(19, 0.6, 4, 256), LengthDist(58, 0.8, 4, 512))
WORKLOADS = {"sharegpt": SHAREGPT, "alpaca": ALPACA}


def _capped_mean(mu: float, dist: LengthDist, samples: list[float]) -> float:
    return sum(min(max(math.exp(mu + dist.sigma * z), dist.low), dist.cap) for z in samples) / len(samples)


def _calibrated_mu(dist: LengthDist) -> float:
    # Bisection on mu over a fixed set of normal draws: deterministic and cheap.
    rng = random.Random(1234)
    samples = [rng.gauss(0.0, 1.0) for _ in range(4000)]
    lo, hi = 0.0, math.log(dist.cap) + 3 * dist.sigma
    for _ in range(40):
        mid = (lo + hi) / 2
        if _capped_mean(mid, dist, samples) < dist.mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def sample_lengths(dist: LengthDist, n: int, rng: random.Random) -> list[int]:
    mu = _calibrated_mu(dist)
    return [int(min(max(round(math.exp(rng.gauss(mu, dist.sigma))), dist.low), dist.cap)) for _ in range(n)]


def synthetic(
    name: str, num_requests: int, vocab_size: int, seed: int = 0, max_total_len: int | None = None
) -> list[WorkloadRequest]:
    """`num_requests` requests with random prompt token ids and ShareGPT/Alpaca-like lengths."""
    prompt_dist, output_dist = WORKLOADS[name]
    rng = random.Random(seed)
    prompt_lens = sample_lengths(prompt_dist, num_requests, rng)
    output_lens = sample_lengths(output_dist, num_requests, rng)
    requests = []
    for p, o in zip(prompt_lens, output_lens, strict=True):
        if max_total_len is not None and p + o > max_total_len:
            o = max(1, max_total_len - p)
        ids = [rng.randrange(8, vocab_size) for _ in range(p)]
        requests.append(WorkloadRequest(ids, o))
    return requests


def fixed(num_requests: int, prompt_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    return [
        WorkloadRequest([rng.randrange(8, vocab_size) for _ in range(prompt_len)], output_len)
        for _ in range(num_requests)
    ]


def from_sharegpt_json(path: str | Path, tokenizer, num_requests: int, seed: int = 0, cap: int = 1024) -> list[WorkloadRequest]:
    """Requests from a ShareGPT-format file: first human turn = prompt, next turn's length = output length."""
    data = json.loads(Path(path).read_text())
    rng = random.Random(seed)
    rng.shuffle(data)
    requests = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt_ids = tokenizer.encode(turns[0]["value"])[:cap]
        output_len = min(len(tokenizer.encode(turns[1]["value"])), cap)
        if len(prompt_ids) < 4 or output_len < 4:
            continue
        requests.append(WorkloadRequest(prompt_ids, output_len))
        if len(requests) == num_requests:
            break
    return requests


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (s) of a gamma process: shape `burstiness`, mean gap 1/rate.

    burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular; rate inf = all at 0.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(t)
    return times


def fit_to_context(requests: list[WorkloadRequest], max_model_len: int) -> list[WorkloadRequest]:
    """Trims prompts (keeping their start) and outputs so that prompt + output <= max_model_len."""
    fitted = []
    for r in requests:
        prompt = r.prompt_token_ids[: max_model_len - 2]
        fitted.append(WorkloadRequest(prompt, max(1, min(r.output_len, max_model_len - len(prompt)))))
    return fitted


def synthetic_means(workload: str) -> tuple[float, float]:
    """(prompt mean, output mean) of a synthetic workload, for the HTTP load generator."""
    prompt, output = WORKLOADS[workload]
    return prompt.mean, output.mean
