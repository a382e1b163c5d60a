"""Scaling out: replicas on Ray against one engine, the router's overhead, affinity's cache hits.

    python benchmarks/scale.py                    # bench-125m, the lead's run on a quiet machine
    python benchmarks/scale.py --quick            # tiny model and load: proves the script works
    python benchmarks/scale.py --part tp          # only the tensor-parallel rows (--part replicas: the others)

Three measurements, each printed side by side with its baseline:

1. throughput at high concurrency: 2 replicas x 1 thread (Ray actors, one CPU each) against
   1 engine x 2 threads in this process; the same requests (random token ids, ignore_eos),
   output tokens per second, median of --repeats runs;
2. router overhead per request: the routing decision alone, and a 1-token request through the
   replica set against the same request to one in-process engine (the difference is the
   ingress hop: routing, the Ray call, the stream back; measured against the in-process
   engine at one thread, a replica's thread count);
3. prefix-cache hit rate on multi-turn chat (each turn's prompt = the whole conversation so
   far): prefix affinity against balanced routing (affinity off), and one engine alone. Hit
   rates count tokens, so they do not depend on timing.

4. tensor parallelism, 1 rank x T threads against 2 ranks x T/2 threads each (the same
   cores): single-stream decode tok/s (one request, decode steps only), batched throughput
   (--concurrency requests at once, output tok/s), and rank 0's communication per step:
   seconds in all-reduces (two per layer plus the embedding's), in the LM head's gather and
   in sending the step to the workers (pickle + socket write), measured around each call.
   On 2 cores expect no speed-up; the communication per step is the figure that carries over.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from typing import Any

import torch

from pagedserve.demo_models import get_model_path
from pagedserve.distributed.replica_set import ReplicaSetEngine
from pagedserve.distributed.router import ReplicaRouter, RouterConfig
from pagedserve.engine.async_engine import AsyncLLMEngine
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine_args import EngineArgs
from pagedserve.sampling_params import SamplingParams


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 1000) for _ in range(length)] for _ in range(n)]


async def _run_all(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    """All prompts at once; (seconds, output tokens)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(prompt: list[int]) -> int:
        group = await engine.add_requests([({"prompt_token_ids": prompt}, params)])
        tokens = 0
        async with group:
            async for _, output in group:
                tokens = len(output.outputs[0].token_ids)  # outputs are cumulative: keep the last
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    return time.perf_counter() - start, sum(counts)


async def throughput(engine: Any, args: argparse.Namespace) -> float:
    prompts = _prompts(args.concurrency, args.prompt_len, seed=1)
    await _run_all(engine, prompts[:2], 2)  # warm-up
    rates = []
    for _ in range(args.repeats):
        seconds, tokens = await _run_all(engine, prompts, args.output_len)
        rates.append(tokens / seconds)
    return statistics.median(rates)


async def one_token_latency_ms(engine: Any, repeats: int) -> float:
    prompt = _prompts(1, 8, seed=2)
    times = []
    for _ in range(repeats):
        seconds, _ = await _run_all(engine, prompt, 1)
        times.append(seconds * 1e3)
    return statistics.median(times)


def router_decision_us(num_replicas: int, block_size: int) -> float:
    router = ReplicaRouter(num_replicas, RouterConfig(block_size=block_size), seed=0)
    prompts = _prompts(1000, 256, seed=3)
    start = time.perf_counter()
    for prompt in prompts:
        router.route(prompt)
    return (time.perf_counter() - start) / len(prompts) * 1e6


async def chat_hit_rate(engine: Any, args: argparse.Namespace, stats: Any) -> float:
    """Prefix-cache hits / lookups over multi-turn conversations, run concurrently."""
    rng = random.Random(4)
    params = SamplingParams(temperature=0, max_tokens=args.reply_len, ignore_eos=True)
    await asyncio.sleep(1.2)  # the replica set's statistics are polled twice a second
    before = stats()

    async def conversation(c: int) -> None:
        history = _prompts(1, args.prompt_len, seed=100 + c)[0]
        for _ in range(args.turns):
            history = history + [rng.randrange(10, 1000) for _ in range(args.user_len)]
            group = await engine.add_requests([({"prompt_token_ids": history}, params)])
            reply: list[int] = []
            async with group:
                async for _, output in group:
                    reply = list(output.outputs[0].token_ids)  # cumulative: the last is the reply
            history = history + reply

    await asyncio.gather(*(conversation(c) for c in range(args.conversations)))
    await asyncio.sleep(1.2)  # the replica set's statistics are polled twice a second
    after = stats()
    queries = after.scheduler.prefix_cache_queries - before.scheduler.prefix_cache_queries
    hits = after.scheduler.prefix_cache_hits - before.scheduler.prefix_cache_hits
    return hits / queries if queries else 0.0


