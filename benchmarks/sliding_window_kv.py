"""KV memory of sliding-window layers in the paged cache (issue 36.4): what one long
sequence of a Gemma-3-shaped model holds when windowed layers give back the blocks that
slid out (core/hybrid_kv_manager.py), against keeping every block of every layer, and how
many such sequences a fixed KV budget admits either way.

Pure block accounting on the real managers (no model, no torch): the sequences are
prefilled in chunks of --chunk tokens and take one decode step, as the scheduler would
run them, one after another until the pool refuses the next one.

    python benchmarks/sliding_window_kv.py                      # Gemma-3-1B's shape
    python benchmarks/sliding_window_kv.py --layers 34 --kv-heads 4 --window 1024  # 4B
"""

from __future__ import annotations

import argparse

from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager, cdiv
from pagedserve.core.kv_groups import plan_kv_groups


def run_sequence(kv: KVCacheManager | HybridKVCacheManager, seq: str, tokens: int, chunk: int) -> bool:
    """Prefill in chunks, then one decode step; False (sequence freed) if the pool runs out."""
    done = 0
    while done < tokens:
        n = min(chunk, tokens - done)
        if not kv.allocate_slots(seq, done, n):
            kv.free(seq)
            return False
        done += n
    if not kv.allocate_slots(seq, done, 1):
        kv.free(seq)
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=26)
    parser.add_argument("--pattern", type=int, default=6, help="every n-th layer is full attention")
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--dtype-bytes", type=int, default=2)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    parser.add_argument("--budget-gib", type=float, default=1.0)
    args = parser.parse_args()

    windows = [None if (i + 1) % args.pattern == 0 else args.window for i in range(args.layers)]
    plan = plan_kv_groups(windows)
    bs = args.block_size
    layer_block = 2 * args.kv_heads * args.head_dim * args.dtype_bytes * bs  # K and V, one layer
    budget = int(args.budget_gib * 2**30)
    n_full = windows.count(None)
    print(f"model: {args.layers} layers ({args.layers - n_full} windowed, window {args.window} : {n_full} full), "
          f"{args.kv_heads} KV heads x {args.head_dim}, {args.dtype_bytes}-byte K/V, block_size {bs}; "
          f"{plan.num_groups} layer groups of {plan.page_layers} layer(s)")

    # Keeping every block: the plain manager, a block = every layer.
    every = KVCacheManager(budget // (layer_block * args.layers), bs)
    assert run_sequence(every, "one", args.tokens, args.chunk)
    every_bytes = every.num_used_blocks * layer_block * args.layers
    every.free("one")
    fit_every = 0
    while run_sequence(every, f"s{fit_every}", args.tokens, args.chunk):
        fit_every += 1

    page = layer_block * plan.page_layers
    hybrid = HybridKVCacheManager(budget // page, bs, plan.windows)
    assert run_sequence(hybrid, "one", args.tokens, args.chunk)
    held = hybrid.num_used_blocks
    hybrid_bytes = held * page
    full_blocks = sum(len(hybrid.groups[g].get_block_table("one")) for g, w in enumerate(plan.windows) if w is None)
    windowed_blocks = held - full_blocks
    hybrid.free("one")
    fit_hybrid = 0
    while run_sequence(hybrid, f"s{fit_hybrid}", args.tokens, args.chunk):
        fit_hybrid += 1

    mib = 2**20
    print(f"one {args.tokens + 1}-token sequence: every block {every_bytes / mib:.1f} MiB; "
          f"windowed blocks given back {hybrid_bytes / mib:.1f} MiB "
          f"({full_blocks} full-layer pages + {windowed_blocks} windowed pages, "
          f"<= {cdiv(args.window, bs) + 1} per windowed group) = {every_bytes / hybrid_bytes:.2f}x less")
    print(f"sequences admitted by a {args.budget_gib:g} GiB KV budget: every block {fit_every}, "
          f"windowed blocks given back {fit_hybrid} ({fit_hybrid / max(fit_every, 1):.2f}x)")


if __name__ == "__main__":
    main()
