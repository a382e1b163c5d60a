"""Where the GEMV kernel should hand over to a GEMM: 8 to 64 rows through every linear layer
of the 125M model (12 layers x qkv, o, gate_up, down), the weights streamed from DRAM as a
decode step of that many sequences reads them, the kernel vs the path the engine takes above
`gemv.MAX_ROWS`.

    python benchmarks/gemv_rows.py                         # float32 and bfloat16
    python benchmarks/gemv_rows.py --dtypes float32 --rows 16 32 48 --rounds 15

The kernel is a variant build with a 64-row limit (`-DPAGEDSERVE_GEMV_MAX_ROWS=64`, its own op
namespace); the default build refuses more than 32. The other path: oneDNN's prepacked GEMM
for float32 (`mkldnn::_linear_pointwise` on `_reorder_linear_weight(w, 64)`, as
`PackedLinearMethod` packs it), and for bfloat16 on a CPU without oneDNN's bf16 GEMM (AVX2) the
float32 GEMM on the widened weight (what the packed method runs there); where oneDNN packs bf16,
its bf16 GEMM. Each round times every path once, in turn (a pass over all 48 layers, after one
untimed pass); the table gives each path's median over the rounds in ms and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve import cpp_build
from pagedserve.quantization import gemv
from pagedserve.quantization.packed import _EXPECTED_ROWS, onednn_packs

HIDDEN, INTER, LAYERS = 768, 3072, 12
SHAPES = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)] * LAYERS


def model_passes(dtype: torch.dtype, ops: object) -> dict[str, Callable[[dict[int, torch.Tensor]], None]]:
    """{path name: run(x by input size)} over the 48 layers, random weights."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen) / k**0.5).to(dtype) for n, k in SHAPES]
    tiles = [gemv.pack_tiles(w) for w in weights]

    def kernel(xs: dict[int, torch.Tensor]) -> None:
        for w, t in zip(weights, tiles, strict=True):
            ops.gemv_dense(xs[w.shape[1]], t, None)  # type: ignore[attr-defined]

    if onednn_packs(dtype):
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, _EXPECTED_ROWS) for w in weights]

        def gemm(xs: dict[int, torch.Tensor]) -> None:
            for w, p in zip(weights, packed, strict=True):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

        return {"GEMV kernel": kernel, "oneDNN packed": gemm}

    def widened(xs: dict[int, torch.Tensor]) -> None:
        for w in weights:
            F.linear(xs[w.shape[1]].float(), w.float()).to(dtype)

    return {"GEMV kernel": kernel, "widened fp32 GEMM": widened}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 12, 16, 24, 32, 48, 64])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if max(args.rows) > 64:
        raise SystemExit("--rows: at most 64 (the variant build's limit)")
    ops = cpp_build.load(cpp_build.GEMV, ("-DPAGEDSERVE_GEMV_MAX_ROWS=64",), "pagedserve_gemv_rows64").require()
    print(f"threads={args.threads}, median of {args.rounds} rounds, ms for all {len(SHAPES)} linears of the 125M model")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        passes = model_passes(dtype, ops)
        old = list(passes)[1]
        print(f"\n{name}: {'rows':>4} | {'GEMV kernel':>11} | {old:>18} | {old} / kernel")
        gen = torch.Generator().manual_seed(1)
        for rows in args.rows:
            xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (HIDDEN, INTER)}
            times: dict[str, list[float]] = {p: [] for p in passes}
            for _ in range(args.rounds):
                for path, run in passes.items():
                    run(xs)
                    start = time.perf_counter()
                    run(xs)
                    times[path].append(time.perf_counter() - start)
            new_ms, old_ms = (statistics.median(times[p]) * 1e3 for p in passes)
            print(f"{' ' * len(name)}  {rows:>4} | {new_ms:11.2f} | {old_ms:18.2f} | {old_ms / new_ms:.2f}x", flush=True)


if __name__ == "__main__":
    main()