async def bench_single(engine_args: EngineArgs, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(2)
    engine = AsyncLLMEngine(LLMEngine(engine_args.create_engine_config()))
    engine.start()
    try:
        result = {
            "tok_s": await throughput(engine, args),
            "latency_ms": await one_token_latency_ms(engine, args.repeats * 3),
            "hit_rate": await chat_hit_rate(engine, args, lambda: engine.stats),
        }
        # A replica runs one thread: the ingress hop is measured against one engine with one thread
        # too (against two threads it would also count the forward's own slow-down).
        # (set in the engine's thread: OpenMP's thread count is per calling thread)
        await asyncio.to_thread(engine.call_in_engine_thread, lambda _: torch.set_num_threads(1))
        result["latency_1t_ms"] = await one_token_latency_ms(engine, args.repeats * 3)
        return result
    finally:
        await engine.shutdown()


async def bench_replicas(engine_args: EngineArgs, args: argparse.Namespace) -> dict[str, float]:
    import ray

    ray.init(num_cpus=args.replicas, include_dashboard=False, log_to_driver=False, namespace="pagedserve-bench")
    engine = ReplicaSetEngine(engine_args, args.replicas, num_cpus_per_replica=1, seed=0)
    engine.start()
    try:
        result = {
            "tok_s": await throughput(engine, args),
            "latency_ms": await one_token_latency_ms(engine, args.repeats * 3),
        }
        block = engine_args.block_size
        for name, affinity, policy in (("hit_rate", True, "two_choices"),
                                       ("hit_rate_balanced", False, "two_choices"),
                                       ("hit_rate_random", False, "random")):
            engine.call_on_replicas(lambda e: e.reset_prefix_cache())
            engine.configure_router(RouterConfig(block_size=block, affinity=affinity, balance_policy=policy))
            result[name] = await chat_hit_rate(engine, args, lambda: engine.stats)
        return result
    finally:
        await engine.shutdown()
        ray.shutdown()


def _decode_tok_s(engine: LLMEngine, prompt: list[int], output_len: int) -> float:
    """One request alone: output tokens per second over its decode steps (prefill excluded)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request(None, {"prompt_token_ids": prompt}, params)
    engine.step()  # the prefill (and first token)
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def _batch_tok_s(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """Every prompt at once: (output tok/s, steps)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(None, {"prompt_token_ids": prompt}, params)
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return len(prompts) * output_len / (time.perf_counter() - start), steps


def bench_tp(engine_args: EngineArgs, args: argparse.Namespace) -> dict[int, dict[str, float]]:
    results: dict[int, dict[str, float]] = {}
    single_prompt = _prompts(1, args.prompt_len, seed=3)[0]
    batch = _prompts(args.concurrency, args.prompt_len, seed=4)
    for tp in (1, 2):
        torch.set_num_threads(max(1, args.threads // tp))  # rank 0's share; each worker takes its own
        engine = LLMEngine(engine_args.replace(tensor_parallel_size=tp, enable_prefix_caching=False)
                           .create_engine_config())
        try:
            _batch_tok_s(engine, batch[:2], 2)  # warm-up
            decode = statistics.median(_decode_tok_s(engine, single_prompt, args.output_len)
                                       for _ in range(args.repeats))
            rates = []
            comm = {"all_reduce_ms": 0.0, "gather_ms": 0.0, "broadcast_ms": 0.0, "reduces_per_step": 0.0}
            for _ in range(args.repeats):
                if engine.tp_workers is not None:
                    engine.tp_workers.time_collectives()
                rate, steps = _batch_tok_s(engine, batch, args.output_len)
                rates.append(rate)
                if engine.tp_workers is not None:
                    stats = engine.tp_workers.comm_stats()
                    comm = {"all_reduce_ms": stats.all_reduce_s / steps * 1e3, "gather_ms": stats.gather_s / steps * 1e3,
                            "broadcast_ms": stats.broadcast_s / steps * 1e3,
                            "reduces_per_step": stats.num_all_reduce / steps}
            decode_comm, decode_share = 0.0, 0.0
            if engine.tp_workers is not None:
                engine.tp_workers.time_collectives()
                steps = args.output_len - 1
                timed_tok_s = _decode_tok_s(engine, single_prompt, args.output_len)
                decode_comm = engine.tp_workers.comm_stats().total_s() / steps * 1e3
                decode_share = decode_comm / (1e3 / timed_tok_s)  # of the same run's step time
                engine.tp_workers.time_collectives(False)
            results[tp] = {"decode_tok_s": decode, "batch_tok_s": statistics.median(rates),
                           "decode_comm_ms": decode_comm, "decode_comm_share": decode_share, **comm}
        finally:
            engine.shutdown()
    return results


def print_tp(results: dict[int, dict[str, float]], args: argparse.Namespace) -> None:
    one, two = results[1], results[2]
    print(f"tensor parallelism, model {args.model}: 1 rank x {args.threads} threads vs 2 ranks x "
          f"{max(1, args.threads // 2)} thread(s); median of {args.repeats}")
    print(f"{'':44}{'1 rank':>12}{'2 ranks':>12}")
    print(f"{'single-stream decode (tok/s)':44}{one['decode_tok_s']:>12.1f}{two['decode_tok_s']:>12.1f}"
          f"   ratio {two['decode_tok_s'] / one['decode_tok_s']:.2f}x")
    print(f"{'batched, ' + str(args.concurrency) + ' requests (output tok/s)':44}{one['batch_tok_s']:>12.1f}"
          f"{two['batch_tok_s']:>12.1f}   ratio {two['batch_tok_s'] / one['batch_tok_s']:.2f}x")
    print(f"rank 0's communication per decode step (1 request): {two['decode_comm_ms']:.3f} ms "
          f"= {two['decode_comm_share'] * 100:.0f}% of the step")
    print(f"per batched step: all-reduce {two['all_reduce_ms']:.3f} ms ({two['reduces_per_step']:.0f} calls), "
          f"LM-head gather {two['gather_ms']:.3f} ms, step broadcast {two['broadcast_ms']:.3f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model and load (proves the script runs)")
    parser.add_argument("--model", default="bench-125m")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--user-len", type=int, default=24)
    parser.add_argument("--reply-len", type=int, default=32)
    parser.add_argument("--part", choices=("all", "replicas", "tp"), default="all")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all (tensor-parallel rows)")
    args = parser.parse_args()
    if args.quick:
        args.model, args.concurrency, args.prompt_len, args.output_len = "llama-gqa", 8, 32, 8
        args.repeats, args.conversations, args.turns, args.user_len, args.reply_len = 1, 4, 3, 8, 8
    engine_args = EngineArgs(model=str(get_model_path(args.model)), kv_cache_memory_bytes=256 << 20)
    if args.part in ("all", "tp"):
        print_tp(bench_tp(engine_args, args), args)
    if args.part == "tp":
        return
    single = asyncio.run(bench_single(engine_args, args))
    replicas = asyncio.run(bench_replicas(engine_args, args))
    n = args.replicas
    print(f"model {args.model}; {args.concurrency} concurrent requests, prompt {args.prompt_len}, "
          f"output {args.output_len} tokens; median of {args.repeats}")
    print(f"{'':44}{'1 engine x ' + str(n) + ' threads':>22}{str(n) + ' replicas x 1 thread':>24}")
    print(f"{'throughput (output tok/s)':44}{single['tok_s']:>22.1f}{replicas['tok_s']:>24.1f}"
          f"   ratio {replicas['tok_s'] / single['tok_s']:.2f}x")
    print(f"{'1-token request latency (ms)':44}{single['latency_ms']:>22.2f}{replicas['latency_ms']:>24.2f}")
    print(f"{'  same, 1 engine x 1 thread (ms)':44}{single['latency_1t_ms']:>22.2f}"
          f"   ingress hop (replica - 1 thread) {replicas['latency_ms'] - single['latency_1t_ms']:+.2f} ms")
    print(f"{'routing decision (us per request)':44}{'':>22}{router_decision_us(n, 16):>24.1f}")
    print(f"prefix-cache hit rate, {args.conversations} chats x {args.turns} turns: one engine "
          f"{single['hit_rate']:.3f}, {n} replicas with affinity {replicas['hit_rate']:.3f} "
          f"({replicas['hit_rate'] / max(single['hit_rate'], 1e-9):.2f}x of one engine), "
          f"affinity off: least loaded of two {replicas['hit_rate_balanced']:.3f}, "
          f"random {replicas['hit_rate_random']:.3f}")


if __name__ == "__main__":
    main()
