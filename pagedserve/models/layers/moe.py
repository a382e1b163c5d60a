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

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import TPGroup, current_tp
from pagedserve.models.layers.activation import SiluAndMul
from pagedserve.models.layers.linear import MergedColumnParallelLinear, RowParallelLinear


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

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> (weights (T, k) in x.dtype, expert ids (T, k) int64)."""
        logits = F.linear(x, self.weight)  # (T, E), in x.dtype as transformers computes it
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
        down = self.down_proj
        return down.quant_method.apply(down, self.act_fn(self.gate_up_proj(x)))


class FusedMoE(nn.ModuleList):
    """The experts of one sparse layer (`experts.E` as in the checkpoint), run grouped by
    expert over a step's tokens (module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__(ExpertMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        self.num_experts = num_experts
        self.tp: TPGroup = current_tp()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x (T, hidden), router weights (T, k), expert ids (T, k) -> (T, hidden)."""
        k = ids.shape[1]
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # (T * k,) pair indices, grouped by expert
        # One host read of E counts per layer (CPU tensors: no device sync to wait for).
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k  # the token of each sorted pair
        xs = x.index_select(0, tokens)  # (T * k, hidden)
        ys = torch.empty_like(xs)
        start = 0
        for expert, rows in zip(cast(list[ExpertMLP], self), counts, strict=True):
            if rows:
                ys[start:start + rows] = expert.partial(xs[start:start + rows])
                start += rows
        ys.mul_(weights.flatten().index_select(0, order).unsqueeze(1))
        out = torch.zeros_like(x).index_add_(0, tokens, ys)
        # Every rank's experts hold a slice of each expert's intermediate columns: one
        # all-reduce sums them for all experts at once (a no-op with one rank).
        return self.tp.all_reduce(out)
