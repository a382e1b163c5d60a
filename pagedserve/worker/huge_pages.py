"""CPU weights and KV cache in transparent huge pages (Linux).

A batch-1 decode step streams every weight from DRAM once, so its speed is the speed of that
stream. In 4 KiB pages the hardware prefetchers stop at every page boundary and every page
costs a TLB entry; in 2 MiB pages one thread's stream runs further ahead (SmolLM2's bf16
layers, read back to back as a decode step does: 15.4 ms in 4 KiB pages, 13.0 ms in 2 MiB
ones on this project's 2-core VM; see BENCHMARKS.md, session 11).

The kernel gives huge pages to anonymous memory that asks for them (`madvise(MADV_HUGEPAGE)`)
when `/sys/kernel/mm/transparent_hugepage/enabled` is `always` or `madvise` (the usual default).
torch's allocator asks only with `THP_MEM_ALLOC_ENABLE=1` set before its first large
allocation, a process-wide switch an engine cannot flip once the caller has allocated
anything. So the model runner copies the weights, once after loading, into a few fresh
anonymous mappings that ask (`move_weights`), and allocates the KV cache the same way
(`zeros`). Where huge pages are unavailable or off (`PAGEDSERVE_HUGE_PAGES=off`) nothing
changes: the same tensors stay in torch's memory.
"""

from __future__ import annotations

import logging
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TypeGuard

import torch
from torch import nn

from pagedserve import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Weights are copied a slab at a time, so loading needs at most this much beyond the model.
SLAB_BYTES = 64 << 20
_ALIGN = 64  # each tensor starts on a cache line


def available() -> bool:
    """Whether anonymous memory here can ask for huge pages: Linux, with transparent huge
    pages set to `always` or `madvise`, and not turned off by PAGEDSERVE_HUGE_PAGES."""
    if envs.huge_pages() == "off" or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def empty_bytes(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` whose data starts on a 2 MiB boundary, in a
    fresh anonymous mapping that asks for huge pages (given as its pages are first touched).
    The tensor keeps the mapping alive; freeing the tensor unmaps it."""
    # Whole huge pages from a 2 MiB boundary on (the last one's tail is never touched; a huge
    # page holds it anyway). Private: a shared anonymous mapping is shmem, whose huge pages
    # follow another setting.
    length = (nbytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    mapping = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE  # mmap returns page-aligned memory: a multiple of 4 KiB
    mapping.madvise(mmap.MADV_HUGEPAGE, start, length)
    return whole[start:start + nbytes]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros(shape, dtype, device), in huge pages where that is on and the device is the CPU."""
    if device.type != "cpu" or not available():
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return empty_bytes(nbytes).zero_().view(dtype).view(shape)


def _movable(t: torch.Tensor | None) -> TypeGuard[torch.Tensor]:
    """A plain CPU tensor that is its storage, whole: copying it elsewhere cannot break a
    view (tensors sharing part of a storage, and oneDNN's opaque tensors, stay put)."""
    return (
        t is not None and t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn
        and t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes
        and t.nbytes > 0
    )


def _weights(model: nn.Module) -> Iterator[torch.Tensor | None]:
    """Every parameter and buffer of `model`, in module order (a decode step's read order)."""
    for module in model.modules():
        yield from module._parameters.values()
        yield from module._buffers.values()


def move_weights(model: nn.Module) -> int:
    """Moves `model`'s movable parameters and buffers (see `_movable`) into huge-page slabs of
    up to SLAB_BYTES, in place: each tensor object keeps its identity (`t.data` is swapped),
    so modules, tied weights and anything else holding it see the new memory. Returns the
    bytes moved (0 where huge pages are unavailable)."""
    if not available():
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    for t in _weights(model):
        if _movable(t):
            group = by_storage.setdefault(t.untyped_storage().data_ptr(), [])
            if not any(other is t for other in group):
                group.append(t)
    moved = 0
    batch: list[list[torch.Tensor]] = []
    batch_bytes = 0
    for group in by_storage.values():
        size = (group[0].nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if batch and batch_bytes + size > SLAB_BYTES:
            moved += _copy_into_slab(batch, batch_bytes)
            batch, batch_bytes = [], 0
        batch.append(group)
        batch_bytes += size
    if batch:
        moved += _copy_into_slab(batch, batch_bytes)
    logger.info("weights in huge pages: %.1f MiB", moved / 2**20)
    return moved


def _copy_into_slab(groups: list[list[torch.Tensor]], nbytes: int) -> int:
    """Copies each group's storage (the tensors of one storage) into one new slab."""
    slab = empty_bytes(nbytes)
    offset = 0
    for group in groups:
        first = group[0]
        region = slab[offset:offset + first.nbytes]
        region.copy_(first.detach().reshape(-1).view(torch.uint8))
        for t in group:  # every alias of the storage, each with its own dtype and shape
            t.data = region.view(t.dtype).view(t.shape)
        offset += (first.nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return offset
