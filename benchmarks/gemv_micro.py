"""Decode-sized linear layers: the C++ GEMV kernel vs the GEMM path it replaces, paired.

    python benchmarks/gemv_micro.py                     # SmolLM2 + 125M shapes, 1/2/4/8 rows
    python benchmarks/gemv_micro.py --quick             # a smoke run
    python benchmarks/gemv_micro.py --threads 1

For each (shape, dtype, rows) the old path and the new one are timed alternately in the same
process (old, new, old, new, ...), each sample a few back-to-back calls, so a neighbour's
load hits both alike; the median of the per-pair ratios old/new is reported beside each
path's median time and the GB/s it reads the weight at. Old paths: oneDNN's prepacked
GEMM for float32/bfloat16 (what `PackedLinearMethod` runs), and for int8 the engine's own
GEMM path (`Int8LinearMethod` with the GEMV off: the AVX512-BF16 C++ kernel where it runs,
else torch's `_weight_int8pack_mm`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

from pagedserve.quantization import gemv  # noqa: E402
from pagedserve.quantization.int8 import Int8LinearMethod, pack_for_cpp, quantize_int8  # noqa: E402
from pagedserve.quantization.packed import onednn_packs  # noqa: E402

# (label, out, in): SmolLM2-135M and the 125M Llama's projections and LM heads.
SHAPES = [
    ("smollm2 qkv", 960, 576),
    ("smollm2 gate_up", 3072, 576),
    ("smollm2 down", 576, 1536),
    ("smollm2 lm_head", 49152, 576),
    ("125m qkv", 2304, 768),
    ("125m gate_up", 6144, 768),
    ("125m down", 768, 3072),
]


def paired(old: Callable[[], object], new: Callable[[], object], pairs: int, calls: int) -> tuple[float, float, float]:
    """Median seconds per call of old and new, and the median of the per-pair ratios."""
    for _ in range(3):
        old(), new()
    t_old, t_new, ratios = [], [], []
    for _ in range(pairs):
        start = time.perf_counter()
        for _ in range(calls):
            old()
        mid = time.perf_counter()
        for _ in range(calls):
            new()
        end = time.perf_counter()
        t_old.append((mid - start) / calls)
        t_new.append((end - mid) / calls)
        ratios.append(t_old[-1] / t_new[-1])
    return statistics.median(t_old), statistics.median(t_new), statistics.median(ratios)


def dense_pair(w: torch.Tensor, x: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    tiles = gemv.pack_tiles(w)
    return (
        lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        lambda: gemv.dense(x, tiles, None),
    )


class _Layer(nn.Module):
    pass


def int8_pair(w: torch.Tensor, x: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object]]:
    q, scale = quantize_int8(w)
    old_layer = _Layer()
    old_layer.weight = w
    method = Int8LinearMethod(gemv=False)
    method.process_weights_after_loading(old_layer)
    tiles = pack_for_cpp(q)
    xb = x.bfloat16()
    return (lambda: method.apply(old_layer, xb), lambda: gemv.int8(xb, tiles, scale, None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--pairs", type=int, default=31, help="alternating samples per point")
    parser.add_argument("--quick", action="store_true", help="two shapes, 1 row, few samples")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if gemv.gemv_ops() is None:
        raise SystemExit("the GEMV kernel is not available here (see the log)")
    shapes, rows, pairs = SHAPES, args.rows, args.pairs
    if args.quick:
        shapes, rows, pairs = SHAPES[:2], [1], 5
    dtypes = [d for d in (torch.float32, torch.bfloat16) if onednn_packs(d)] + ["int8"]
    print(f"threads={args.threads}  ratio = old / new time (median of {pairs} alternating pairs)")
    print(f"{'shape':18} {'dtype':9} {'rows':>4} {'old us':>9} {'new us':>9} {'old GB/s':>9} {'new GB/s':>9} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for label, n, k in shapes:
        w32 = torch.randn(n, k, generator=g) / k**0.5
        for dtype in dtypes:
            for m in rows:
                x = torch.randn(m, k, generator=g)
                if dtype == "int8":
                    old, new = int8_pair(w32, x)
                    nbytes = n * k
                else:
                    old, new = dense_pair(w32.to(dtype), x.to(dtype))
                    nbytes = n * k * dtype.itemsize
                calls = max(1, int(2e6 // nbytes))
                t_old, t_new, ratio = paired(old, new, pairs, calls)
                name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
                print(f"{label:18} {name:9} {m:>4} {t_old * 1e6:>9.1f} {t_new * 1e6:>9.1f} "
                      f"{nbytes / t_old / 1e9:>9.1f} {nbytes / t_new / 1e9:>9.1f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
