"""Batched LoRA deltas of a heterogeneous batch, weights read in place from the KV cache.

One call per (layer, module), or per fused projection (its modules' column slices), adds
every segment's delta to the base output:

    y[seg s rows, :] += scale_s * (x[seg s rows] @ A_s^T) @ B_s^T

    y          (T, out_dim)  strided view allowed (a column slice of a fused qkv / gate_up
                             output): row stride >= out_dim, columns contiguous
    x          (T, in_dim)   columns contiguous
    storage_a  flat 1-D; A_s (r_s, in_dim) row-major at storage_a[a_offsets[s]:] (PEFT's A)
    storage_b  flat 1-D; B_s packed by `pack_lora_b` at storage_b[b_offsets[s]:]: B_s^T cut
                             into panels of PANEL = 16 output columns, each (r_s, 16)
                             row-major, b_region_elems(out_dim, r_s) elements
    seg_starts (S + 1,) int64  segment s = rows [seg_starts[s], seg_starts[s + 1]); rows
                             outside [seg_starts[0], seg_starts[S]) are untouched, and a
                             no-adapter run between two segments is a segment of rank 0
    a_offsets, b_offsets (S,) int64 absolute element offsets; ranks (S,) int32 (0 = skip);
                             scales (S,) float32; any 1-D stride. `lora_apply_slices` takes
                             contiguous (..., S) tables and, per module, a row of them
                             and a column slice of y.

Why B is packed, not PEFT's (out_dim, r) row-major: the second product then broadcasts
t[i, k] and FMAs contiguous 16-wide panel rows, with no horizontal sums and one memory
stream per panel; row-major B needs a length-r dot and a horizontal sum per output, which
measured ~2.5x slower on multi-token segments (csrc/lora_sgmv_cpu.cpp, header).

`lora_apply` runs the C++ op (pagedserve/csrc/lora_sgmv_cpu.cpp, through `cpp_build`; the
engine loads it at start-up when LoRA is enabled, `LoRALinear.bind`); if it cannot be built, or for dtypes it lacks (float16), it logs a warning once and
uses `lora_apply_reference`. Results do not depend on the thread count.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from pagedserve import cpp_build

logger = logging.getLogger(__name__)

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# Output columns per panel of a packed B (PANEL in csrc/lora_sgmv_cpu.cpp).
PANEL = 16
# Phase 1 (x @ A^T) of segments with >= MM_MIN_ROWS tokens and rank >= MM_MIN_RANK goes to
# BLAS (at::mm), the rest to the SIMD kernel. `benchmarks/lora_micro.py --sweep-mm`: the SIMD
# kernel is as fast or faster below 64 tokens at any rank and for ranks < 32 at any length;
# BLAS wins by 10-20% on long rank-64 segments (it packs A). On AVX-512, float32 segments
# with ranks in multiples of 16 and >= 96 tokens (>= 32 from rank 32) take the kernel's
# transposed phase 1 instead, which beats both (csrc/lora_sgmv_cpu.cpp, takes_transposed).
MM_MIN_ROWS = 64
MM_MIN_RANK = 32


def load_extension() -> Any:
    """The kernel's op namespace (built on first use on this machine, ~20 s).

    Raises:
        KernelUnavailable: no source, no compiler / ninja, or the build failed.
    """
    return cpp_build.load(cpp_build.LORA).require()


@functools.lru_cache(maxsize=1)  # a no-argument cache: the per-call check stays ~50 ns
def _ops_or_none() -> Any:
    try:
        return load_extension()
    except cpp_build.KernelUnavailable as exc:
        logger.warning("LoRA: using the slow torch reference kernel: %s", exc)
        return None


def kernel_available() -> bool:
    """Whether `lora_apply` runs the C++ op (building it on first use)."""
    return _ops_or_none() is not None


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    storage_a: torch.Tensor,
    storage_b: torch.Tensor,
    seg_starts: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """y += every segment's LoRA delta, in place (layouts in the module docstring)."""
    lora_apply_slices(y, x, storage_a, storage_b, seg_starts, a_offsets, b_offsets, ranks, scales,
                      [0, 0, y.shape[1]])


def lora_apply_slices(
    y: torch.Tensor,
    x: torch.Tensor,
    storage_a: torch.Tensor,
    storage_b: torch.Tensor,
    seg_starts: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slices: list[int],
) -> None:
    """`lora_apply` for several modules sharing x, each adding into its own columns of y.

    `slices` = [row, first column, end column] per module, columns increasing and disjoint:
    the module's per-segment values are row `row` of the contiguous (..., S) tables, its
    output columns y[:, first:end] (1-D (S,) tables take row 0). One call does a fused
    projection's modules (q/k/v of qkv_proj, gate/up of gate_up_proj) in one parallel
    region: a step makes ~layers x 4 calls instead of x 7, and on this host any op call right
    after a base GEMM costs 20-35 us before it does any work.
    """
    if not kernel_handles(x.dtype, storage_a.dtype, x.device):
        if _ops_or_none() is not None:
            _warn_dtype_fallback(x.dtype, storage_a.dtype, x.device.type)
        for row, start, end in zip(slices[::3], slices[1::3], slices[2::3], strict=True):
            per_seg = [t if t.dim() == 1 else t.reshape(-1, t.shape[-1])[row]
                       for t in (a_offsets, b_offsets, ranks, scales)]
            lora_apply_reference(y[:, start:end], x, storage_a, storage_b, seg_starts, *per_seg)
        return
    _ops_or_none().lora_sgmv(y, x, storage_a, storage_b, seg_starts, a_offsets, b_offsets, ranks, scales,
                             slices, MM_MIN_ROWS, MM_MIN_RANK)


