"""The model runner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It is the only place that builds tensors for a step. Per step:

    schedule -> token ids, positions, slot mapping, block tables, query starts   (host lists -> tensors)
             -> attention metadata (backend-specific, built once, shared by all layers)
             -> model forward over the flat batch -> logits for the rows due a token
             -> sampler -> one .tolist() at the end

Tensor parallelism: rank 0's runner (in the engine process) hands every step's plain-data
inputs (`StepBatch`, block copies) and each LM-head call's rows to the other ranks through
`tp_workers` (distributed/tp_workers.py) before running them itself; ranks > 0 run
`execute_worker_step` (worker/tp_worker.py). Only rank 0 samples.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedserve import envs
from pagedserve.attention.backend import AttentionBackend, AttentionMetadata
from pagedserve.attention.grouped import GroupedAttentionBackend
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.attention.selector import get_attention_backend
from pagedserve.compilation.config import CompilationConfig
from pagedserve.compilation.decode import CompiledDecode, build_compiled_decode
from pagedserve.core.kv_groups import KVGroupPlan, plan_kv_groups
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.distributed.parallel_state import SINGLE
from pagedserve.lora.kernels import block_elems
from pagedserve.lora.layers import bind_lora_layers, lora_step, wrap_model_for_lora
from pagedserve.lora.layout import AdapterLayout, write_adapter
from pagedserve.lora.peft_loader import TARGETABLE, LoRAAdapter
from pagedserve.lora.segments import LoRASegments, ResidentAdapter, build_segments
from pagedserve.lora.tp import shard_adapter
from pagedserve.models.decoder_loop import DecoderLoop
from pagedserve.models.layers.attention import Attention
from pagedserve.models.loader import load_model
from pagedserve.quantization import QuantizationConfig
from pagedserve.sample.input_builder import build_sampling_metadata
from pagedserve.sample.sampler import Sampler, SamplerOutput, gather_logprobs_into
from pagedserve.spec_decode.rejection_sampler import accepted_runs, rejection_sample
from pagedserve.worker import huge_pages
from pagedserve.worker.kv_cache import KVCacheSpec, allocate_kv_caches, kv_cache_torch_dtype
from pagedserve.worker.prompt_logprobs import (
    PromptLogprobs,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
    split_prompt_logprobs,
)

if TYPE_CHECKING:
    from pagedserve.core.sched_output import ScheduledRequest
    from pagedserve.distributed.parallel_state import TPGroup
    from pagedserve.distributed.tp_workers import TPWorkers
    from pagedserve.engine.faults import FaultInjector
    from pagedserve.sample.metadata import SamplingMetadata

logger = logging.getLogger(__name__)


TokenLogprobs = tuple[list[int], list[float], list[int]]
# (the step's schedule, forward(LoRA segments) -> hidden states) -> the hidden states to use.
ForwardHook = Callable[[SchedulerOutput, Callable[[LoRASegments | None], torch.Tensor]], torch.Tensor]


def _attention_backend(device: torch.device, kv_dtype: torch.dtype) -> AttentionBackend:
    """The device's backend; with an int8 KV cache, one that supports it (`supports_kv_int8`):
    an automatically chosen backend that does not is swapped for the torch one, a forced one
    (PAGEDSERVE_ATTENTION_BACKEND) is refused."""
    backend = get_attention_backend(device)
    if kv_dtype != torch.int8 or getattr(backend, "supports_kv_int8", False):
        return backend
    if envs.attention_backend() is None:
        from pagedserve.attention.torch_paged import TorchPagedAttentionBackend

        logger.info("kv_cache_dtype='int8': using the torch_paged attention backend (%s has "
                    "no int8 KV path)", backend.name)
        return TorchPagedAttentionBackend(device=device)
    raise ValueError(
        f"kv_cache_dtype='int8' is not supported by the {backend.name!r} attention backend "
        "(PAGEDSERVE_ATTENTION_BACKEND); use kv_cache_dtype='auto' or the torch backend"
    )


@dataclass(slots=True)
class StepBatch:
    """A step's flat inputs as host lists: what `_batch_tensors` turns into tensors (and
    what rank 0 sends the other tensor-parallel ranks)."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    logits_indices: list[int]
    # Per request: each KV group's table padded with block 0 to the longest, back to back.
    block_tables: list[list[int]]


