"""The decode GEMV kernel against variant builds of itself, on a whole decode step's weight pass
(SmolLM2's 30 layers and LM head, as benchmarks/weight_stream.py lays them out, 2 MiB pages) at
several row counts, alternating pass by pass (and which build goes first) so the VM's swings hit
every build alike.

    python benchmarks/gemv_variants.py --kind bfloat16 --rows 3 4 5 6 8 16 32 \\
        --variant bf16_2row=-DPAGEDSERVE_BF16_ROW_BLOCKS4=0
    python benchmarks/gemv_variants.py --kind int8 --rows 8 16 --variant no_next=-DPAGEDSERVE_NEXT_TILE=0

Each variant is the same source built with the given -D flags in its own op namespace
(pagedserve.cpp_build), loaded into this process beside the default build. Per row count: each
build's median and best pass over --passes, and the median of the per-pass ratios variant /
default (> 1: the default build is faster). Row counts above 32 are not the kernel's (the layers
send them to the GEMM or in 32-row chunks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import read_bandwidth  # noqa: E402
from weight_stream import KINDS, SHAPES, pack_layer  # noqa: E402

from pagedserve import cpp_build  # noqa: E402
from pagedserve.worker import huge_pages  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", default="bfloat16", choices=KINDS)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                        help="a build with these space-separated -D flags (repeatable)")
    parser.add_argument("--passes", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if any(not 1 <= r <= 32 for r in args.rows):
        raise SystemExit("--rows: the kernel takes 1 to 32 rows")
    torch.set_num_threads(args.threads)
    huge = huge_pages.available()
    builds = {"default": cpp_build.load(cpp_build.GEMV).require()}
    for i, spec in enumerate(args.variant):
        name, _, flags = spec.partition("=")
        builds[name] = cpp_build.load(cpp_build.GEMV, tuple(flags.split()), f"pagedserve_gemv_variant{i}").require()
    gen = torch.Generator().manual_seed(0)
    # One copy of the packed weights that every build reads (the layout is the same): where the
    # weights lie in memory moved a pass by up to 15% when each build had its own copy.
    layers = [(pack_layer(args.kind, torch.randn(out, inp, generator=gen) / inp**0.5, huge), inp)
              for out, inp in SHAPES]
    passes = {name: [(getattr(ops, op), tensors, inp) for (op, tensors, _), inp in layers]
              for name, ops in builds.items()}
    print(f"{args.kind}, threads={args.threads}, {'2 MiB' if huge else '4 KiB'} pages, {args.passes} passes a build, "
          f"read probe {read_bandwidth(repeats=3) / 1e9:.1f} GB/s")
    for rows in args.rows:
        xs = {inp: torch.randn(rows, inp, generator=gen) for inp in {inp for _, inp in SHAPES}}
        times: dict[str, list[float]] = {name: [] for name in passes}
        order = list(passes.items())
        for i in range(args.passes):
            for name, calls in order if i % 2 == 0 else order[::-1]:  # who goes first alternates
                start = time.perf_counter()
                for op, tensors, inp in calls:
                    op(xs[inp], *tensors, None)
                times[name].append(time.perf_counter() - start)
        for name, t in times.items():
            ratio = statistics.median(v / d for d, v in zip(times["default"], t, strict=True))
            print(f"  rows {rows:3d} {name:12} median {statistics.median(t) * 1e3:7.2f} ms  best {min(t) * 1e3:7.2f} ms"
                  + ("" if name == "default" else f"  {name} / default {ratio:.3f}"), flush=True)


if __name__ == "__main__":
    main()