def kernel_handles(dtype: torch.dtype, lora_dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the C++ ops (`lora_apply_slices`' fast path, `LoRASegments.linear`) run for
    activations of `dtype` and adapters of `lora_dtype` on `device` (float32 / bfloat16 on
    the CPU, extension built)."""
    return (device.type == "cpu" and dtype in _KERNEL_DTYPES and lora_dtype in _KERNEL_DTYPES
            and _ops_or_none() is not None)


@functools.cache
def _warn_dtype_fallback(dtype: torch.dtype, lora_dtype: torch.dtype, device: str) -> None:
    logger.warning("LoRA: no C++ kernel for %s activations with %s adapters on %s; using the "
                   "torch reference", dtype, lora_dtype, device)


def lora_apply_reference(
    y: torch.Tensor,
    x: torch.Tensor,
    storage_a: torch.Tensor,
    storage_b: torch.Tensor,
    seg_starts: torch.Tensor,
    a_offsets: torch.Tensor,
    b_offsets: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
) -> None:
    """Same contract as `lora_apply`: a Python loop over segments, fp32 accumulation."""
    in_dim, out_dim = x.shape[1], y.shape[1]
    starts = seg_starts.tolist()
    rows = zip(a_offsets.tolist(), b_offsets.tolist(), ranks.tolist(), scales.tolist(), strict=True)
    for s, (a_off, b_off, rank, scale) in enumerate(rows):
        begin, end = starts[s], starts[s + 1]
        if rank == 0 or begin == end:
            continue
        a = storage_a[a_off : a_off + rank * in_dim].view(rank, in_dim).float()
        b = unpack_lora_b(storage_b[b_off : b_off + b_region_elems(out_dim, rank)], out_dim, rank)
        delta = (x[begin:end].float() @ a.T) @ b.T
        y[begin:end] += (delta * scale).to(y.dtype)


def b_region_elems(out_dim: int, rank: int) -> int:
    """Elements of one packed B: ceil(out_dim / PANEL) panels of (rank, PANEL)."""
    return -(-out_dim // PANEL) * PANEL * rank


def pack_lora_b(lora_b: torch.Tensor) -> torch.Tensor:
    """PEFT's lora_B (out_dim, rank) -> the flat panel layout the kernel reads.

    B^T is cut into panels of PANEL output columns, each (rank, PANEL) row-major, the last
    one zero-padded:

        out cols:   0 ........ 15 | 16 ....... 31 | ... | pad
        panel 0:  k=0 [B[0,0] .. B[15,0]]  panel 1: k=0 [B[16,0] .. B[31,0]]
                  k=1 [B[0,1] .. B[15,1]]           k=1 [B[16,1] .. ]
                  ...                               ...
        B(o, k) at  (o // PANEL) * PANEL * rank + k * PANEL + o % PANEL
    """
    out_dim, rank = lora_b.shape
    panels = -(-out_dim // PANEL)
    bt = torch.nn.functional.pad(lora_b.T, (0, panels * PANEL - out_dim))  # (rank, out_pad)
    return bt.reshape(rank, panels, PANEL).permute(1, 0, 2).reshape(-1)


def unpack_lora_b(packed: torch.Tensor, out_dim: int, rank: int) -> torch.Tensor:
    """Inverse of `pack_lora_b`: (out_dim, rank) float32."""
    panels = -(-out_dim // PANEL)
    packed = packed.float().view(panels, rank, PANEL)
    return packed.permute(0, 2, 1).reshape(panels * PANEL, rank)[:out_dim]


def flat_storage(kv_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(storage_a, storage_b): kv_cache[0] and kv_cache[1] as flat `dtype` views, zero-copy.

    An int8 (or any other dtype) cache is reinterpreted byte for byte, so offsets count
    `dtype` elements: one block holds block_elems(kv_cache, dtype) of them.

    Raises:
        ValueError: the cache is not contiguous, or a block is not a whole number of
            `dtype` elements.
    """
    if not kv_cache.is_contiguous() or kv_cache.dim() < 2 or kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be a contiguous (2, num_blocks, ...) tensor")
    block_elems(kv_cache, dtype)  # divisibility check
    halves = kv_cache.view(2, -1)
    if kv_cache.dtype == dtype:
        return halves[0], halves[1]
    return halves[0].view(dtype), halves[1].view(dtype)


def block_elems(kv_cache: torch.Tensor, dtype: torch.dtype) -> int:
    """LoRA-dtype elements in one KV block of one half (K or V) of `kv_cache`."""
    block_bytes = kv_cache[0, 0].numel() * kv_cache.element_size()
    item = torch.empty((), dtype=dtype).element_size()
    if block_bytes % item:
        raise ValueError(
            f"a KV block of {block_bytes} bytes does not hold a whole number of {dtype} elements"
        )
    return block_bytes // item
