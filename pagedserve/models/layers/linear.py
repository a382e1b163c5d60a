"""Linear layers with per-class weight loaders, tensor-parallel where the model splits.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)` so the loader
never needs to know a layer's internals. How the weight is stored and multiplied belongs to
the layer's `quant_method` (pagedserve/quantization/base.py): it registers the weight
(`create_weights`), may repack it once loaded (`process_weights_after_loading`, e.g. to int8)
and computes the base output x W^T + b (`apply`); `forward` is exactly that base output, so
a LoRA wrapper adds its delta on top of any quantized or unquantized base. Every layer exposes `output_sizes` (one entry per logical
projection, in order along the output dim; a single entry unless fused), and fused layers
`shard_ids` and `shard_slice(shard_id)`, so per-projection LoRA can find each slice:

    QKVParallelLinear.weight          (q_size + 2 * kv_size, in)   rows: | q | k | v |
    MergedColumnParallelLinear.weight (sum(output_sizes), in)      rows: | gate | up |  (shards 0, 1)

Tensor parallelism (vLLM's layers and names; `tp` = the group current while the model is
built, see distributed/parallel_state.py). `input_size` / `output_size` / `output_sizes` are
this rank's, so quantization methods see an ordinary (smaller) layer and quantize the shard:

    ColumnParallelLinear   W rows split: rank r holds output rows [r*out/tp, (r+1)*out/tp),
                           its output is this rank's slice (no communication)
    Merged... / QKV...     every logical projection split the same way, so rank r holds
                           | gate_r | up_r | or | q heads_r | k heads_r | v heads_r |
                           (KV heads replicated when there are fewer than ranks)
    RowParallelLinear      W columns split: rank r multiplies its input slice, one all-reduce
                           sums the partial outputs; the bias counts once (rank 0's)

The loaders narrow the full checkpoint tensor to this rank's shard, so any checkpoint loads
at any tp size. With one rank every class is the plain layer it was before.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from pagedserve.distributed.parallel_state import TPGroup, current_tp
from pagedserve.quantization.base import UNQUANTIZED, LinearMethod


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded_weight.shape)}"
        )
    with torch.no_grad():
        param.copy_(loaded_weight)


class LinearBase(nn.Module):
    """y = x W^T (+ b). Weights are left uninitialised: they always come from a checkpoint.

    The bias always stays full precision (owned here); the weight belongs to `quant_method`.
    """

    shard_ids: list[Hashable] | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # Output rows per logical projection, in order (one entry unless fused).
        self.output_sizes = [output_size]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)
        # Full precision until the loader attaches a quantization method (set_quant_method).
        self.quant_method: LinearMethod = UNQUANTIZED
        self.quant_method.create_weights(self)

    def set_quant_method(self, method: LinearMethod) -> None:
        """Before loading: hand the (still uninitialised) weight over to another method."""
        for name, _ in list(self.named_parameters(recurse=False)):
            if name != "bias":
                delattr(self, name)
        self.quant_method = method
        method.create_weights(self)
        self._tag_shards()

    def _tag_shards(self) -> None:
        # Fused layers: the loader checks that every shard of every parameter arrived.
        if self.shard_ids is not None:
            for p in self.parameters(recurse=False):
                p.shard_ids = tuple(self.shard_ids)  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base output x W^T + b (..., output_size); adapters add their delta to it."""
        return self.quant_method.apply(self, x)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"quant={self.quant_method.name}"
        )


