"""Decode-sized linear layers: the C++ GEMV kernel vs the GEMM path it replaces, paired.

    python benchmarks/gemv_micro.py                     # SmolLM2 + 125M shapes, 1/2/4/8 rows
    python benchmarks/gemv_micro.py --quick             # a smoke run
    python benchmarks/gemv_micro.py --threads 1
    python benchmarks/gemv_micro.py --kinds int8-grouped int4-grouped   # the group-wise ops only
    python benchmarks/gemv_micro.py --kinds int8-q8 --rows 1 8           # int8 x int8 vs weight-only int8

For each (shape, dtype, rows) the old path and the new one are timed alternately in the same
process (old, new, old, new, ...), each sample a few back-to-back calls, so a neighbour's
load hits both alike; the median of the per-pair ratios old/new is reported beside each
path's median time and the GB/s it reads the weight at. Old paths: oneDNN's prepacked
GEMM for float32/bfloat16 (what `PackedLinearMethod` runs; bf16 where oneDNN has no bf16 GEMM:
F.linear on the widened weight, as it runs there), and for int8 the engine's own
GEMM path (`Int8LinearMethod` with the GEMV off: the AVX512-BF16 C++ kernel where it runs,
else torch's `_weight_int8pack_mm`).

Group-wise kinds (group 32, the `--quantization int8` / `int4` default), each timed against
two old paths in turn: the method's torch path (PAGEDSERVE_GEMV=off: int8-grouped dequantizes
blocks of rows for F.linear; int4 runs torch's `_weight_int4pack_mm_for_cpu` on bf16 x) and
the float32 `gemv_dense` on the same weight (what an fp32 model's decode reads: 4 bytes per
weight against 1.06 / 0.56). "GB/s" is each path's own weight bytes over its time.
"int8-q8" (group-wise int8 weights x int8 activations, `gemv_int8_q8`) is timed against the
weight-only group-wise int8 kernel (`gemv_int8_grouped`, float activations) and fp32 `gemv_dense`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]

from pagedserve.quantization import gemv  # noqa: E402
from pagedserve.quantization.int4 import Int4LinearMethod, quantize_int4  # noqa: E402
from pagedserve.quantization.int8 import Int8LinearMethod, pack_for_cpp, quantize_int8  # noqa: E402
from pagedserve.quantization.int8_grouped import Int8GroupedLinearMethod, quantize_int8_grouped  # noqa: E402
from pagedserve.quantization.packed import onednn_packs  # noqa: E402

KINDS = ("float32", "bfloat16", "int8", "int8-grouped", "int4-grouped", "int8-q8")
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
    tiles = gemv.pack_tiles(w)
    if not onednn_packs(w.dtype):  # bf16 without oneDNN's bf16 GEMM: packed.py's widened F.linear
        wide = w.float()
        return lambda: F.linear(x.float(), wide).to(x.dtype), lambda: gemv.dense(x, tiles, None)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
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


def _untiled_layer(w: torch.Tensor, method: Int8GroupedLinearMethod | Int4LinearMethod) -> _Layer:
    """A layer holding the method's torch-path layout (the method built with gemv=False)."""
    layer = _Layer()
    layer.weight, layer.bias = w, None
    layer.output_size, layer.input_size = w.shape
    method.process_weights_after_loading(layer)
    return layer


