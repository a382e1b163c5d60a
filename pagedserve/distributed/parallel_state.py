"""Tensor parallelism's process group, as the model's layers see it.

A `TPGroup` is this process's rank in one tensor-parallel group and the two collectives the
layers need: `all_reduce` (row-parallel outputs, vocabulary-parallel embedding lookups) and
`gather_to_first` (the LM head's vocabulary shards, to rank 0, the only rank that samples).
With size 1 both are the identity and no process group exists, so the single-process path
runs exactly as before.

Layers read the group once, while the model is built, from `tensor_parallel(group)` (a context
manager that always resets; model constructors keep Hugging Face's `cls(config)` signature):

    with tensor_parallel(group):        # ModelRunner -> loader.load_model
        model = LlamaForCausalLM(config) # each parallel layer stores current_tp()

The process group is a torch.distributed `ProcessGroupGloo` (CPU) or `ProcessGroupNCCL`
(CUDA) built directly from a TCP store, not the process-wide default group: several engines
(tests, a draft model beside a target) can then live in one process.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


class TensorParallelError(RuntimeError):
    """A collective failed: a rank died or timed out. The engine cannot go on."""


@dataclass(slots=True)
class CommStats:
    """Seconds spent in collectives (and in broadcasting steps, filled by the rank-0 driver)."""

    all_reduce_s: float = 0.0
    gather_s: float = 0.0
    broadcast_s: float = 0.0
    num_all_reduce: int = 0
    num_gather: int = 0
    num_broadcast: int = 0

    def total_s(self) -> float:
        return self.all_reduce_s + self.gather_s + self.broadcast_s


@dataclass(slots=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    pg: Any = None  # the torch.distributed process group; None when size == 1
    stats: CommStats = field(default_factory=CommStats)
    # Timing every collective costs two perf_counter calls; on only for the benchmark.
    timed: bool = False

    def shard_range(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` (which `size` divides)."""
        per = total // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        if self.size == 1:
            return tensor
        start = time.perf_counter() if self.timed else 0.0
        try:
            self.pg.allreduce([tensor]).wait()
        except RuntimeError as exc:
            raise TensorParallelError(f"tensor-parallel all-reduce failed on rank {self.rank}: {exc}") from exc
        if self.timed:
            self.stats.all_reduce_s += time.perf_counter() - start
            self.stats.num_all_reduce += 1
        return tensor

    def gather_to_first(self, shard: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's `shard` concatenated along the last dim; other ranks: None."""
        if self.size == 1:
            return shard
        start = time.perf_counter() if self.timed else 0.0
        options = dist.GatherOptions()
        options.rootRank = 0
        shard = shard.contiguous()
        outputs = [[torch.empty_like(shard) for _ in range(self.size)]] if self.rank == 0 else []
        try:
            self.pg.gather(outputs, [shard], options).wait()
        except RuntimeError as exc:
            raise TensorParallelError(f"tensor-parallel gather failed on rank {self.rank}: {exc}") from exc
        if self.timed:
            self.stats.gather_s += time.perf_counter() - start
            self.stats.num_gather += 1
        return torch.cat(outputs[0], dim=-1) if self.rank == 0 else None


SINGLE = TPGroup()


def create_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
) -> TPGroup:
    """Joins the group (blocks until every rank has joined, at most `timeout_s`): gloo on
    CPU, NCCL on CUDA, the backend picked by the device as in vLLM."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore("pagedserve-tp", store)
    if device.type == "cuda":
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, dist.ProcessGroupNCCL.Options())
    else:
        pg = dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    return TPGroup(rank, size, pg)


_current: ContextVar[TPGroup] = ContextVar("pagedserve_tp_group", default=SINGLE)


@contextlib.contextmanager
def tensor_parallel(group: TPGroup | None) -> Iterator[None]:
    """Parallel layers built inside take `group` (None: a single rank)."""
    token = _current.set(group or SINGLE)
    try:
        yield
    finally:
        _current.reset(token)


def current_tp() -> TPGroup:
    """The group of the model being built (the single-rank group outside `tensor_parallel`)."""
    return _current.get()


def check_tensor_parallel_size(hf_config: Any, tp_size: int) -> None:
    """ValueError naming `tensor_parallel_size` when it cannot split this model's heads and
    MLP evenly. KV heads: split when tp divides them, replicated when tp is a multiple."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    heads = int(hf_config.num_attention_heads)
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    inner = getattr(hf_config, "intermediate_size", None) or getattr(hf_config, "ffn_dim", None) \
        or getattr(hf_config, "n_inner", None) or 4 * int(hf_config.hidden_size)
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide num_attention_heads={heads}")
    if kv_heads % tp_size and tp_size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} neither divides nor is a multiple of "
            f"num_key_value_heads={kv_heads}")
    if int(inner) % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the MLP's intermediate size {inner}")
