"""Micro-benchmark of the multi-LoRA SGMV kernel against the base projections it rides on.

Shapes of the 125M benchmark Llama (hidden 768, intermediate 2048, 12 heads / 4 KV heads of
64): per layer, the base step is 4 matmuls (fused qkv, o, fused gate_up, down) and the LoRA
step 4 calls (q/k/v, o, gate/up, down: one per fused projection, as the engine makes
them) adding into column slices of the fused outputs, with the adapters' weights in a real
paged KV cache (block 16, fp32).

`--layers` distinct layers are cycled (weights, caches), so nothing stays in the 32 MB L3
between uses, as in a 12-layer model. Every repetition times one pass over the layers for
the base and then for LoRA; the minimum over repetitions is reported (the host is shared).

Scenarios: decode batches of 32/128/256 tokens spread evenly over 1/8/64/256 adapters
(sorted by adapter, as the runner does, so each adapter is one segment), ranks all 8 or
mixed {8, 16, 32, 64}; a 512-token prefill over 1/2/4/8 adapters; rank 16 on all 7
projections (the <= 5% target); 256 decodes over 256 mixed-rank adapters vs one adapter
(the 1000-adapter target: a 256-token step drawn from 1000 adapters touches ~226).

    python benchmarks/lora_micro.py [--threads N] [--reps 7] [--layers 4] [--dtype float32]
                                    [--sweep-mm] [--quick]

Columns: base / lora = ms per layer; overhead = lora / base; GB/s = adapter bytes read by
the LoRA step / its time (the bound when each adapter serves few tokens: compare with the
memory read bandwidth printed first); GFLOP/s of the LoRA step.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.lora import kernels
from pagedserve.lora.layout import plan_layout
from pagedserve.lora.peft_loader import TARGETABLE, LoRAAdapter, LoRAModuleWeights
from pagedserve.lora.segments import LoRASegments, ResidentAdapter, build_segments, table_slices

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 768, 2048, 12, 4, 64, 16
Q, KV = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
DIMS = {"q_proj": (HIDDEN, Q), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV),
        "o_proj": (Q, HIDDEN), "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER),
        "down_proj": (INTER, HIDDEN)}
# Module -> (fused output it writes into, first column there).
SLICES = {"q_proj": ("qkv", 0), "k_proj": ("qkv", Q), "v_proj": ("qkv", Q + KV),
          "o_proj": ("o", 0), "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", INTER),
          "down_proj": ("down", 0)}
# Fused output -> (TARGETABLE index, first column, end column) of each module writing into it.
FUSED = {out: [(TARGETABLE.index(name), col, col + DIMS[name][1])
               for name, (o, col) in SLICES.items() if o == out]
         for out in ("qkv", "o", "gate_up", "down")}
MIXED = (8, 16, 32, 64)


@dataclass
class Layer:
    w_qkv: torch.Tensor  # (Q + 2 KV, HIDDEN)
    w_o: torch.Tensor  # (HIDDEN, Q)
    w_gate_up: torch.Tensor  # (2 INTER, HIDDEN)
    w_down: torch.Tensor  # (HIDDEN, INTER)
    kv: torch.Tensor  # (2, blocks, BLOCK, KV_HEADS, HEAD_DIM): adapters live here


def shape_only_adapter(rank: int, num_layers: int) -> LoRAAdapter:
    """Weights never read (the cache is filled directly): only shapes matter for the layout."""
    weights = {(layer, name): LoRAModuleWeights(torch.empty(rank, i), torch.empty(o, rank), 1.0)
               for layer in range(num_layers) for name, (i, o) in DIMS.items()}
    return LoRAAdapter(f"r{rank}", 1, "", rank, weights)


def make_layers(num_layers: int, num_blocks: int, dtype: torch.dtype) -> list[Layer]:
    def w(o: int, i: int) -> torch.Tensor:
        return (torch.randn(o, i) / i**0.5).to(dtype)

    return [Layer(w(Q + 2 * KV, HIDDEN), w(HIDDEN, Q), w(2 * INTER, HIDDEN), w(HIDDEN, INTER),
                  torch.full((2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM), 0.01, dtype=dtype))
            for _ in range(num_layers)]


def place_adapters(ranks: list[int], num_layers: int, block_elems: int) -> list[ResidentAdapter]:
    """Consecutive block runs, one per adapter (layouts depend only on rank)."""
    layouts = {r: plan_layout(shape_only_adapter(r, num_layers), num_layers, block_elems)
               for r in set(ranks)}
    placed, first = [], 0
    for r in ranks:
        placed.append(ResidentAdapter(layouts[r], first))
        first += layouts[r].num_blocks
    return placed


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.dtype = getattr(torch, args.dtype)
        # Adapters' dtype in the pool (the engine's lora_dtype); the cache keeps the model's.
        self.lora_dtype = getattr(torch, getattr(args, "lora_dtype", None) or args.dtype)
        self.reps, self.num_layers = args.reps, args.layers
        self.block_elems = BLOCK * KV_HEADS * HEAD_DIM * self.dtype.itemsize // self.lora_dtype.itemsize
        # Enough blocks for the largest scenario: 256 adapters, ranks mixed evenly.
        placed = place_adapters(list(MIXED), self.num_layers, self.block_elems)
        max_blocks = 64 * sum(p.layout.num_blocks for p in placed)
        self.layers = make_layers(self.num_layers, max_blocks, self.dtype)
        self.storages = [kernels.flat_storage(layer.kv, self.lora_dtype) for layer in self.layers]

    def time_step(self, tokens: int, segs: LoRASegments | None) -> tuple[float, float]:
        """(base, lora) seconds per layer, minimum over repetitions."""
        x_h = torch.randn(tokens, HIDDEN, dtype=self.dtype)
        x_i = torch.randn(tokens, INTER, dtype=self.dtype)
        outs = {"qkv": torch.empty(tokens, Q + 2 * KV, dtype=self.dtype),
                "o": torch.empty(tokens, HIDDEN, dtype=self.dtype),
                "gate_up": torch.empty(tokens, 2 * INTER, dtype=self.dtype),
                "down": torch.empty(tokens, HIDDEN, dtype=self.dtype)}
        best_base = best_lora = float("inf")
        for _ in range(self.reps):
            t0 = time.perf_counter()
            for layer in self.layers:
                torch.mm(x_h, layer.w_qkv.T, out=outs["qkv"])
                torch.mm(x_h, layer.w_o.T, out=outs["o"])
                torch.mm(x_h, layer.w_gate_up.T, out=outs["gate_up"])
                torch.mm(x_i, layer.w_down.T, out=outs["down"])
            t1 = time.perf_counter()
            if segs is not None:
                self.lora_step(segs, x_h, x_i, outs)
            t2 = time.perf_counter()
            best_base, best_lora = min(best_base, t1 - t0), min(best_lora, t2 - t1)
        return best_base / self.num_layers, best_lora / self.num_layers

    def lora_step(self, segs: LoRASegments, x_h: torch.Tensor, x_i: torch.Tensor,
                  outs: dict[str, torch.Tensor]) -> None:
        """One call per fused projection, as `LoRALinear` makes them."""
        for layer, (sa, sb) in enumerate(self.storages):
            for out_name, modules in FUSED.items():
                x = x_i if out_name == "down" else x_h
                segs.apply(outs[out_name], x, sa, sb, table_slices(layer, modules))

    def segments(self, counts: list[int], ranks: list[int]) -> LoRASegments:
        """counts[i] tokens for adapter i of rank ranks[i], adapters placed in the cache."""
        placed = place_adapters(ranks, self.num_layers, self.block_elems)
        return build_segments(list(zip(counts, placed, strict=True)), self.num_layers,
                              len(TARGETABLE))

    def row(self, label: str, tokens: int, counts: list[int], ranks: list[int]) -> float:
        segs = self.segments(counts, ranks)
        base, lora = self.time_step(tokens, segs)
        item = self.lora_dtype.itemsize
        per_rank = sum(i + o for i, o in DIMS.values())
        read = sum(r * per_rank for r in ranks) * item
        flops = 2 * sum(n * r * per_rank for n, r in zip(counts, ranks, strict=True))
        print(f"{label:<34} {tokens:>5} {len(ranks):>5}  {base * 1e3:7.3f} {lora * 1e3:7.3f} "
              f"{100 * lora / base:8.1f}% {read / lora / 1e9:6.1f} {flops / lora / 1e9:7.1f}")
        return lora / base


def spread(tokens: int, adapters: int) -> list[int]:
    base, extra = divmod(tokens, adapters)
    return [base + (i < extra) for i in range(adapters)]


def read_bandwidth() -> float:
    x = torch.ones(64 << 20)  # 256 MB
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9


def run_scenarios(bench: Bench, quick: bool) -> None:
    print(f"{'scenario':<34} {'tok':>5} {'ads':>5}  {'base':>7} {'lora':>7} {'overhead':>9} "
          f"{'GB/s':>6} {'GFLOP/s':>7}")
    rng = random.Random(0)
    for tokens in (32, 128, 256):
        for adapters in (1, 8, 64, 256):
            if adapters > tokens or (quick and adapters in (8, 64)):
                continue
            counts = spread(tokens, adapters)
            bench.row("decode r=8", tokens, counts, [8] * adapters)
            mixed = [MIXED[i % 4] for i in range(adapters)]
            rng.shuffle(mixed)
            bench.row("decode mixed {8,16,32,64}", tokens, counts, mixed)
    for adapters in (1, 2, 4, 8):
        bench.row("prefill 512 r=16", 512, spread(512, adapters), [16] * adapters)
    print()
    for tokens in (32, 256):
        bench.row("target 1: rank 16, 1 adapter", tokens, [tokens], [16])
    single = bench.time_step(256, bench.segments([256], [32]))
    mixed = [MIXED[i % 4] for i in range(256)]
    multi = bench.time_step(256, bench.segments([1] * 256, mixed))
    base = min(single[0], multi[0])  # the same base matmuls: the less disturbed measurement
    ratio = (base + single[1]) / (base + multi[1])
    print(f"target 2: 256 decodes, 256 mixed-rank adapters (mean rank 30) vs one rank-32 "
          f"adapter: throughput ratio {ratio:.3f} (lora {multi[1] * 1e3:.2f} vs "
          f"{single[1] * 1e3:.2f} ms per layer, base {base * 1e3:.2f})")


def sweep_mm(bench: Bench) -> None:
    """Phase 1 by the SIMD kernel vs at::mm (BLAS) for one segment of n tokens."""
    print("segment tokens x rank: SIMD-only vs BLAS phase 1 (LoRA ms per layer)")
    defaults = kernels.MM_MIN_ROWS, kernels.MM_MIN_RANK
    for rank in (8, 16, 32, 64):
        for n in (4, 16, 32, 64, 128, 512):
            segs = bench.segments([n], [rank])
            times = []
            for mm_rows, mm_rank in ((0, 0), (1, 1)):
                kernels.MM_MIN_ROWS, kernels.MM_MIN_RANK = mm_rows, mm_rank
                times.append(bench.time_step(n, segs)[1])
            print(f"  n={n:>4} r={rank:>2}: simd {times[0] * 1e3:7.3f}  blas {times[1] * 1e3:7.3f}"
                  f"  ratio {times[0] / times[1]:.2f}")
    kernels.MM_MIN_ROWS, kernels.MM_MIN_RANK = defaults


def library_compare(bench: Bench, rank: int = 16) -> None:
    """Our kernel against oneDNN on the very products LoRA makes (one adapter, all 7
    projections, one layer, warm): the shrink x . A^T (N = rank) and the expand t . B^T
    (K = rank). oneDNN gets prepacked weights and writes fresh outputs (no add into y, which
    favours it); the base projections are timed the same way for its rate on big GEMMs."""
    from pagedserve.quantization.packed import PACKED

    def packed(w: torch.Tensor) -> torch.nn.Linear:
        """A linear layer of weight w, prepacked as the engine does on the CPU."""
        layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=bench.dtype)
        layer.weight.data.copy_(w)
        PACKED.process_weights_after_loading(layer)
        return layer

    def linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
        return PACKED.apply(layer, x)

    def best(f: Callable[[], None], reps: int = 200) -> float:
        for _ in range(20):
            f()
        times = []
        for _ in range(bench.reps):
            t0 = time.perf_counter()
            for _ in range(reps):
                f()
            times.append((time.perf_counter() - t0) / reps)
        return min(times)

    a = {name: packed(torch.randn(rank, i) / i**0.5) for name, (i, o) in DIMS.items()}
    b = {name: packed(torch.randn(o, rank) / rank) for name, (i, o) in DIMS.items()}
    layer = bench.layers[0]
    base_w = {"qkv": packed(layer.w_qkv), "o": packed(layer.w_o), "gate_up": packed(layer.w_gate_up),
              "down": packed(layer.w_down)}
    print(f"one adapter, rank {rank}, all 7 projections, one layer, warm: GFLOP/s "
          f"(oneDNN shrink / expand / both, ours both, oneDNN base projections)")
    sa, sb = bench.storages[0]
    slices = {out: table_slices(0, modules) for out, modules in FUSED.items()}
    for n in (16, 48, 128, 512):
        x = {"h": torch.randn(n, HIDDEN, dtype=bench.dtype), "i": torch.randn(n, INTER, dtype=bench.dtype)}
        source = {name: x["i" if name == "down_proj" else "h"] for name in DIMS}
        fused_source = {out: x["i" if out == "down" else "h"] for out in FUSED}
        t = torch.randn(n, rank, dtype=bench.dtype)
        outs = {out: torch.zeros(n, base_w[out].out_features, dtype=bench.dtype) for out in FUSED}
        segs = bench.segments([n], [rank])

        def shrink(source: dict = source) -> None:
            for m in DIMS:
                linear(source[m], a[m])

        def expand(t: torch.Tensor = t) -> None:
            for m in DIMS:
                linear(t, b[m])

        def ours(segs: LoRASegments = segs, outs: dict = outs, source: dict = fused_source) -> None:
            for out in FUSED:
                segs.apply(outs[out], source[out], sa, sb, slices[out])

        def base(source: dict = fused_source) -> None:
            for out, w in base_w.items():
                linear(source[out], w)

        flops_in = 2 * n * rank * sum(i for i, _ in DIMS.values())
        flops_out = 2 * n * rank * sum(o for _, o in DIMS.values())
        flops_base = 2 * n * sum(i * o for i, o in DIMS.values())
        ts, te, to, tb = best(shrink), best(expand), best(ours), best(base, 20)
        print(f"  {n:4d} tokens: oneDNN {flops_in / ts / 1e9:5.1f} / {flops_out / te / 1e9:5.1f} / "
              f"{(flops_in + flops_out) / (ts + te) / 1e9:5.1f}, ours {(flops_in + flops_out) / to / 1e9:5.1f}; "
              f"base {flops_base / tb / 1e9:5.1f}")


def order_compare(bench: Bench) -> None:
    """A decode step whose requests come interleaved by adapter (one-token segments) vs the
    same requests side by side (one segment per adapter, as the scheduler orders them)."""
    print("decode step, adapters' requests side by side vs interleaved: LoRA ms per layer")
    for tokens, k in ((8, 4), (16, 8), (32, 8), (48, 4), (48, 8), (128, 16)):
        for label, ranks in (("r=8", [8] * k), ("mixed", [MIXED[i % 4] for i in range(k)])):
            placed = place_adapters(ranks, bench.num_layers, bench.block_elems)
            per = tokens // k
            times = {}
            for order, runs in (("side by side", [(per, placed[i]) for i in range(k)]),
                                ("interleaved", [(1, placed[t % k]) for t in range(per * k)])):
                segs = build_segments(runs, bench.num_layers, len(TARGETABLE))
                times[order] = bench.time_step(per * k, segs)
            (base, side), (_, mixed_order) = times["side by side"], times["interleaved"]
            print(f"  {tokens:4d} tokens, {k:2d} adapters {label:5s}: side by side {side * 1e3:6.3f} "
                  f"({100 * side / base:4.1f}% of the base), interleaved {mixed_order * 1e3:6.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lora-dtype", default=None, choices=["float32", "bfloat16"],
                        help="adapters' dtype in the pool (default: --dtype)")
    parser.add_argument("--sweep-mm", action="store_true", help="only the BLAS threshold sweep")
    parser.add_argument("--quick", action="store_true", help="fewer adapter counts")
    parser.add_argument("--order", action="store_true",
                        help="only a decode step with adapters' requests side by side vs interleaved")
    parser.add_argument("--library", action="store_true",
                        help="only our kernel against oneDNN on the same LoRA products")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"kernel: {kernels.load_extension().isa()}, threads {args.threads}, {args.dtype} "
          f"(adapters {args.lora_dtype or args.dtype}), "
          f"{args.layers} layers cycled, BLAS phase 1 from {kernels.MM_MIN_ROWS} tokens and rank "
          f"{kernels.MM_MIN_RANK}, "
          f"memory read {read_bandwidth():.1f} GB/s")
    bench = Bench(args)
    if args.sweep_mm:
        sweep_mm(bench)
    elif args.library:
        library_compare(bench)
    elif args.order:
        order_compare(bench)
    else:
        run_scenarios(bench, args.quick)


if __name__ == "__main__":
    main()
