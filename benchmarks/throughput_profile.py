"""Where offline throughput goes against its roofline (issue 18), step kind by step kind.

    python benchmarks/throughput_profile.py                 # throughput.py's workload, one run
    python benchmarks/throughput_profile.py --quick         # smoke run (tiny model, few requests)
    python benchmarks/throughput_profile.py --profile-every 0   # timers only (no profiler)
    python benchmarks/throughput_profile.py --schedule-only --gflops 169.5 --gbs 24.7
                    # the run's roofline by step kind, from its schedule alone (seconds, any load)

The workload and engine settings are `benchmarks/throughput.py`'s, the machine probe
`pagedserve.bench.roofline`'s. The engine is stepped here (`LLMEngine.step()`), and per step:
  * the engine's own timers (`add_step_hook`): the forward (model + LM head) and everything
    outside it (schedule, inputs, sampling, update, outputs: "engine");
  * the step's roofline (`pagedserve.bench.roofline.step_cost`): issue 18's max(FLOPs / peak, bytes /
    bandwidth), and the phased bound (linears and attention each at their own bound);
  * on every --profile-every-th step, torch.profiler: the forward's top-level ops as GEMM
    (oneDNN / GEMV / F.linear, LM head included), attention (the paged kernel and its cache
    write), other ops, and the forward's time outside any op (Python). The forward is marked
    through the runner's forward hook (`ModelRunner.set_forward_hook`), nothing is patched.
Steps are grouped by kind (decode-only; mixed: some prompt tokens; prefill-heavy: prompt
tokens >= half the step) and by running sequences. The profiled steps give each group's
shares of forward time, applied to the group's timed forward.

First the GEMM rate at the workload's shapes: the engine's own linear path (oneDNN
prepacked, the GEMV kernel up to 32 rows) for one layer's projections + the LM head at M
rows, in GFLOP/s, beside the 2048^3 probe the roofline uses as peak. "attainable" = each
step's linears at that rate for its rows + its attention at the attention bound: what this
machine's GEMM allows (`--gemm-rows` with no value skips it).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from pagedserve import LLM, SamplingParams
from pagedserve.bench.profiling import top_level
from pagedserve.bench.roofline import ModelCost, StepCost, measure_machine, step_cost
from pagedserve.engine.step_timings import StepTimings

GEMM_OPS = ("linear", "gemv", "addmm", "aten::mm", "mkldnn")
ATTENTION_OPS = ("paged_attention", "reshape_and_cache", "scaled_dot_product")
SEQ_BUCKETS = (1, 8, 32, 64, 128, 256)
PARTS = ("gemm", "attention", "other_ops", "python")


def seq_bucket(n: int) -> str:
    low = 1
    for high in SEQ_BUCKETS:
        if n <= high:
            return f"{low}-{high}" if high > low else str(low)
        low = high + 1
    return f">{SEQ_BUCKETS[-1]}"


def step_kind(new_tokens: list[int]) -> str:
    prompt = sum(n for n in new_tokens if n > 1)
    if prompt == 0:
        return "decode"
    return "prefill-heavy" if 2 * prompt >= sum(new_tokens) else "mixed"


@dataclass
class Group:
    steps: int = 0
    tokens: int = 0
    total_s: float = 0.0
    forward_s: float = 0.0
    engine_s: float = 0.0
    roofline_s: float = 0.0
    phased_s: float = 0.0
    linear_bound_s: float = 0.0
    attn_bound_s: float = 0.0
    attainable_s: float = 0.0  # the GEMMs at their measured rate for the step's rows + attention's bound
    # From the profiled steps only: seconds per part, and their forward's seconds.
    profiled: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    profiled_forward_s: float = 0.0

    def add(self, t: StepTimings, c: StepCost, rates: GemmRates | None) -> None:
        self.steps += 1
        self.tokens += t.num_tokens
        self.total_s += t.total_s
        self.forward_s += t.forward_s
        self.engine_s += t.overhead_s
        self.attainable_s += rates.seconds(c, t.num_tokens) if rates is not None else float("nan")
        self.roofline_s += c.roofline_s
        self.phased_s += c.phased_s
        self.linear_bound_s += c.linear_s
        self.attn_bound_s += c.attn_s

    def part_s(self, part: str) -> float:
        """The group's timed forward split by the profiled steps' shares."""
        if self.profiled_forward_s <= 0:
            return float("nan")
        return self.forward_s * self.profiled[part] / self.profiled_forward_s


@dataclass(frozen=True)
class GemmRates:
    """GFLOP/s the engine's linears reach at M rows (`gemm_ceiling`), interpolated."""

    rows: list[int]
    gflops: list[float]

    def rate(self, m: int) -> float:
        if m <= self.rows[0]:
            return self.gflops[0]
        for (m0, r0), (m1, r1) in zip(zip(self.rows, self.gflops), zip(self.rows[1:], self.gflops[1:])):  # noqa: B905
            if m <= m1:
                return r0 + (r1 - r0) * (m - m0) / (m1 - m0)
        return self.gflops[-1]

    def seconds(self, c: StepCost, tokens: int) -> float:
        """A step's attainable time: its linears at the rate of its rows, attention at its bound."""
        return c.linear_flops / (self.rate(tokens) * 1e9) + c.attn_s


