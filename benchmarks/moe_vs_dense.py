"""Qwen3-MoE against a dense Qwen3 with the same active parameters: output tokens per second.

    python benchmarks/moe_vs_dense.py            # ~2 min on 2 cores
    python benchmarks/moe_vs_dense.py --quick    # smoke run (fewer tokens, one run)

The MoE model is Qwen3-30B-A3B's shape scaled down to a 2-core CPU: hidden 512, 8 layers,
64 experts of width 128, top-8 (30B-A3B: hidden 2048, 48 layers, 128 experts of 768, top-8).
The dense model is the same Qwen3 with one MLP of width top_k * moe_intermediate (1024), so
each token multiplies by the same number of weights; the MoE model also computes its router
(64 x 512 per layer). Both random, served by the engine from HF folders, greedy decoding
with ignore_eos, prompts of 32 tokens. Output (decode) tok/s = batch * (N - 1) / (time of a
generate of N tokens - time of one of 1 token), best of --runs, the two engines taking turns;
by wall time and per CPU-second of this process (robust to waiting for a core on a shared
machine).

What bounds the ratio: a decode step reads every expert some token of the batch routed to.
At batch 1 that is 8 experts a layer, as many weights as the dense MLP; at batch 16, with
roughly uniform routing, 64 * (1 - (1 - 8/64)^16) ~ 56 experts a layer, ~7x the dense
MLP's bytes. The table gives that expected expert count beside the times. At batch 16 those
bytes alone (8 layers x 56 experts x 384 KiB, bf16: 177 MB a step) take ~5.9 ms at the
~30 GB/s two cores read, 92% of the dense model's whole step (6.4 ms), so MoE / dense is at
most dense / (dense - its MLP + 5.9 ms) ~ 0.58 there, however fast the rest.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3MoeConfig

from pagedserve import LLM, SamplingParams
from pagedserve.bench.common import md_table, torch_threads

SHAPE: dict[str, Any] = dict(
    vocab_size=16384, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
NUM_EXPERTS, TOP_K, MOE_WIDTH = 64, 8, 128
PROMPT_LEN = 32


def configs() -> dict[str, PretrainedConfig]:
    return {
        "moe": Qwen3MoeConfig(**SHAPE, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K,
                              moe_intermediate_size=MOE_WIDTH, norm_topk_prob=True),
        "dense": Qwen3Config(**SHAPE, intermediate_size=TOP_K * MOE_WIDTH),
    }


def save_random(config: PretrainedConfig, path: Path, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)


def expected_experts(batch: int) -> float:
    """Distinct experts a layer reads in a decode step, routing uniform and independent."""
    return NUM_EXPERTS * (1 - (1 - TOP_K / NUM_EXPERTS) ** batch)


def workload(batch: int, output_len: int) -> tuple[list[dict], SamplingParams]:
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(3, SHAPE["vocab_size"], (PROMPT_LEN,), generator=g).tolist()}
               for _ in range(batch)]
    return prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one generate."""
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs)
    return elapsed, cpu


def compare(llms: dict[str, LLM], batch: int, output_len: int, runs: int) -> dict[str, tuple[float, float]]:
    """Decode tok/s of each engine by wall time and by CPU time: batch * (output_len - 1)
    tokens over the time a generate of output_len tokens takes beyond one of a single token
    (the prefill and the first token), each the best of `runs`. The engines take turns, so a
    burst of someone else's load hits both rather than one; CPU time (one thread) leaves
    out the time the process waited for a core on a shared machine."""
    prompts, params = workload(batch, output_len)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    inf = float("inf")
    best = {name: {"full": (inf, inf), "first": (inf, inf)} for name in llms}
    for llm in llms.values():  # warm-up
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    for _ in range(runs):
        for name, llm in llms.items():
            for part, p in (("first", first), ("full", params)):
                wall, cpu = timed(llm, prompts, p)
                best[name][part] = (min(best[name][part][0], wall), min(best[name][part][1], cpu))
    for llm in llms.values():
        llm.llm_engine.assert_no_leaks()
    tokens = batch * (output_len - 1)
    return {name: (tokens / (b["full"][0] - b["first"][0]), tokens / (b["full"][1] - b["first"][1]))
            for name, b in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: the machine is shared)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.output_len, args.runs = 16, 1
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp, torch_threads(args.threads):
        llms = {}
        for name, config in configs().items():
            path = Path(tmp) / name
            save_random(config, path, dtype)
            llms[name] = LLM(str(path), dtype=args.dtype, max_model_len=512, max_num_seqs=max(batches),
                             kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True)
        by_batch = {b: compare(llms, b, args.output_len, args.runs) for b in batches}
    rows = []
    for b in batches:
        (moe_wall, moe_cpu), (dense_wall, dense_cpu) = by_batch[b]["moe"], by_batch[b]["dense"]
        rows.append([b, moe_wall, dense_wall, moe_wall / dense_wall, moe_cpu, dense_cpu,
                     moe_cpu / dense_cpu, expected_experts(b)])
    print(f"{args.dtype}, {args.threads} thread(s), prompt {PROMPT_LEN}, {args.output_len} output tokens, "
          f"best of {args.runs}")
    print(md_table(["batch", "MoE tok/s", "dense tok/s", "MoE / dense", "MoE tok/CPU-s",
                    "dense tok/CPU-s", "MoE / dense (CPU)", "experts read / layer"], rows))

if __name__ == "__main__":
    main()