class ReplicatedLinear(LinearBase):
    """A projection every rank holds whole (OPT's project_in / project_out)."""

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard, got {shard_id!r}")
        default_weight_loader(param, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """y_r = x W_r^T + b_r: rank r holds output rows [r*out/tp, (r+1)*out/tp) of W and b.

    Its callers use the output slice as it is (heads, MLP columns); nothing is gathered.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp: TPGroup = current_tp()
        if output_size % self.tp.size:
            raise ValueError(
                f"tensor_parallel_size={self.tp.size} does not divide output size {output_size}")
        super().__init__(input_size, output_size // self.tp.size, bias)

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard, got {shard_id!r}")
        default_weight_loader(param, _narrow_rows(loaded_weight, param.shape[0], self.tp.rank, self.tp.size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input fused along the output dim (gate_up_proj).

    Checkpoint shard i (full size `output_sizes[i]`) is narrowed to this rank's slice and
    loaded into rows [sum(sizes[:i]), sum(sizes[:i+1])) of the per-rank sizes.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        bias: bool = False,
        shard_ids: Sequence[Hashable] | None = None,
    ) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        for size in output_sizes:
            if size % self.tp.size:
                raise ValueError(
                    f"tensor_parallel_size={self.tp.size} does not divide projection size {size}")
        self.output_sizes = [size // self.tp.size for size in output_sizes]
        self.shard_ids = (
            list(shard_ids) if shard_ids is not None else list(range(len(output_sizes)))
        )
        self._tag_shards()

    def shard_slice(self, shard_id: Hashable) -> slice:
        """Output rows of one shard (this rank's), e.g. for a per-projection LoRA."""
        i = self.shard_ids.index(shard_id)
        start = sum(self.output_sizes[:i])
        return slice(start, start + self.output_sizes[i])

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(
                f"{type(self).__name__}: unknown shard {shard_id!r}, expected one of {self.shard_ids}"
            )
        rows = self.shard_slice(shard_id)
        part = self._rank_part(shard_id, loaded_weight, rows.stop - rows.start)
        default_weight_loader(param[rows], part)

    def _rank_part(self, shard_id: Hashable, loaded: torch.Tensor, rows: int) -> torch.Tensor:
        return _narrow_rows(loaded, rows, self.tp.rank, self.tp.size)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q_proj, k_proj, v_proj fused; shards "q", "k", "v"; heads split across ranks.

    `num_heads` / `num_kv_heads` are this rank's. With fewer KV heads than ranks each KV head
    is replicated on tp / total_kv_heads consecutive ranks (rank r holds KV head
    r // (tp / total_kv_heads)), so every rank's query heads find their KV head locally.
    """

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = current_tp()
        if num_heads % tp.size or (num_kv_heads % tp.size and tp.size % num_kv_heads):
            raise ValueError(
                f"tensor_parallel_size={tp.size} cannot split {num_heads} query / "
                f"{num_kv_heads} KV heads")
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        # Ranks sharing one KV head (1 unless KV heads are replicated).
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        # Full sizes: the parent divides each by tp; replicated KV shards are widened back.
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        if self.kv_replicas > 1:
            sizes = [num_heads * head_dim, tp.size * head_dim, tp.size * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_ids=["q", "k", "v"])

    def _rank_part(self, shard_id: Hashable, loaded: torch.Tensor, rows: int) -> torch.Tensor:
        if shard_id == "q":
            return _narrow_rows(loaded, rows, self.tp.rank, self.tp.size)
        parts = self.tp.size // self.kv_replicas
        return _narrow_rows(loaded, rows, self.tp.rank // self.kv_replicas, parts)


class RowParallelLinear(LinearBase):
    """y = sum_r x_r W_r^T + b: rank r holds input columns [r*in/tp, (r+1)*in/tp) of W and
    takes the matching slice of x (what the column-parallel layer before it produced).

    One all-reduce sums the partial products. The bias is added once: ranks other than 0
    load it as zeros, so each rank's `quant_method.apply` (which adds the bias, possibly
    fused in its kernel) stays the single-rank code path.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.tp: TPGroup = current_tp()
        if input_size % self.tp.size:
            raise ValueError(
                f"tensor_parallel_size={self.tp.size} does not divide input size {input_size}")
        self.total_input_size = input_size
        super().__init__(input_size // self.tp.size, output_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., input_size / tp) -> (..., output_size), summed over the ranks."""
        return self.tp.all_reduce(self.quant_method.apply(self, x))

    def weight_loader(
        self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Hashable | None = None
    ) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard, got {shard_id!r}")
        if loaded_weight.dim() == 1:  # the bias: rank 0's only
            default_weight_loader(param, loaded_weight if self.tp.rank == 0 else torch.zeros_like(loaded_weight))
            return
        default_weight_loader(param, _narrow_cols(loaded_weight, param.shape[1], self.tp.rank, self.tp.size))


def _narrow_rows(loaded: torch.Tensor, rows: int, index: int, parts: int) -> torch.Tensor:
    """Part `index` of `parts` equal row blocks of a checkpoint tensor (`rows` rows each)."""
    if parts == 1:
        return loaded  # one rank: the whole tensor (default_weight_loader checks its shape)
    if loaded.shape[0] != rows * parts:
        raise ValueError(f"shape mismatch: {parts} shards of {rows} rows, checkpoint {tuple(loaded.shape)}")
    return loaded.narrow(0, index * rows, rows)


def _narrow_cols(loaded: torch.Tensor, cols: int, index: int, parts: int) -> torch.Tensor:
    """Part `index` of `parts` equal column blocks of a 2-D checkpoint tensor."""
    if parts == 1:
        return loaded
    if loaded.dim() != 2 or loaded.shape[1] != cols * parts:
        raise ValueError(f"shape mismatch: {parts} shards of {cols} columns, checkpoint {tuple(loaded.shape)}")
    return loaded.narrow(1, index * cols, cols)
