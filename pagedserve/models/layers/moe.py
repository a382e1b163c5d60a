"""Sparse mixture-of-experts MLP on CPU: a top-k softmax router and a list of SwiGLU experts.

Names mirror Hugging Face's Qwen-style MoE checkpoints, so weights load by name (the
experts' gate/up projections fuse through the model's ordinary `stacked_params_mapping`):

    mlp.gate.weight                          (num_experts, hidden)     TopKRouter, never quantized
    mlp.experts.E.{gate,up}_proj.weight  ->  mlp.experts.E.gate_up_proj  (2 * I, hidden)
    mlp.experts.E.down_proj.weight           (hidden, I)

Each expert is an ordinary pair of linear layers, so whatever the loader gives every linear
layer (oneDNN packing, int8 / int4 per expert, tensor-parallel shards) the experts get too.

A step's tokens are grouped by expert rather than looped over one by one:

    ids (T, k) -> flatten, stable argsort -> pairs sorted by expert:  | e0 e0 | e3 | e5 e5 e5 |
    x[token of each pair]                    (T * k, hidden), one gather
    per active expert: its rows              gate_up -> SiLU * up -> down (one GEMM each)
    out.index_add_(token, y * weight)        (T, hidden), one scatter-add

The Python loop runs over the step's active experts (at most min(E, T * k)), never over
tokens. Because the pairs are sorted by expert, each token's k contributions are summed in
ascending expert order, as transformers' per-expert `index_add_` loop sums them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import TPGroup, current_tp
from pagedserve.models.layers.activation import SiluAndMul
from pagedserve.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedserve.quantization import gemv
from pagedserve.quantization.base import LinearCall
from pagedserve.quantization.packed import GEMV_TILES


class TopKRouter(nn.Module):
    """Router logits -> softmax (float32) -> top-k -> optional renormalisation to sum 1.

    A plain parameter rather than a linear layer, so no quantization method ever reaches it:
    an int8 router would flip near-tied expert choices, which no later layer can undo.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..num_experts={num_experts}")
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        # The weight in the GEMV kernel's tiles, made on the first forward (after loading):
        # torch's unpacked bfloat16 F.linear took ~0.3 ms for this 64 x 512 product.
        self.tiles: torch.Tensor | None = None
        self.tiles_made = False

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, E) in x.dtype."""
        if not self.tiles_made:
            self.tiles = gemv.pack_tiles(self.weight) if gemv.takes(self.weight) else None
            self.tiles_made = True
        if self.tiles is not None and x.dtype in gemv.X_DTYPES and x.shape[0] <= gemv.MAX_ROWS:
            return gemv.dense(x, self.tiles, None)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k) in x.dtype, expert ids (T, k) int64)."""
        logits = self.logits(x)  # (T, E), in x.dtype as transformers computes it
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), ids


