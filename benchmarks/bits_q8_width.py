"""The int8-activation K-quant kernel (`gemv_bits_q8`) in 512-bit vectors against its 256-bit
build, on the real layers of a GGUF file, in one process: on an AVX512-VNNI CPU the default
build takes 16 channels a vector and register blocks of 12 rows (`PAGEDSERVE_QUADS_512`); the
variant (`-DPAGEDSERVE_QUADS_512=0`, its own op namespace) is the 256-bit code with blocks of 6.

    python benchmarks/bits_q8_width.py [--model qwen2.5-coder-1.5b-instruct] [--rows 1 16 64 512]
        [--variant "-DPAGEDSERVE_QUADS_512=0"]

--variant names another build to put beside the default one: e.g. `-DPAGEDSERVE_FORCE_INLINING=0`
leaves the register block's helpers to the compiler's inlining (session 21: it left them out of
line, and their accumulators went through memory).

Every bit-quad layer of the first --layers decoder layers, both builds on the same tensors,
alternating (and which goes first), median of --reps passes; the outputs are checked equal
first (the same sums in the same order per lane). The CPU heads the output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve import LLM, cpp_build
from pagedserve.cpp_build import cpu_description


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", default="-DPAGEDSERVE_QUADS_512=0",
                        help="-D flags of the build timed beside the default (space-separated)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_description())
    default = cpp_build.load(cpp_build.GEMV).require()
    flags = tuple(args.variant.split())
    narrow = cpp_build.load(cpp_build.GEMV, flags, "pagedserve_gemv_variant").require()
    llm = LLM(args.model, max_model_len=512, kv_cache_memory_bytes=32 << 20)
    layers = [m for layer in llm.llm_engine.runner.model.model.layers[: args.layers]
              for m in layer.modules() if hasattr(m, "qweight_quads")]
    print(f"{len(layers)} bit-quad layers of the first {args.layers} decoder layers; threads={args.threads}, "
          f"median of {args.reps}; ms a pass")
    builds = {"default": default, "variant": narrow}
    print(f"variant: {' '.join(flags)}")
    gen = torch.Generator().manual_seed(0)
    print(f"{'rows':>5} | {'default':>9} | {'variant':>9} | variant / default")
    for rows in args.rows:
        xs = [torch.randn(rows, m.qweight_quads.shape[1] * 32, generator=gen) for m in layers]

        def run(ops: object, xs: list[torch.Tensor] = xs) -> list[torch.Tensor]:
            return [ops.gemv_bits_q8(x, m.qweight_quads, m.scale_tiles, None)  # type: ignore[attr-defined]
                    for x, m in zip(xs, layers, strict=True)]

        for a, b in zip(run(default), run(narrow), strict=True):
            assert torch.equal(a, b), "the two builds disagree"
        times: dict[str, list[float]] = {name: [] for name in builds}
        for rep in range(args.reps):
            for name in list(builds)[:: 1 if rep % 2 else -1]:
                start = time.perf_counter()
                run(builds[name])
                times[name].append(time.perf_counter() - start)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{rows:>5} | {ms['default']:9.2f} | {ms['variant']:9.2f} | {ms['variant'] / ms['default']:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