# Per scheduled request: (tokens this step, where its adapter lives or None).
LoRARuns = list[tuple[int, ResidentAdapter | None]]
# (swap out, swap in, copy) block pairs, applied in that order before the forward.
BlockOps = tuple[list[tuple[int, int]], list[tuple[int, int]], list[tuple[int, int]]]


@dataclass(slots=True)
class ModelRunnerOutput:
    # One entry per scheduled request, in schedule order: the sampled token, or None.
    sampled_token_ids: list[int | None]
    # Per scheduled request: (token ids, logprobs, ranks) with the chosen token first, or None.
    logprobs: list[TokenLogprobs | None]
    # Per scheduled request: first tokens (and logprobs) of its `fork_requests`, in order.
    fork_token_ids: list[list[int]] = field(default_factory=list)
    fork_logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)
    # Scheduled requests whose own preparation failed (request id -> why): they sampled
    # nothing, nor did their `fork_requests`; the engine ends them with finish_reason "error".
    failed: dict[str, str] = field(default_factory=dict)
    # Speculative decoding, per scheduled request: the tokens after `sampled_token_ids`
    # that its verified proposals gave, and their logprobs; empty lists otherwise.
    extra_token_ids: list[list[int]] = field(default_factory=list)
    extra_logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)
    # Seconds this step spent building inputs, in the model (forward + LM head) and sampling
    # (metadata, sampler, the host sync and these lists); CPU ops are synchronous, so
    # perf_counter around them measures them. Read by the engine's per-step stats.
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    # Per scheduled request: the prompt logprobs this step's chunk yields, or None (or empty
    # when no request asked for any).
    prompt_logprobs: list[PromptLogprobs | None] = field(default_factory=list)
    # Per scheduled request: its embedding (pooling requests whose prompt ended this step).
    pooled: list[list[float] | None] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        *,
        quantization: QuantizationConfig | None = None,
        kv_cache_dtype: str = "auto",
        lora_dtype: torch.dtype | None = None,
        faults: FaultInjector | None = None,
        tp_group: TPGroup | None = None,
        tp_workers: TPWorkers | None = None,
        compilation: CompilationConfig | None = None,
        gguf_blocks: bool = True,
    ) -> None:
        """`tp_group`: this rank's tensor-parallel group (None: one rank); `tp_workers`: on
        rank 0, the other ranks' processes, sent every step; `gguf_blocks`: False dequantizes a
        quantized .gguf file at load (quantization='none')."""
        self.device = device
        self.tp_group = tp_group or SINGLE
        self.tp_workers = tp_workers
        self.faults = faults
        self.dtype = dtype
        self.block_size = block_size
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        self.backend = _attention_backend(device, self.kv_dtype)
        self.model, self.hf_config = load_model(model_path, dtype, device, quantization, tp_group, gguf_blocks)
        self.model.eval()
        if device.type == "cpu":
            huge_pages.move_weights(self.model)  # before anything captures a weight tensor
        self.attn_layers = sorted(
            (m for m in self.model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
        )
        # Which layers share a block table (core/kv_groups.py); one group without windows.
        self.kv_groups: KVGroupPlan = plan_kv_groups([layer.sliding_window for layer in self.attn_layers])
        self.grouped_backend: GroupedAttentionBackend | None = None
        self.vocab_size = int(self.hf_config.vocab_size)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] = []
        self.generators: dict[str, torch.Generator] = {}
        # LoRA: wrappers around the projections (weights already loaded by name); where each
        # adapter lives comes with every step's schedule (`SchedulerOutput.lora_adapters`).
        # lora_dtype None: LoRA off.
        self.lora_dtype = lora_dtype
        self.lora_layers = wrap_model_for_lora(self.model) if lora_dtype is not None else []
        self._forward_hook: ForwardHook | None = None
        # Decode steps through torch.compile (compilation_config level 3), compiled now.
        self.compiled: CompiledDecode | None = None
        if compilation is not None and compilation.enabled:
            self.compiled = build_compiled_decode(
                self.model, compilation.compile_sizes, device, dict(compilation.inductor_compile_config))
        # Small eager steps: the decoder layers in one C++ call where the model allows it.
        self.decoder_loop = None if self.compiled is not None else DecoderLoop.build(
            self.model, self.backend, self.kv_dtype, dtype, device, self.tp_group.size)

    def _run_model(
        self, input_ids: torch.Tensor, positions: torch.Tensor, common: CommonAttentionMetadata,
        attn_metadata: AttentionMetadata, lora_segments: LoRASegments | None = None,
    ) -> torch.Tensor:
        """The step's forward: the compiled decode graph or the C++ decoder loop when one takes
        the step, else the eager model."""
        if self.compiled is not None and self.compiled.takes(common.num_tokens, common.max_query_len):
            hidden = self.compiled(input_ids, positions, attn_metadata, self.kv_caches)
            if hidden is not None:
                return hidden
        adapter_tokens = lora_segments is not None and lora_segments.num_segments > 0
        if self.decoder_loop is not None and self.decoder_loop.takes(common.num_tokens, attn_metadata, adapter_tokens):
            return self.model(input_ids, positions, attn_metadata, layer_stack=self.decoder_loop)
        return self.model(input_ids, positions, attn_metadata)

    def kv_cache_spec(self) -> KVCacheSpec:
        first = self.attn_layers[0]
        return KVCacheSpec(
            # A block is one page of `page_layers` layers (every layer without windows).
            num_layers=self.kv_groups.page_layers,
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            block_size=self.block_size,
            dtype=self.kv_dtype,
        )

    def initialize_swap_space(self, num_blocks: int) -> None:
        """Host tensors mirroring the KV layout, for swapped-out blocks.

        Not zeroed: a swap block is only read after a swap-out wrote it, and untouched
        pages cost no memory.
        """
        if self.tp_workers is not None:
            self.tp_workers.send(("swap_space", num_blocks))
        spec = self.kv_cache_spec()
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.last_dim)
        pin = self.device.type == "cuda"
        self.swap_caches = [
            torch.empty(shape, dtype=spec.dtype, pin_memory=pin) for _ in range(spec.num_layers)
        ] if num_blocks > 0 else []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Every rank's cache gets the same block ids: the scheduler's ids index them all."""
        if self.tp_workers is not None:
            self.tp_workers.send(("kv_cache", num_blocks))
        self.kv_caches = allocate_kv_caches(self.kv_cache_spec(), num_blocks, self.device)
        if self.kv_groups.hybrid:
            self._bind_grouped_caches()
            return
        for layer, cache in zip(self.attn_layers, self.kv_caches, strict=True):
            layer.kv_cache = cache
        if self.lora_dtype is not None:
            bind_lora_layers(self.lora_layers, self.kv_caches, self.lora_dtype)
        if self.decoder_loop is not None:
            self.decoder_loop.bind(self.kv_caches)

    def _bind_grouped_caches(self) -> None:
        """Windowed layers: layer i of every KV group shares cache tensor i; each layer gets
        its own view, whose identity tells the grouped backend the layer's group."""
        if self.lora_dtype is not None:
            # Adapter runs are the pool's blocks in no group's table (lora/layout.py).
            bind_lora_layers(self.lora_layers, self.kv_caches, self.lora_dtype)
        cache_groups: dict[int, int] = {}
        for index, layer in enumerate(self.attn_layers):
            group, slot = self.kv_groups.placement(index)
            view = self.kv_caches[slot].view(self.kv_caches[slot].shape)
            layer.kv_cache = view
            cache_groups[id(view)] = group
        self.grouped_backend = GroupedAttentionBackend(self.backend, cache_groups)

    def _attn_metadata(self, commons: list[CommonAttentionMetadata]) -> AttentionMetadata:
        """The step's metadata: the backend's own, or one per KV group with windowed layers."""
        if self.grouped_backend is not None:
            return self.grouped_backend.build_grouped(commons)
        return self.backend.build_metadata(commons[0])

    def lora_block_elems(self) -> int:
        """LoRA-dtype elements one KV block holds in each half (K or V) of a layer's cache."""
        return block_elems(self.kv_caches[0], self.lora_dtype)

    def write_adapter(self, adapter: LoRAAdapter, layout: AdapterLayout, first_block: int) -> None:
        """Copies an adapter's weights (this rank's part; every rank's with tensor
        parallelism) into its run of KV blocks, in every layer."""
        if self.tp_workers is not None:
            self.tp_workers.send(("adapter", adapter, layout, first_block))
        write_adapter(self.lora_shard(adapter), layout, self.kv_caches, first_block, self.lora_dtype)

    def lora_shard(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """This rank's part of an adapter (lora/tp.py); the adapter itself with one rank."""
        kv_heads = self.kv_cache_spec().num_kv_heads * self.tp_group.size  # KV heads over all ranks
        total = getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads
        return shard_adapter(adapter, self.tp_group, kv_heads // total)

    def set_forward_hook(self, hook: ForwardHook | None) -> None:
        """Benchmarks and tests: `hook(sched, forward)` runs in place of each step's model
        forward (None removes it). `forward(segments)` runs the model once on the step's
        inputs with those LoRA segments (`lora_segments(sched)`: the step's own) and returns
        its hidden states; the hook returns the hidden states the step goes on with."""
        if hook is not None and self.tp_workers is not None:
            # The other ranks run exactly one forward per step, in lockstep with this one.
            raise ValueError("forward hooks are not supported with tensor_parallel_size > 1")
        self._forward_hook = hook

    def lora_segments(self, sched: SchedulerOutput) -> LoRASegments | None:
        """The step's LoRA segment tables (one segment per adapter run), or None."""
        return self.segments_for(self._lora_runs(sched))

    @staticmethod
    def _lora_runs(sched: SchedulerOutput) -> LoRARuns | None:
        if not sched.lora_adapters:
            return None
        return [
            (item.num_new_tokens, sched.lora_adapters[item.request.lora_id] if item.request.lora_id else None)
            for item in sched.scheduled
        ]

    def segments_for(self, runs: LoRARuns | None) -> LoRASegments | None:
        return None if runs is None else build_segments(runs, len(self.attn_layers), len(TARGETABLE))

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_ids:
            self.generators.pop(request_id, None)
        start = time.perf_counter()
        blocks: BlockOps = (sched.blocks_to_swap_out, sched.blocks_to_swap_in, sched.blocks_to_copy)
        batch = None if sched.is_empty else self._step_batch(sched, num_groups=self.kv_groups.num_groups)
        if self.tp_workers is None:
            return self._execute(sched, blocks, batch, start)
        self.tp_workers.send(("step", blocks, batch, self._lora_runs(sched)))
        try:
            out = self._execute(sched, blocks, batch, start)
        except BaseException:
            # A step that fails as a whole leaves the ranks out of step (some may sit in a
            # collective): the engine is dead, so its workers go now, not at the timeout.
            self.tp_workers.shutdown()
            raise
        self.tp_workers.send(("step_done",))
        return out

    def _execute(
        self, sched: SchedulerOutput, blocks: BlockOps, batch: StepBatch | None, start: float
    ) -> ModelRunnerOutput:
        self._apply_block_ops(blocks)
        if batch is None:
            return ModelRunnerOutput([], [])
        input_ids, positions, commons, logits_indices = self._batch_tensors(batch)
        common, attn_metadata = commons[0], self._attn_metadata(commons)
        if self._forward_hook is None:
            lora_segments = self.lora_segments(sched)
            prepared = time.perf_counter()
            with lora_step(lora_segments):
                hidden = self._run_model(input_ids, positions, common, attn_metadata, lora_segments)
        else:
            prepared = time.perf_counter()

            def forward(segments: LoRASegments | None) -> torch.Tensor:
                with lora_step(segments):
                    return self.model(input_ids, positions, attn_metadata)

            hidden = self._forward_hook(sched, forward)
        plan = plan_prompt_logprobs(sched, self.vocab_size)
        prompt_lp = compute_prompt_logprobs(
            plan, lambda rows: self._logits(hidden, rows), hidden.device) if plan else None
        pooled = self._pool(sched, hidden, logits_indices)
        out = self._sample_step(sched, hidden, logits_indices, start, prepared)
        out.pooled = pooled
        if plan is not None and prompt_lp is not None:
            lists = (prompt_lp[0].tolist(), prompt_lp[1].tolist(), prompt_lp[2].tolist())
            out.prompt_logprobs = split_prompt_logprobs(sched, plan, lists, self.vocab_size)
        return out

    @staticmethod
    def _pool(sched: SchedulerOutput, hidden: torch.Tensor, logits_indices: torch.Tensor) -> list[list[float] | None]:
        """Embeddings of the pooling requests whose prompt ends this step: the hidden state at
        their last prompt token (their logits row), L2-normalized if asked."""
        wanted: list[tuple[int, int]] = []  # (scheduled index, logits row)
        row = 0
        for index, item in enumerate(sched.scheduled):
            if not item.sample:
                continue
            if item.request.pooling is not None:
                wanted.append((index, row))
            row += item.num_logits_rows
        if not wanted:
            return []
        rows = logits_indices[torch.tensor([r for _, r in wanted], device=logits_indices.device)]
        vectors = hidden[rows].float()
        normalize = torch.tensor([sched.scheduled[i].request.pooling.normalize for i, _ in wanted],  # type: ignore[union-attr]
                                 device=vectors.device)
        vectors = torch.where(normalize[:, None], torch.nn.functional.normalize(vectors, dim=-1), vectors)
        pooled: list[list[float] | None] = [None] * len(sched.scheduled)
        for (index, _), vector in zip(wanted, vectors.tolist(), strict=True):
            pooled[index] = vector
        return pooled

    def _sample_step(
        self, sched: SchedulerOutput, hidden: torch.Tensor, logits_indices: torch.Tensor, start: float,
        prepared: float,
    ) -> ModelRunnerOutput:
        """Logits at the sampling rows, then a draw (or a verification of proposals)."""
        if not any(item.sample for item in sched.scheduled):
            nothing = [None] * len(sched.scheduled)
            out = ModelRunnerOutput(nothing, list(nothing), [[] for _ in nothing], [[] for _ in nothing])
            return self._timed(out, start, prepared, time.perf_counter(), 0.0)
        forwarded = time.perf_counter()
        meta, logits_indices, failed = self._sampling_inputs(sched, logits_indices)
        if meta is None:  # every sampling request failed
            return self._timed(self._to_output(sched, None, failed), start, prepared, forwarded, 0.0)
        head_start = time.perf_counter()
        logits = self._logits(hidden, logits_indices)
        head_s = time.perf_counter() - head_start
        if any(item.spec_token_ids for item in sched.scheduled if item.request.request_id not in failed):
            return self._timed(self._verify(sched, logits, meta, failed), start, prepared, forwarded, head_s)
        sampled = self.sampler(logits, meta)
        return self._timed(self._to_output(sched, sampled, failed), start, prepared, forwarded, head_s)


    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """(len(rows), vocab) float32 logits at those rows of the step's hidden states; with
        tensor parallelism the other ranks compute their vocabulary slices of the same rows."""
        if self.tp_workers is not None:
            self.tp_workers.send(("logits", rows.tolist()))
        return self.model.compute_logits(hidden[rows])

    def execute_worker_step(
        self, blocks: BlockOps, batch: StepBatch | None, lora_runs: LoRARuns | None
    ) -> torch.Tensor | None:
        """Ranks > 0: the step rank 0 sent: its block copies, then the forward in lockstep
        with rank 0's (the collectives inside pair up). Returns the hidden states, which the
        LM-head calls of the step read."""
        self._apply_block_ops(blocks)
        if batch is None:
            return None
        input_ids, positions, commons, _ = self._batch_tensors(batch)
        attn_metadata = self._attn_metadata(commons)
        with lora_step(self.segments_for(lora_runs)):
            return self.model(input_ids, positions, attn_metadata)

    def _apply_block_ops(self, blocks: BlockOps) -> None:
        swap_out, swap_in, copy = blocks
        # Order matters: a block swapped out may be reused by a swap-in or a CoW copy.
        if swap_out:
            self._copy_blocks(swap_out, self.kv_caches, self.swap_caches)
        if swap_in:
            self._copy_blocks(swap_in, self.swap_caches, self.kv_caches)
        if copy:
            self._copy_blocks(copy, self.kv_caches, self.kv_caches)

    @staticmethod
    def _timed(
        out: ModelRunnerOutput, start: float, prepared: float, forwarded: float, head_s: float
    ) -> ModelRunnerOutput:
        """Fills the step's timings: the LM head (`head_s`) counts as model time."""
        out.prepare_s = prepared - start
        out.forward_s = forwarded - prepared + head_s
        out.sample_s = time.perf_counter() - forwarded - head_s
        return out

    def _build_sampling(self, items: list[ScheduledRequest]) -> SamplingMetadata:
        # One logits row per sampling request, then one per sibling it forks (same row).
        # A request verifying k proposals has k + 1 rows (spec_decode/rejection_sampler.py).
        rows = [
            r for item in items
            for r in (item.request, *item.fork_requests, *[item.request] * len(item.spec_token_ids))
        ]
        # Row j of a verifying request comes after its first j proposals (grammar masks).
        proposed = [
            prefix for item in items
            for prefix in ([[]] * (1 + len(item.fork_requests))
                           + [item.spec_token_ids[:j] for j in range(1, len(item.spec_token_ids) + 1)])
        ] if any(item.spec_token_ids for item in items) else None
        if self.faults is not None:
            for request in rows:
                self.faults.check("sampling_inputs", request.request_id)
        return build_sampling_metadata(rows, self.generators, self.vocab_size, self.device, proposed)

    def _sampling_inputs(
        self, sched: SchedulerOutput, logits_indices: torch.Tensor
    ) -> tuple[SamplingMetadata | None, torch.Tensor, dict[str, str]]:
        """The step's sampling metadata, leaving out requests whose own inputs cannot be built.

        A failure is pinned on a request by building each request's rows alone (only on
        the error path); if no request fails alone, the problem is shared and is raised.
        Returns the metadata (None if every request failed), the logits rows to keep and
        the failed request ids with the reason.
        """
        items = [item for item in sched.scheduled if item.sample]
        try:
            return self._build_sampling(items), logits_indices, {}
        except Exception as batch_error:
            failed: dict[str, str] = {}
            for item in items:
                try:
                    self._build_sampling([item])
                except Exception as exc:  # noqa: BLE001 - this request's own problem
                    failed[item.request.request_id] = f"{type(exc).__name__}: {exc}"
            if not failed:
                raise batch_error
        logger.warning("requests failed while preparing sampling inputs: %s", failed)
        keep: list[int] = []
        row = 0
        for item in items:
            num_rows = item.num_logits_rows
            if item.request.request_id not in failed:
                keep.extend(range(row, row + num_rows))
            row += num_rows
        kept_items = [item for item in items if item.request.request_id not in failed]
        meta = self._build_sampling(kept_items) if kept_items else None
        return meta, logits_indices[keep], failed

    def forward_last_logits(self, sched: SchedulerOutput) -> torch.Tensor:
        """(num_scheduled, vocab) logits at each scheduled request's last token (the
        scheduled range may end in `spec_token_ids`). A draft model proposes with this."""
        assert self.tp_workers is None, "a draft model runs on one rank"
        batch = self._step_batch(sched, last_only=True, num_groups=self.kv_groups.num_groups)
        input_ids, positions, commons, logits_indices = self._batch_tensors(batch)
        hidden = self._run_model(input_ids, positions, commons[0], self._attn_metadata(commons))
        return self.model.compute_logits(hidden[logits_indices])

    def _verify(
        self, sched: SchedulerOutput, logits: torch.Tensor, meta: SamplingMetadata, failed: dict[str, str]
    ) -> ModelRunnerOutput:
        """Samples a step that verifies proposals: every row goes through the rejection
        sampler; a row without a proposal (a plain decode, a bonus row) draws as usual."""
        drafts: list[int] = []
        has_draft: list[bool] = []
        for item in sched.scheduled:
            if item.sample and item.request.request_id not in failed:
                drafts.extend([*item.spec_token_ids, 0] + [0] * len(item.fork_requests))
                has_draft.extend([True] * len(item.spec_token_ids) + [False] * (1 + len(item.fork_requests)))
        dist = self.sampler.target_distribution(logits, meta)
        verified = rejection_sample(
            dist.probs, dist.greedy_tokens,
            torch.tensor(drafts, dtype=torch.int64, device=self.device), has_draft,
            greedy_mask=meta.greedy_mask, generators=meta.generators,
        )
        sampled = SamplerOutput(token_ids=verified.token_ids)
        if dist.raw_logprobs is not None:
            gather_logprobs_into(dist.raw_logprobs, verified.token_ids, meta.max_num_logprobs or 0, sampled)
        return self._to_output(sched, sampled, failed, verified.accepted.tolist())

    @staticmethod
    def _step_batch(sched: SchedulerOutput, last_only: bool = False, num_groups: int = 1) -> StepBatch:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for item in sched.scheduled:
            start, n = item.num_computed_tokens, item.num_new_tokens
            num_spec = len(item.spec_token_ids)
            token_ids.extend(item.request.token_ids_slice(start, start + n - num_spec))
            token_ids.extend(item.spec_token_ids)
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            last = len(token_ids) - 1
            if last_only:
                logits_indices.append(last)
            elif item.sample:
                # Siblings share the last row; each proposal adds the row before it.
                logits_indices.extend([last - num_spec] * (1 + len(item.fork_requests)))
                logits_indices.extend(range(last - num_spec + 1, last + 1))
        max_blocks = max(len(item.block_table) for item in sched.scheduled)
        if num_groups == 1:
            tables = [item.block_table + [0] * (max_blocks - len(item.block_table)) for item in sched.scheduled]
        else:
            # The KV groups' tables come back to back, all of one length; each is padded alone.
            width = max_blocks // num_groups
            tables = []
            for item in sched.scheduled:
                n = len(item.block_table) // num_groups
                tables.append([b for g in range(num_groups)
                               for b in item.block_table[g * n : (g + 1) * n] + [0] * (width - n)])
        return StepBatch(token_ids, positions, query_lens, seq_lens, logits_indices, tables)

    def _batch_tensors(
        self, batch: StepBatch
    ) -> tuple[torch.Tensor, torch.Tensor, list[CommonAttentionMetadata], torch.Tensor]:
        """Returns the step's tensors with one CommonAttentionMetadata per KV group."""
        token_ids, positions, query_lens = batch.token_ids, batch.positions, batch.query_lens
        seq_lens, logits_indices = batch.seq_lens, batch.logits_indices
        num_groups = self.kv_groups.num_groups
        width = len(batch.block_tables[0]) // num_groups
        query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int64, device=self.device)
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.int64, device=self.device)
        bs = self.block_size
        commons = []
        for g in range(num_groups):
            tables = batch.block_tables if num_groups == 1 else [t[g * width : (g + 1) * width] for t in batch.block_tables]
            # Each token's slot: its request's block for (position // block_size), plus the offset.
            # Host integer arithmetic: at a decode step's few tokens it is ~10x cheaper than the ~10
            # tiny torch ops it replaces (~0.1 ms a step); at a 2048-token prefill it is ~0.5 ms.
            slots = [table[p // bs] * bs + p % bs
                     for table, q, s in zip(tables, query_lens, seq_lens, strict=True)
                     for p in range(s - q, s)]
            commons.append(CommonAttentionMetadata(
                num_tokens=len(token_ids),
                num_seqs=len(query_lens),
                block_size=bs,
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_t,
                block_tables=torch.tensor(tables, dtype=torch.int64).to(self.device),
                query_lens_list=query_lens,
                seq_lens_list=seq_lens,
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
            ))
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        logits_idx = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
        positions_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return input_ids, positions_t, commons, logits_idx

    @staticmethod
    def _copy_blocks(
        pairs: list[tuple[int, int]], src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor]
    ) -> None:
        """Copies whole blocks (K and V, every layer) between caches, possibly across devices."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_caches[0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_caches[0].device)
        for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
            dst_cache[:, dst] = src_cache[:, src].to(dst_cache.device, non_blocking=True)

    def _to_output(
        self, sched: SchedulerOutput, sampled, failed: dict[str, str], accepted: list[bool] | None = None
    ) -> ModelRunnerOutput:
        # The step's only host sync: everything comes back as Python lists at once.
        token_ids = sampled.token_ids.tolist() if sampled is not None else []
        lp = None
        if sampled is not None and sampled.logprobs is not None:
            lp = (sampled.logprob_token_ids.tolist(), sampled.logprobs.tolist(), sampled.ranks.tolist())

        def row_logprobs(row: int, request) -> TokenLogprobs | None:
            want = request.sampling_params.logprobs
            if lp is None or want is None:
                return None
            end = None if want == -1 else want + 1  # -1: the whole vocabulary
            return lp[0][row][:end], lp[1][row][:end], lp[2][row][:end]

        out = ModelRunnerOutput([], [], [], [], failed=failed)
        row = 0
        for item in sched.scheduled:
            if not item.sample or item.request.request_id in failed:
                out.sampled_token_ids.append(None)
                out.logprobs.append(None)
                out.fork_token_ids.append([])
                out.fork_logprobs.append([])
                out.extra_token_ids.append([])
                out.extra_logprobs.append([])
                continue
            out.sampled_token_ids.append(token_ids[row])
            out.logprobs.append(row_logprobs(row, item.request))
            siblings = range(row + 1, row + 1 + len(item.fork_requests))
            out.fork_token_ids.append([token_ids[r] for r in siblings])
            out.fork_logprobs.append([row_logprobs(r, s) for r, s in zip(siblings, item.fork_requests, strict=True)])
            row += 1 + len(item.fork_requests)
            num_spec = len(item.spec_token_ids)
            extra: list[int] = []
            if num_spec:
                assert accepted is not None
                # Rows row-1 .. row-1+num_spec: the run ends after the first rejection.
                (run,) = accepted_runs(token_ids[row - 1 : row + num_spec], accepted[row - 1 : row + num_spec], [num_spec])
                extra = run[1:]
            out.extra_token_ids.append(extra)
            out.extra_logprobs.append([row_logprobs(row + j, item.request) for j in range(len(extra))])
            row += num_spec
        return out
