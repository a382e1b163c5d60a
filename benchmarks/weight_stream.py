"""A decode step's weight stream: SmolLM2's 30 layers and LM head through the GEMV kernel,
back to back as a step reads them, in 4 KiB pages vs 2 MiB (transparent huge) pages, with vs
without the kernel's software prefetch, and (several rows) without vs with the next-tile
prefetch that streams the weight under the later row blocks' arithmetic.

    python benchmarks/weight_stream.py                       # fp32 bf16 int8 int8-q8 int4, 1 and 8 rows
    python benchmarks/weight_stream.py --kinds bfloat16 --rows 1 --rounds 15
    python benchmarks/weight_stream.py --rows 1 2 4 8        # b8/b1 of the kernels alone

The weights are random (the stream's speed does not depend on their values), ~270 MB in
bf16: far beyond the 32 MiB L3, so each pass reads DRAM as a real step does. The variants
are builds of the same source (`-DPAGEDSERVE_PREFETCH_AHEAD=0`, `-DPAGEDSERVE_NEXT_TILE=0`,
each in its own op namespace) loaded into the same process. Each round times every variant
once (best of 3 passes), in turn, so a neighbour's load hits all alike; the table gives each
variant's median over the rounds, the GB/s it reads the weights at, and the read-bandwidth
probe of benchmarks/latency.py. Columns: 4k / 2M pages, +pf the prefetch ahead, -next
without the next-tile prefetch (the default build has both).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from latency import read_bandwidth  # noqa: E402

from pagedserve import cpp_build  # noqa: E402
from pagedserve.quantization import gemv  # noqa: E402
from pagedserve.quantization.int4 import quantize_int4  # noqa: E402
from pagedserve.quantization.int8_grouped import quantize_int8_grouped  # noqa: E402
from pagedserve.worker import huge_pages  # noqa: E402

KINDS = ("float32", "bfloat16", "int8", "int8-q8", "int4")
HIDDEN, INTER, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
SHAPES = [(QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]


def in_pages(t: torch.Tensor, huge: bool) -> torch.Tensor:
    """A copy of `t` in fresh memory: huge-page-backed, or torch's (4 KiB pages here)."""
    if not huge:
        return t.clone()
    out = huge_pages.empty_bytes(t.nbytes).view(t.dtype).view(t.shape)
    return out.copy_(t)


def pack_layer(kind: str, w: torch.Tensor, huge: bool) -> tuple[str, tuple[torch.Tensor, ...], int]:
    """One (out, in) weight in `kind`'s kernel layout: (the GEMV op's name, its tensors after x and
    before the bias, the bytes they hold)."""
    if kind in ("float32", "bfloat16"):
        tiles = in_pages(gemv.pack_tiles(w.to(getattr(torch, kind))), huge)
        return "gemv_dense", (tiles,), tiles.nbytes
    if kind == "int4":
        q4, sz = gemv.pack_int4_grouped(*quantize_int4(w, 32))
        q4, sz = in_pages(q4, huge), in_pages(sz, huge)
        return "gemv_int4_grouped", (q4, sz), q4.nbytes + sz.nbytes
    q, scale = quantize_int8_grouped(w, 32)
    tiles, scales = gemv.pack_int8_grouped(q, scale)
    scales = in_pages(scales, huge)
    if kind == "int8-q8":
        quads = in_pages(gemv.pack_int8_quads(q), huge)
        return "gemv_int8_q8", (quads, scales), quads.nbytes + scales.nbytes
    tiles = in_pages(tiles, huge)
    return "gemv_int8_grouped", (tiles, scales), tiles.nbytes + scales.nbytes


def layer_call(kind: str, ops: object, w: torch.Tensor, huge: bool) -> tuple[Callable[[torch.Tensor], object], int]:
    """(x -> y through `ops`, the weight bytes it reads) for one (out, in) weight."""
    name, tensors, nbytes = pack_layer(kind, w, huge)
    op = getattr(ops, name)
    return (lambda x: op(x, *tensors, None)), nbytes


def model_pass(kind: str, ops: object, huge: bool, gen: torch.Generator) -> tuple[Callable[[int], None], int]:
    calls = []
    nbytes = 0
    for out, inp in SHAPES:
        w = torch.randn(out, inp, generator=gen) / inp**0.5
        call, size = layer_call(kind, ops, w, huge)
        calls.append((call, inp))
        nbytes += size
    xs = {rows: {inp: torch.randn(rows, inp, generator=gen) for inp in (HIDDEN, INTER)} for rows in (1, 2, 4, 8)}

    def run(rows: int) -> None:
        for call, inp in calls:
            call(xs[rows][inp])
    return run, nbytes


def best_of(run: Callable[[int], None], rows: int, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        run(rows)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], choices=(1, 2, 4, 8))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not huge_pages.available():
        raise SystemExit("transparent huge pages are not available here")
    default = cpp_build.load(cpp_build.GEMV).require()
    no_prefetch = cpp_build.load(cpp_build.GEMV, ("-DPAGEDSERVE_PREFETCH_AHEAD=0", "-DPAGEDSERVE_NEXT_TILE=0"),
                              "pagedserve_gemv_noprefetch").require()
    no_next = cpp_build.load(cpp_build.GEMV, ("-DPAGEDSERVE_NEXT_TILE=0",), "pagedserve_gemv_nonext").require()
    builds = {"": no_prefetch, "+pf-next": no_next, "+pf": default}
    columns = [f"{'4k' if not huge else '2M'}{name}" for huge in (False, True) for name in builds]
    print(f"threads={args.threads}, median of {args.rounds} rounds, each variant best of 3 passes a round")
    print(f"{'kind':9} {'rows':>4} {'MB':>6} | {' '.join(f'{c:>13}' for c in columns)} | ms (GB/s) | probe GB/s")
    gen = torch.Generator().manual_seed(0)
    for kind in args.kinds:
        variants = {}
        for huge in (False, True):
            for name, ops in builds.items():
                variants[("2M" if huge else "4k") + name] = model_pass(kind, ops, huge, gen)
        nbytes = next(iter(variants.values()))[1]
        for rows in args.rows:
            times: dict[str, list[float]] = {k: [] for k in variants}
            probes = []
            for _ in range(args.rounds):
                for name, (run, _) in variants.items():
                    times[name].append(best_of(run, rows))
                probes.append(read_bandwidth(repeats=3))
            cells = []
            for name in columns:
                t = statistics.median(times[name])
                cells.append(f"{t * 1e3:6.2f} ({nbytes / t / 1e9:4.1f})")
            print(f"{kind:9} {rows:>4} {nbytes / 1e6:>6.1f} | {' '.join(cells)} | {statistics.median(probes) / 1e9:5.1f}",
                  flush=True)
        del variants


if __name__ == "__main__":
    main()
