"""Where the GEMV kernel should hand over to a GEMM: 8 to 64 rows through every linear layer
of the 125M model (12 layers x qkv, o, gate_up, down), the weights streamed from DRAM as a
decode step of that many sequences reads them, the kernel vs the path the engine takes above
`gemv.MAX_ROWS`.

    python benchmarks/gemv_rows.py                         # float32 and bfloat16
    python benchmarks/gemv_rows.py --dtypes float32 --rows 16 32 48 --rounds 15
    python benchmarks/gemv_rows.py --dtypes bfloat16 --rows 32 64 128 256 512 --rounds 5
    python benchmarks/gemv_rows.py --dtypes int8 int4 --rows 48 64 128 256 --rounds 5

The kernel is a variant build with a 64-row limit (`-DPAGEDSERVE_GEMV_MAX_ROWS=64`, its own op
namespace); the default build refuses more than 32. The other path: oneDNN's prepacked GEMM
for float32 (`mkldnn::_linear_pointwise` on `_reorder_linear_weight(w, 64)`, as
`PackedLinearMethod` packs it), and for bfloat16 on a CPU without oneDNN's bf16 GEMM (AVX2) the
float32 GEMM on the widened weight (what the packed method runs there); where oneDNN packs bf16,
its bf16 GEMM. For the group-wise int8 / int4 methods (float32 activations) the other path
is theirs above `gemv.CHUNKED_MAX_ROWS`: the weight dequantized block by block to float32 and
the GEMM on each block. A third path, "32-row chunks", runs the default build on the rows 32 at a time
(what `gemv.in_chunks` does for bfloat16 where oneDNN has no bf16 GEMM, and for int8 / int4); above 64 rows the
64-row build is not timed. Each round times every path once, in turn (a pass over all 48
layers, after one untimed pass); the table gives each path's median over the rounds in ms and
the ratio of the other path to the kernel (chunked beyond 64 rows).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from pagedserve import cpp_build
from pagedserve.quantization import gemv, int4, int8_grouped
from pagedserve.quantization.int4 import quantize_int4
from pagedserve.quantization.int8_grouped import quantize_int8_grouped
from pagedserve.quantization.packed import _EXPECTED_ROWS, onednn_packs

HIDDEN, INTER, LAYERS = 768, 3072, 12
SHAPES = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS


def quantized_passes(kind: str) -> dict[str, Callable[[dict[int, torch.Tensor]], None]]:
    """The same for the group-wise int8 / int4 layers (group 32): kernel calls vs the GEMM on
    the weight dequantized to float32 block by block, as the methods run more rows."""
    gen = torch.Generator().manual_seed(0)
    default = cpp_build.load(cpp_build.GEMV).require()
    layers = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen) / k**0.5
        if kind == "int8":
            tiles, scales = gemv.pack_int8_grouped(*quantize_int8_grouped(w, 32))
            layers.append((default.gemv_int8_grouped, tiles, scales,
                           lambda t=tiles, s=scales: int8_grouped._tile_blocks(
                               SimpleNamespace(scale_tiles=s, qweight_tiles=t), torch.float32)))
        else:
            tiles, sz = gemv.pack_int4_grouped(*quantize_int4(w, 32))
            layers.append((default.gemv_int4_grouped, tiles, sz,
                           lambda t=tiles, s=sz: int4._tile_blocks(t, s, torch.float32)))

    def chunked(xs: dict[int, torch.Tensor]) -> None:
        for (op, tiles, scales, _), (_, k) in zip(layers, SHAPES, strict=True):
            for part in xs[k].split(gemv.MAX_ROWS):
                op(part, tiles, scales, None)

    def dequantized(xs: dict[int, torch.Tensor]) -> None:
        for (_, _, _, blocks), (_, k) in zip(layers, SHAPES, strict=True):
            torch.cat([F.linear(xs[k], w) for w in blocks()], dim=1)

    return {"dequantized GEMM": dequantized, "32-row chunks": chunked}


def model_passes(dtype: torch.dtype, ops: object) -> dict[str, Callable[[dict[int, torch.Tensor]], None]]:
    """{path name: run(x by input size)} over the 48 layers, random weights."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n, k in SHAPES]
    tiles = [gemv.pack_tiles(w) for w in weights]
    default = cpp_build.load(cpp_build.GEMV).require()

    def kernel(xs: dict[int, torch.Tensor]) -> None:
        for w, t in zip(weights, tiles, strict=True):
            ops.gemv_dense(xs[w.shape[1]], t, None)  # type: ignore[attr-defined]

    def chunked(xs: dict[int, torch.Tensor]) -> None:
        for w, t in zip(weights, tiles, strict=True):
            for part in xs[w.shape[1]].split(gemv.MAX_ROWS):
                default.gemv_dense(part, t, None)

    if onednn_packs(dtype):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, _EXPECTED_ROWS) for w in weights]

        def gemm(xs: dict[int, torch.Tensor]) -> None:
            for w, p in zip(weights, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        return {"GEMV kernel": kernel, "oneDNN packed": gemm, "32-row chunks": chunked}

    def widened(xs: dict[int, torch.Tensor]) -> None:
        for w in weights:
            F.linear(xs[w.shape[1]].float(), w.float()).to(dtype)

    return {"GEMV kernel": kernel, "widened fp32 GEMM": widened, "32-row chunks": chunked}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "int8", "int4"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 12, 16, 24, 32, 48, 64])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpp_build.load(cpp_build.GEMV, ("-DPAGEDSERVE_GEMV_MAX_ROWS=64",), "pagedserve_gemv_rows64").require()
    print(f"threads={args.threads}, median of {args.rounds} rounds, ms for all {len(SHAPES)} linears of the 125M model")
    for name in args.dtypes:
        quantized = name in ("int8", "int4")
        dtype = torch.float32 if quantized else getattr(torch, name)
        passes = quantized_passes(name) if quantized else model_passes(dtype, ops)
        old = [p for p in passes if p not in ("GEMV kernel", "32-row chunks")][0]
        print(f"\n{name}: {'rows':>4} | {'GEMV kernel':>11} | {'32-row chunks':>13} | {old:>18} | {old} / kernel")
        gen = torch.Generator().manual_seed(1)
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTER)}
            run_now = {p: r for p, r in passes.items() if p != "GEMV kernel" or rows <= 64}
            times: dict[str, list[float]] = {p: [] for p in run_now}
            for _ in range(args.rounds):
                for path, run in run_now.items():
                    run(xs)
                    start = time.perf_counter()
                    run(xs)
                    times[path].append(time.perf_counter() - start)
            ms = {p: statistics.median(t) * 1e3 for p, t in times.items()}
            kernel_ms = ms.get("GEMV kernel", ms["32-row chunks"])
            direct = f"{ms['GEMV kernel']:11.2f}" if "GEMV kernel" in ms else f"{'-':>11}"
            print(f"{' ' * len(name)}  {rows:>4} | {direct} | {ms['32-row chunks']:13.2f} | {ms[old]:18.2f} | "
                  f"{ms[old] / kernel_ms:.2f}x", flush=True)


if __name__ == "__main__":
    main()