def classify(name: str) -> str:
    if any(k in name for k in ATTENTION_OPS):
        return "attention"
    if any(k in name for k in GEMM_OPS):
        return "gemm"
    return "other_ops"


def step_parts(events: list, head_s: float) -> tuple[dict[str, float], float] | None:
    """(seconds per part, forward seconds) of one profiled step, or None if unmarked.
    The LM head runs after the marked forward (in the sampling step): its GEMM is added."""
    marks = [e for e in events if e.name == "pagedserve.forward"]
    if not marks:
        return None
    start, end = marks[0].time_range.start, marks[0].time_range.end
    parts = dict.fromkeys(PARTS, 0.0)
    inside = [e for e in events if start <= e.time_range.start and e.time_range.end <= end and e is not marks[0]]
    for e in top_level(inside):
        parts[classify(e.name)] += e.time_range.elapsed_us() / 1e6
    forward = (end - start) / 1e6
    parts["python"] = max(0.0, forward - sum(parts.values()))
    parts["gemm"] += head_s
    return parts, forward + head_s


def head_seconds(events: list) -> float:
    """The LM head's GEMM: the linear ops after the marked forward."""
    marks = [e for e in events if e.name == "pagedserve.forward"]
    if not marks:
        return 0.0
    end = marks[0].time_range.end
    return sum(e.time_range.elapsed_us() for e in top_level([e for e in events if e.time_range.start >= end])
               if classify(e.name) == "gemm") / 1e6


def run(args: argparse.Namespace, model: str, workload: list[dict], machine: dict,
        rates: GemmRates | None) -> tuple[dict, float, int]:
    llm = LLM(model, kv_cache_memory_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, max_model_len=2048)
    llm.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=4), use_tqdm=False)
    engine = llm.llm_engine
    cost = ModelCost.of(model)
    timings: list[StepTimings] = []
    engine.add_step_hook(timings.append)

    def marked_forward(sched, forward):  # the runner's forward hook: the same forward, marked
        with record_function("pagedserve.forward"):
            return forward(engine.runner.lora_segments(sched))

    engine.runner.set_forward_hook(marked_forward)
    for i, r in enumerate(workload):
        engine.add_request(str(i), {"prompt_token_ids": r["prompt"]},
                           SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True))
    groups: dict[tuple[str, str], Group] = defaultdict(Group)
    pending: list[tuple[str, str]] = []  # the group of the step being profiled

    def on_trace(prof) -> None:
        events = list(prof.events())
        found = step_parts(events, head_seconds(events))
        if found is not None and pending:
            parts, forward = found
            g = groups[pending[-1]]
            for k, v in parts.items():
                g.profiled[k] += v
            g.profiled_forward_s += forward

    every = args.profile_every
    prof = None
    if every > 0:
        prof = profile(activities=[ProfilerActivity.CPU],
                       schedule=schedule(wait=every - 1, warmup=0, active=1, repeat=0), on_trace_ready=on_trace)
        prof.start()
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        n_before = len(timings)
        engine.step()
        if len(timings) > n_before:
            sched = engine.last_scheduler_output
            key = (step_kind([item.num_new_tokens for item in sched.scheduled]), seq_bucket(len(sched.scheduled)))
            t = timings[-1]
            work = [t.num_tokens, t.num_seqs, t.context_tokens, t.attended_keys, t.logits_rows]
            groups[key].add(t, step_cost(cost, work, machine), rates)
            pending.append(key)
            steps += 1
        if prof is not None:
            prof.step()  # ends the step: on_trace reads it if it was the active one
    elapsed = time.perf_counter() - start
    if prof is not None:
        prof.stop()
    engine.runner.set_forward_hook(None)
    engine.remove_step_hook(timings.append)
    return groups, elapsed, steps