def grouped_olds(kind: str, w: torch.Tensor, x: torch.Tensor) -> tuple[Callable[[], object], Callable[[], object], Callable[[], object], int]:
    """(torch path, fp32 gemv_dense, new grouped op, the new op's weight bytes)."""
    n, k = w.shape
    tiles32 = gemv.pack_tiles(w)
    if kind == "int8-grouped":
        method: Int8GroupedLinearMethod | Int4LinearMethod = Int8GroupedLinearMethod(32, gemv=False)
        tiles, scales = gemv.pack_int8_grouped(*quantize_int8_grouped(w, 32))
        new: Callable[[], object] = lambda: gemv.int8_grouped(x, tiles, scales, None)  # noqa: E731
        nbytes = n * k + n * k // 32 * 2
    else:
        method = Int4LinearMethod(32, gemv=False)
        tiles4, sz = gemv.pack_int4_grouped(*quantize_int4(w, 32))
        new = lambda: gemv.int4_grouped(x, tiles4, sz, None)  # noqa: E731
        nbytes = n * k // 2 + n * k // 32 * 4
    old_layer = _untiled_layer(w, method)
    return (lambda: method.apply(old_layer, x)), (lambda: gemv.dense(x, tiles32, None)), new, nbytes


def run_grouped(kind: str, label: str, w: torch.Tensor, x: torch.Tensor, pairs: int) -> None:
    n, k = w.shape
    if kind == "int8-q8":
        q, scale = quantize_int8_grouped(w, 32)
        tiles, scales = gemv.pack_int8_grouped(q, scale)
        quads = gemv.pack_int8_quads(q)
        tiles32 = gemv.pack_tiles(w)
        nbytes = n * k + n * k // 32 * 2
        new: Callable[[], object] = lambda: gemv.int8_q8(x, quads, scales, None)  # noqa: E731
        olds = (("weight-only", lambda: gemv.int8_grouped(x, tiles, scales, None), nbytes),
                ("fp32", lambda: gemv.dense(x, tiles32, None), n * k * 4))
    else:
        torch_path, dense32, new, nbytes = grouped_olds(kind, w, x)
        olds = (("torch", torch_path, nbytes), ("fp32", dense32, n * k * 4))
    calls = max(1, int(2e6 // nbytes))
    for old_name, old, old_bytes in olds:
        t_old, t_new, ratio = paired(old, new, pairs, calls)
        print(f"{label:18} {kind + ' vs ' + old_name:26} {x.shape[0]:>4} {t_old * 1e6:>9.1f} {t_new * 1e6:>9.1f} "
              f"{old_bytes / t_old / 1e9:>9.1f} {nbytes / t_new / 1e9:>9.1f} {ratio:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--pairs", type=int, default=31, help="alternating samples per point")
    parser.add_argument("--quick", action="store_true", help="two shapes, 1 row, few samples")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if gemv.gemv_ops() is None:
        raise SystemExit("the GEMV kernel is not available here (see the log)")
    shapes, rows, pairs = SHAPES, args.rows, args.pairs
    if args.quick:
        shapes, rows, pairs = SHAPES[:2], [1], 5
    dense = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    dtypes = [dense.get(kind, kind) for kind in args.kinds]
    print(f"threads={args.threads}  ratio = old / new time (median of {pairs} alternating pairs)")
    print(f"{'shape':18} {'dtype':22} {'rows':>4} {'old us':>9} {'new us':>9} {'old GB/s':>9} {'new GB/s':>9} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for label, n, k in shapes:
        w32 = torch.randn(n, k, generator=g) / k**0.5
        for dtype in dtypes:
            for m in rows:
                x = torch.randn(m, k, generator=g)
                if dtype in ("int8-grouped", "int4-grouped", "int8-q8"):
                    run_grouped(str(dtype), label, w32, x, pairs)
                    continue
                if dtype == "int8":
                    old, new = int8_pair(w32, x)
                    nbytes = n * k
                else:
                    old, new = dense_pair(w32.to(dtype), x.to(dtype))
                    nbytes = n * k * dtype.itemsize
                calls = max(1, int(2e6 // nbytes))
                t_old, t_new, ratio = paired(old, new, pairs, calls)
                name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
                print(f"{label:18} {name:22} {m:>4} {t_old * 1e6:>9.1f} {t_new * 1e6:>9.1f} "
                      f"{nbytes / t_old / 1e9:>9.1f} {nbytes / t_new / 1e9:>9.1f} {ratio:>6.2f}")


if __name__ == "__main__":
    main()
