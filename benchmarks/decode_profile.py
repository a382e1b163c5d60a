"""Where a batch-1 decode token goes (issue 18): torch.profiler over a short greedy run.

    python benchmarks/decode_profile.py --model smollm2 --dtype float32 --tokens 64
    python benchmarks/decode_profile.py --model smollm2 --dtype bfloat16 --compile
    python benchmarks/decode_profile.py --model smollm2 --quantization int8 --batch 8
    python benchmarks/decode_profile.py --model smollm2 --quantization int8 --quantization-activations none

Per generated token: wall time, time inside the linear kernels (GEMV / oneDNN / F.linear),
inside every other top-level op, and outside any op (Python: module calls, input building,
sampling glue), plus the number of top-level ops dispatched. "Top-level" = ops not called
from inside another op, so nothing is counted twice. The linear time is split into the LM
head (the one linear op per step with the vocabulary as its output) and the other layers;
the other ops into attention, norms / rotary / activations, and the rest. With --batch B,
B requests decode together (time per step = per token of each).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig

from pagedserve import LLM, SamplingParams
from pagedserve.bench.checkpoints import resolve_model
from pagedserve.bench.profiling import CATEGORIES, LINEAR_OPS, category, is_lm_head, top_level


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--compile", action="store_true", help="compiled decode (compilation_config level 3)")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quantization", default=None, choices=("int8", "int4"))
    parser.add_argument("--quantization-activations", default="auto", choices=("auto", "int8", "none"))
    parser.add_argument("--quantize-lm-head", action="store_true")
    parser.add_argument("--batch", type=int, default=1, help="requests decoding together")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs: dict = {"compilation_config": {"level": 3, "compile_sizes": [args.batch]}} if args.compile else {}
    if args.quantization:
        kwargs.update(quantization=args.quantization, quantize_lm_head=args.quantize_lm_head)
        if args.quantization == "int8":
            kwargs["quantization_activations"] = args.quantization_activations
    path = resolve_model(args.model, "fp32")  # an HF folder (quantized at load, not a GGUF)
    llm = LLM(path, dtype=args.dtype, max_model_len=512, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 << 20, **kwargs)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1 + i]} for i in range(args.batch)]
    llm.generate(prompts, params, use_tqdm=False)  # warm
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": [2 + i]} for i in range(args.batch)], params, use_tqdm=False)
        wall = time.perf_counter() - start
    every = [e for e in prof.events() if e.device_type.name == "CPU"]
    events = top_level(every)
    per = 1 / args.tokens
    linear_events = [e for e in events if any(k in e.name for k in LINEAR_OPS)]
    linear = sum(e.time_range.elapsed_us() for e in linear_events) / 1e3
    head = sum(e.time_range.elapsed_us() for e in linear_events if is_lm_head(e, vocab)) / 1e3
    other = sum(e.time_range.elapsed_us() for e in events) / 1e3 - linear
    total = wall * 1e3
    quant = f" {args.quantization} (activations {args.quantization_activations})" if args.quantization else ""
    print(f"{args.model} {args.dtype}{quant} compile={args.compile} batch={args.batch}: {args.tokens} steps, "
          f"{total * per:.2f} ms/step (threads={torch.get_num_threads()})")
    print(f"  linear ops  {linear * per:7.2f} ms/step ({100 * linear / total:4.1f}%)")
    print(f"    LM head   {head * per:7.2f} ms/step ({100 * head / total:4.1f}%)")
    print(f"    layers    {(linear - head) * per:7.2f} ms/step ({100 * (linear - head) / total:4.1f}%)")
    print(f"  other ops   {other * per:7.2f} ms/step ({100 * other / total:4.1f}%)")
    linear_ids = {id(e) for e in linear_events}
    for name in (*CATEGORIES, "the rest"):
        ms = sum(e.time_range.elapsed_us() for e in events
                 if id(e) not in linear_ids and category(e.name) == name) / 1e3
        print(f"    {name:14} {ms * per:7.2f} ms/step ({100 * ms / total:4.1f}%)")
    print(f"  outside ops {(total - linear - other) * per:7.2f} ms/step ({100 * (total - linear - other) / total:4.1f}%)")
    print(f"  top-level ops per step: {len(events) / args.tokens:.0f}  (a compiled region counts once)")
    kernels = [e for e in every if e.name.startswith(("pagedserve", "aten::"))]
    print(f"  op events per step, nested included: {len(kernels) / args.tokens:.0f}")
    by_name: Counter = Counter()
    counts: Counter = Counter()
    for e in events:
        by_name[e.name] += e.time_range.elapsed_us()
        counts[e.name] += 1
    for name, us in by_name.most_common(args.top):
        print(f"    {name:50} {counts[name] / args.tokens:6.1f}/tok {us / 1e3 * per:7.3f} ms/tok")


if __name__ == "__main__":
    main()