def schedule_only(args: argparse.Namespace, model: str, workload: list[dict], machine: dict,
                  rates: GemmRates | None) -> dict:
    """The workload's schedule, stepped on a tiny stand-in model (the demo `llama-gqa`;
    token ids folded into its vocabulary), costed with `model`'s per-step roofline.

    With `ignore_eos`, fixed output lengths and a KV pool large enough for no preemption,
    what the scheduler runs each step depends only on token counts and the engine's limits,
    not on the model: the roofline of a run is known in seconds, on a busy machine too."""
    from pagedserve.demo_models import get_model_path

    stand_in = str(get_model_path("llama-gqa"))
    llm = LLM(stand_in, kv_cache_memory_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, max_model_len=2048)
    timings: list[StepTimings] = []
    llm.llm_engine.add_step_hook(timings.append)
    engine = llm.llm_engine
    for i, r in enumerate(workload):
        engine.add_request(str(i), {"prompt_token_ids": [8 + t % (engine.vocab_size - 8) for t in r["prompt"]]},
                           SamplingParams(temperature=0, max_tokens=r["output_len"], ignore_eos=True,
                                          detokenize=False))
    cost = ModelCost.of(model)
    groups: dict[tuple[str, str], Group] = defaultdict(Group)
    while engine.has_unfinished_requests():
        n_before = len(timings)
        engine.step()
        if len(timings) > n_before:
            sched = engine.last_scheduler_output
            t = timings[-1]
            key = (step_kind([item.num_new_tokens for item in sched.scheduled]), seq_bucket(len(sched.scheduled)))
            c = step_cost(cost, [t.num_tokens, t.num_seqs, t.context_tokens, t.attended_keys, t.logits_rows], machine)
            g = groups[key]
            g.steps += 1
            g.tokens += t.num_tokens
            g.roofline_s += c.roofline_s
            g.phased_s += c.phased_s
            g.linear_bound_s += c.linear_s
            g.attn_bound_s += c.attn_s
            g.attainable_s += rates.seconds(c, t.num_tokens) if rates is not None else float("nan")
    assert engine.get_stats().scheduler.num_preemptions_total == 0, "preempted: give it more KV memory"
    return groups


def gemm_ceiling(model: str, rows: list[int], reps: int) -> list[tuple[int, float]]:
    """GFLOP/s of one decoder layer's linears (q/k/v, o, gate/up, down) + the LM head through
    the engine's own linear path (the loaded layers: oneDNN prepacked, the GEMV kernel up to
    gemv.MAX_ROWS rows) at M rows: what the GEMMs reach at the workload's shapes."""
    from pagedserve.models.layers.embedding import LMHead
    from pagedserve.models.layers.linear import LinearBase

    llm = LLM(model, kv_cache_memory_bytes=64 << 20, max_model_len=256)
    modules = list(llm.llm_engine.runner.model.modules())
    layers = [m for m in modules if isinstance(m, LinearBase)][:4] + [m for m in modules if isinstance(m, LMHead)]
    out = []
    with torch.inference_mode():
        for m in rows:
            calls = [(layer, torch.randn(m, layer.input_size)) for layer in layers]
            flops = sum(2 * m * layer.input_size * layer.output_size for layer in layers)
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                for layer, x in calls:
                    layer(x)
                best = min(best, time.perf_counter() - t)
            out.append((m, flops / best / 1e9))
    return out