class ExpertMLP(nn.Module):
    """One expert: SwiGLU with its gate/up projections fused (rows | gate | up |)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = SiluAndMul()

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """x (n, hidden) -> this rank's partial down projection (n, hidden), not yet summed
        over tensor-parallel ranks (FusedMoE reduces once for all experts)."""
        gate_up, down = self.gate_up_proj, self.down_proj
        h = self.act_fn.forward(gate_up.quant_method.apply(gate_up, x))
        return down.quant_method.apply(down, h)

    def decode_calls(self, ops: Any) -> ExpertCalls | None:
        """The single GEMV ops (and their weight arguments) that gate_up_proj's and
        down_proj's methods run for at most gemv.MAX_ROWS rows (`LinearMethod.decode_op`),
        or None when a method has none."""
        calls = [layer.quant_method.decode_op(layer) for layer in (self.gate_up_proj, self.down_proj)]
        if ops is None or any(call is None or not hasattr(ops, call[0]) for call in calls):
            return None
        (gu_op, gu_args), (down_op, down_args) = cast(list[LinearCall], calls)
        # The ops take the bias last, None here (experts have none; decode_op omits it).
        return getattr(ops, gu_op), [*gu_args, None], getattr(ops, down_op), [*down_args, None]


# (gate_up op, its arguments after x, down op, its arguments after x): one expert's decode calls.
ExpertCalls = tuple[Callable[..., torch.Tensor], list[torch.Tensor | None],
                    Callable[..., torch.Tensor], list[torch.Tensor | None]]


class FusedMoE(nn.ModuleList):
    """The experts of one sparse layer (`experts.E` as in the checkpoint), run grouped by
    expert over a step's tokens (module docstring).

    At decode sizes (at most gemv.MAX_ROWS tokens) with float32 / bfloat16 experts (every
    expert's gate_up and down calls are `gemv_dense`), the whole layer is one C++ call,
    `gemv_moe`: the per-expert loop below cost ~3 dispatches and 2 parallel regions an expert,
    ~170 calls for the ~56 experts a batch-16 step of a 64-expert layer reads, more than the
    expert weights took to stream (benchmarks/moe_vs_dense.py, batch 16, 2 threads: a step
    in 12.6 ms against 22.9).
    Other experts (int8 / int4 / GGUF methods) at decode sizes call their methods' GEMV ops
    directly, without the Python dispatches of `apply`.

    Both paths read the experts' weight buffers (the GEMV tiles the methods derive) from one
    (E, ...) tensor per projection, each expert's buffer a view of it, made on the first forward
    (after loading): a batch-16 step reads ~56 of 64 experts, and one contiguous block streamed
    1.4-1.6x faster than 64 separate allocations did (8 layers' expert GEMVs, 2-core EPYC:
    22-26 ms against 35-37).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(ExpertMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.num_experts = num_experts
        self.tp: TPGroup = current_tp()
        self.calls: list[ExpertCalls | None] = []
        # Every expert's gate_up and down pair tiles, stacked, when both run `gemv_dense`: the
        # whole layer is then one `gemv_moe` call at decode sizes.
        self.stacked_tiles: tuple[torch.Tensor, torch.Tensor] | None = None
        self.ops: Any = None

    def _decode_calls(self) -> list[ExpertCalls | None]:
        if not self.calls:
            stacked = self._stack_buffers()
            self.ops = ops = gemv.gemv_ops()
            self.calls = [expert.decode_calls(ops) for expert in cast(list[ExpertMLP], self)]
            self.stacked_tiles = self._dense_tiles(stacked)
        return self.calls

    def _dense_tiles(self, stacked: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up, down) stacked pair tiles when every expert's decode calls are `gemv_dense`
        (each reads its layer's `GEMV_TILES` buffer, a view of the stacked one); else None."""
        ops = self.ops
        if ops is None or not hasattr(ops, "gemv_moe") or any(
                call is None or call[0] is not ops.gemv_dense or call[2] is not ops.gemv_dense
                for call in self.calls):
            return None
        gate_up, down = (side.get(GEMV_TILES) for side in stacked)
        return None if gate_up is None or down is None else (gate_up, down)

    def _stack_buffers(self) -> list[dict[str, torch.Tensor]]:
        """Each projection's buffers, stacked over experts where every expert has the buffer
        with one shape and dtype; parameters (the loaded weights) stay where they are.
        Returns the stacked tensors by buffer name, per projection (gate_up, down)."""
        experts = cast(list[ExpertMLP], self)
        made: list[dict[str, torch.Tensor]] = []
        for layers in ([e.gate_up_proj for e in experts], [e.down_proj for e in experts]):
            made.append({})
            buffers = [dict(layer.named_buffers(recurse=False)) for layer in layers]
            for name in buffers[0]:
                parts = [t for t in (b.get(name) for b in buffers) if t is not None]
                first = parts[0]
                if len(parts) != len(layers) or any(
                        t.shape != first.shape or t.dtype != first.dtype or t.layout != torch.strided
                        for t in parts):
                    continue
                stacked = torch.stack(parts)
                made[-1][name] = stacked
                for layer, view in zip(layers, stacked.unbind(0), strict=True):
                    setattr(layer, name, view)
        return made

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x (T, hidden), router weights (T, k), expert ids (T, k) -> (T, hidden)."""
        calls = self._decode_calls()
        if self.stacked_tiles is not None and x.dtype in gemv.X_DTYPES and x.shape[0] <= gemv.MAX_ROWS:
            gate_up, down = self.stacked_tiles
            return self.tp.all_reduce(self.ops.gemv_moe(x, gate_up, down, ids, weights))
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (T * k,) pair indices, grouped by expert
        # One host read of E counts per layer (CPU tensors: no device sync to wait for).
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k  # the token of each sorted pair
        xs = x.index_select(0, tokens)  # (T * k, hidden)
        decode = x.dtype in gemv.X_DTYPES
        parts, start = [], 0
        for expert, rows, call in zip(cast(list[ExpertMLP], self), counts, calls, strict=True):
            if not rows:
                continue
            rows_x = xs[start:start + rows]
            start += rows
            if call is not None and decode and rows <= gemv.MAX_ROWS:
                gu_op, gu_args, down_op, down_args = call
                parts.append(down_op(expert.act_fn.forward(gu_op(rows_x, *gu_args)), *down_args))
            else:
                parts.append(expert.partial(rows_x))
        ys = torch.cat(parts).mul_(weights.flatten()[order].unsqueeze(1))
        out = torch.zeros_like(x).index_add_(0, tokens, ys)
        # Every rank's experts hold a slice of each expert's intermediate columns: one
        # all-reduce sums them for all experts at once (a no-op with one rank).
        return self.tp.all_reduce(out)
