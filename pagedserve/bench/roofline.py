"""The machine's limits and a step's lower bound: the roofline the benchmarks compare against.

    machine = measure_machine()     # {"matmul_gflops", "read_bandwidth_gbs"}, best of a few tries
    cost = ModelCost.of(model)      # what a step of that model reads and computes
    step_cost(cost, work, machine)  # one step's bounds (seconds)

A decode step reads every weight once however few tokens it runs, so its bound is
max(FLOPs / peak, (weights + K/V read) / bandwidth). Used by benchmarks/throughput.py,
throughput_profile.py, latency.py and chat_speed.py; torch is imported inside the functions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def read_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second a float32 sum reads a buffer far larger than the caches at (best of
    `repeats`), with torch's current thread count."""
    import torch

    buf = torch.ones(mib << 18)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best


def matmul_peak() -> float:
    """FLOP/s of the best 2048^3 fp32 GEMM this torch has (best of 5 per GEMM)."""
    import torch

    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    # The peak is the best GEMM this torch has: MKL's (torch.mm) and oneDNN's with a
    # prepacked weight (what the engine uses); the engine must not beat its own roofline.
    gemms = [lambda: torch.mm(a, b)]
    from pagedserve.quantization.packed import onednn_available

    if onednn_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        gemms.append(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""))
    best = float("inf")
    for gemm in gemms:
        gemm()
        for _ in range(5):
            t = time.perf_counter()
            gemm()
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def measure_machine() -> dict:
    """fp32 matmul peak (GFLOP/s) and memory read bandwidth (GB/s), best of a few tries."""
    import torch

    flops = matmul_peak()
    # Read bandwidth: the best of several streaming reductions over 1 GiB (this VM's
    # bandwidth varies run to run, 30-56 GB/s; the roofline takes the best seen).
    big = torch.ones(1 << 28)  # 1 GiB of fp32
    best = float("inf")
    for reduce in (torch.sum, torch.amax, lambda t: torch.dot(t, t)):
        reduce(big)
        for _ in range(7):
            t = time.perf_counter()
            reduce(big)
            best = min(best, time.perf_counter() - t)
    return {"matmul_gflops": flops / 1e9, "read_bandwidth_gbs": big.numel() * 4 / best / 1e9}


@dataclass(frozen=True)
class ModelCost:
    """What one step of a model costs, from its config (fp32 weights and KV cache)."""

    linear_params: int  # every decoder linear layer (q/k/v, o, gate/up, down), all layers
    head_params: int  # the LM head (hidden x vocab)
    kv_bytes_per_token: int  # K and V of one position, all layers
    attn_flops_per_key: int  # QK^T and PV of one (query, key) pair, all layers and heads

    @property
    def weight_bytes(self) -> int:
        return 4 * (self.linear_params + self.head_params)

    @classmethod
    def of(cls, model: str) -> ModelCost:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
        per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        return cls(linear_params=c.num_hidden_layers * per_layer, head_params=c.hidden_size * c.vocab_size,
                   kv_bytes_per_token=2 * c.num_hidden_layers * kv * 4,
                   attn_flops_per_key=4 * c.num_hidden_layers * q)


@dataclass(frozen=True)
class StepCost:
    """One step's work and its lower bounds (seconds) at the machine's peak and bandwidth."""

    linear_flops: float  # decoder linears (every token) + LM head (every logits row)
    attn_flops: float
    weight_bytes: float
    kv_bytes: float
    compute_s: float  # all FLOPs / peak
    memory_s: float  # (weights + K/V read) / bandwidth
    # Per phase: the linears cannot beat max(their FLOPs / peak, weights / bandwidth), the
    # attention max(its FLOPs / peak, K/V / bandwidth); the phases run one after the other.
    linear_s: float
    attn_s: float

    @property
    def roofline_s(self) -> float:
        """Issue 18's per-step bound: max(all FLOPs / peak, all bytes / bandwidth)."""
        return max(self.compute_s, self.memory_s)

    @property
    def phased_s(self) -> float:
        """The tighter bound of phases that do not overlap (>= roofline_s)."""
        return self.linear_s + self.attn_s


def step_cost(cost: ModelCost, work: list[int], machine: dict) -> StepCost:
    """`work` = [tokens, sequences, K/V rows read, (query, key) pairs, logits rows]."""
    tokens, seqs, context, keys = work[:4]
    rows = work[4] if len(work) > 4 else seqs  # older results: one LM-head row per sequence
    peak, bandwidth = machine["matmul_gflops"] * 1e9, machine["read_bandwidth_gbs"] * 1e9
    linear_flops = 2 * cost.linear_params * tokens + 2 * cost.head_params * rows
    attn_flops = cost.attn_flops_per_key * keys
    kv_bytes = cost.kv_bytes_per_token * context
    return StepCost(
        linear_flops=linear_flops, attn_flops=attn_flops, weight_bytes=cost.weight_bytes, kv_bytes=kv_bytes,
        compute_s=(linear_flops + attn_flops) / peak, memory_s=(cost.weight_bytes + kv_bytes) / bandwidth,
        linear_s=max(linear_flops / peak, cost.weight_bytes / bandwidth),
        attn_s=max(attn_flops / peak, kv_bytes / bandwidth),
    )


def roofline_seconds(model: str, steps: list[list[int]], machine: dict) -> dict:
    """Lower bound on the run's time, step by step: max(FLOPs / peak, bytes read / bandwidth).

    A step's bytes: every linear weight and the LM head once (float32), plus the K/V rows its
    attention reads; its FLOPs: 2 per weight per token, the LM head per logits row (one per
    sampling sequence; none for a prompt chunk that does not end its prompt), QK^T and PV per
    (query, key) pair. `phased_s` sums the linear and attention phases' own bounds instead
    (tighter: a step's GEMMs and its attention do not overlap).
    """
    cost = ModelCost.of(model)
    costs = [step_cost(cost, work, machine) for work in steps]
    return {"flops": sum(c.linear_flops + c.attn_flops for c in costs), "kv_bytes": sum(c.kv_bytes for c in costs),
            "weight_bytes_per_step": cost.weight_bytes, "steps": len(costs),
            "compute_s": sum(c.compute_s for c in costs), "memory_s": sum(c.memory_s for c in costs),
            "roofline_s": sum(c.roofline_s for c in costs), "phased_s": sum(c.phased_s for c in costs)}