def print_table(groups: dict, machine: dict, elapsed: float, steps: int) -> None:
    print(f"\nmachine: {machine['matmul_gflops']:.1f} GFLOP/s (2048^3 fp32 GEMM), "
          f"{machine['read_bandwidth_gbs']:.1f} GB/s read; {steps} steps in {elapsed:.1f} s")
    print("| kind | seqs | steps | tokens | time s | roofline s | of roofline | phased s | of phased "
          "| attainable s | of attainable "
          "| GEMM s (bound) | attention s (bound) | other ops s | forward Python s | engine s (share) |")
    print("|" + "---|" * 16)
    total = Group()
    order = {"prefill-heavy": 0, "mixed": 1, "decode": 2}
    for (kind, bucket), g in sorted(groups.items(), key=lambda kv: (order[kv[0][0]], SEQ_BUCKETS_KEY(kv[0][1]))):
        _row(kind, bucket, g)
        for name in ("steps", "tokens", "total_s", "forward_s", "engine_s", "roofline_s", "phased_s",
                     "linear_bound_s", "attn_bound_s", "attainable_s", "profiled_forward_s"):
            setattr(total, name, getattr(total, name) + getattr(g, name))
        for k in PARTS:
            total.profiled[k] += g.profiled[k]
    _row("**all**", "", total)


def SEQ_BUCKETS_KEY(bucket: str) -> int:  # noqa: N802 - a sort key beside the buckets
    return int(bucket.lstrip(">").split("-")[0])


def _row(kind: str, bucket: str, g: Group) -> None:
    def share(x: float, of: float) -> str:
        return f"{100 * x / of:.0f}%" if of > 0 else "-"

    print(f"| {kind} | {bucket} | {g.steps} | {g.tokens} | {g.total_s:.2f} | {g.roofline_s:.2f} | "
          f"{share(g.roofline_s, g.total_s)} | {g.phased_s:.2f} | {share(g.phased_s, g.total_s)} | "
          f"{g.attainable_s:.2f} | {share(g.attainable_s, g.total_s)} | "
          f"{g.part_s('gemm'):.2f} ({g.linear_bound_s:.2f}) | {g.part_s('attention'):.2f} ({g.attn_bound_s:.2f}) | "
          f"{g.part_s('other_ops'):.2f} | {g.part_s('python'):.2f} | {g.engine_s:.2f} ({share(g.engine_s, g.total_s)}) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF folder (default: the bench-125m random Llama)")
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--kv-cache-bytes", type=int, default=3 << 30)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--profile-every", type=int, default=4, help="profile every N-th step (0: none)")
    parser.add_argument("--gemm-rows", type=int, nargs="*", default=[1, 8, 9, 16, 32, 64, 128, 256, 512, 2048])
    parser.add_argument("--quick", action="store_true", help="tiny model and workload (smoke test)")
    parser.add_argument("--schedule-only", action="store_true",
                        help="no timing: the workload's schedule on a tiny stand-in, costed with --model's roofline")
    parser.add_argument("--gflops", type=float, default=None, help="peak GFLOP/s to use instead of the probe")
    parser.add_argument("--gbs", type=float, default=None, help="read GB/s to use instead of the probe")
    args = parser.parse_args()
    from pagedserve.bench.workloads import synthetic
    from pagedserve.demo_models import get_model_path

    if args.quick:
        args.model = args.model or str(get_model_path("llama-gqa"))
        args.num_requests, args.kv_cache_bytes, args.gemm_rows = 8, 64 << 20, [1, 16, 64]
    model = args.model or str(get_model_path("bench-125m"))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    workload = [{"prompt": r.prompt_token_ids, "output_len": r.output_len}
                for r in synthetic("sharegpt", args.num_requests, vocab, seed=0)]
    if args.gflops and args.gbs:
        machine = {"matmul_gflops": args.gflops, "read_bandwidth_gbs": args.gbs}
    else:
        machine = measure_machine()
    rates = None
    if args.gemm_rows:
        table = gemm_ceiling(model, sorted(args.gemm_rows), reps=3 if args.quick else 7)
        print("GEMM at the workload's shapes (one layer's q/k/v, o, gate/up, down + the LM head, "
              "the engine's own linear path):")
        for m, gflops in table:
            print(f"  M={m:5d}: {gflops:6.1f} GFLOP/s ({100 * gflops / machine['matmul_gflops']:.0f}% of the probe)")
        rates = GemmRates([m for m, _ in table], [g for _, g in table])
    if args.schedule_only:
        groups = schedule_only(args, model, workload, machine, rates)
        print_table(groups, machine, float("nan"), sum(g.steps for g in groups.values()))
        return
    groups, elapsed, steps = run(args, model, workload, machine, rates)
    print_table(groups, machine, elapsed, steps)


if __name__ == "__main__":
    main()
