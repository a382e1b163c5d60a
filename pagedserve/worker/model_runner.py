"""The model runner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It is the only place that builds tensors for a step. Per step:

    schedule -> token ids, positions, slot mapping, block tables, query starts   (host lists -> tensors)
             -> attention metadata (backend-specific, built once, shared by all layers)
             -> model forward over the flat batch -> logits for the rows due a token
             -> sampler -> one .tolist() at the end
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedserve import envs
from pagedserve.attention.backend import AttentionBackend, get_attention_backend
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.core.sched_output import SchedulerOutput
from pagedserve.lora.kernels import block_elems
from pagedserve.lora.layers import lora_step, wrap_model_for_lora
from pagedserve.lora.layout import AdapterLayout, write_adapter
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.peft_loader import TARGETABLE, LoRAAdapter
from pagedserve.lora.segments import LoRASegments, build_segments
from pagedserve.models.layers.attention import Attention
from pagedserve.models.loader import load_model
from pagedserve.quantization import QuantizationConfig
from pagedserve.sample.input_builder import build_sampling_metadata
from pagedserve.sample.sampler import Sampler
from pagedserve.worker.kv_cache import KVCacheSpec, allocate_kv_caches, kv_cache_torch_dtype
from pagedserve.worker.prompt_logprobs import (
    PromptLogprobs,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
    split_prompt_logprobs,
)

logger = logging.getLogger(__name__)


TokenLogprobs = tuple[list[int], list[float], list[int]]


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
class ModelRunnerOutput:
    # One entry per scheduled request, in schedule order: the sampled token, or None.
    sampled_token_ids: list[int | None]
    # Per scheduled request: (token ids, logprobs, ranks) with the chosen token first, or None.
    logprobs: list[TokenLogprobs | None]
    # Per scheduled request: first tokens (and logprobs) of its `fork_requests`, in order.
    fork_token_ids: list[list[int]] = field(default_factory=list)
    fork_logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)
    # Per scheduled request: the prompt logprobs this step's chunk yields, or None (or empty
    # when no request asked for any).
    prompt_logprobs: list[PromptLogprobs | None] = field(default_factory=list)


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
    ) -> None:
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
        self.backend = _attention_backend(device, self.kv_dtype)
        self.model, self.hf_config = load_model(model_path, dtype, device, quantization)
        self.model.eval()
        self.attn_layers = sorted(
            (m for m in self.model.modules() if isinstance(m, Attention)), key=lambda m: m.layer_idx
        )
        self.vocab_size = int(self.hf_config.vocab_size)
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.swap_caches: list[torch.Tensor] = []
        self.generators: dict[str, torch.Generator] = {}
        # LoRA: wrappers around the projections (weights already loaded by name), and the
        # manager that knows where each adapter lives (set by the engine).
        # lora_dtype None: LoRA off.
        self.lora_dtype = lora_dtype
        self.lora_layers = wrap_model_for_lora(self.model) if lora_dtype is not None else []
        self.lora_manager: LoRAManager | None = None

    def kv_cache_spec(self) -> KVCacheSpec:
        first = self.attn_layers[0]
        return KVCacheSpec(
            num_layers=len(self.attn_layers),
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
        spec = self.kv_cache_spec()
        shape = (2, num_blocks, spec.block_size, spec.num_kv_heads, spec.last_dim)
        pin = self.device.type == "cuda"
        self.swap_caches = [
            torch.empty(shape, dtype=spec.dtype, pin_memory=pin) for _ in range(spec.num_layers)
        ] if num_blocks > 0 else []

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.kv_caches = allocate_kv_caches(self.kv_cache_spec(), num_blocks, self.device)
        for layer, cache in zip(self.attn_layers, self.kv_caches, strict=True):
            layer.kv_cache = cache
        for wrapper in self.lora_layers:
            wrapper.bind(self.kv_caches[wrapper.layer_idx], self.lora_dtype)

    def lora_block_elems(self) -> int:
        """LoRA-dtype elements one KV block holds in each half (K or V) of a layer's cache."""
        return block_elems(self.kv_caches[0], self.lora_dtype)

    def write_adapter(self, adapter: LoRAAdapter, layout: AdapterLayout, first_block: int) -> None:
        """Copies an adapter's weights into its run of KV blocks, in every layer."""
        write_adapter(adapter, layout, self.kv_caches, first_block, self.lora_dtype)

    def _lora_segments(self, sched: SchedulerOutput) -> LoRASegments | None:
        manager = self.lora_manager
        if manager is None or not any(item.request.lora_id for item in sched.scheduled):
            return None
        runs = [
            (item.num_new_tokens, manager.resident(item.request.lora_id) if item.request.lora_id else None)
            for item in sched.scheduled
        ]
        return build_segments(runs, len(self.attn_layers), len(TARGETABLE))

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_ids:
            self.generators.pop(request_id, None)
        # Order matters: a block swapped out may be reused by a swap-in or a CoW copy.
        if sched.blocks_to_swap_out:
            self._copy_blocks(sched.blocks_to_swap_out, self.kv_caches, self.swap_caches)
        if sched.blocks_to_swap_in:
            self._copy_blocks(sched.blocks_to_swap_in, self.swap_caches, self.kv_caches)
        if sched.blocks_to_copy:
            self._copy_blocks(sched.blocks_to_copy, self.kv_caches, self.kv_caches)
        if sched.is_empty:
            return ModelRunnerOutput([], [])
        input_ids, positions, common, logits_indices = self._prepare_inputs(sched)
        attn_metadata = self.backend.build_metadata(common)
        with lora_step(self._lora_segments(sched)):
            hidden = self.model(input_ids, positions, attn_metadata)
        plan = plan_prompt_logprobs(sched, self.vocab_size)
        prompt_lp = compute_prompt_logprobs(plan, hidden, self.model.compute_logits) if plan else None
        # One logits row per sampling request, then one per sibling it forks (same row).
        row_requests = [r for item in sched.scheduled if item.sample for r in (item.request, *item.fork_requests)]
        sampled = None
        if row_requests:
            logits = self.model.compute_logits(hidden[logits_indices])
            meta = build_sampling_metadata(row_requests, self.generators, self.vocab_size, self.device)
            sampled = self.sampler(logits, meta)
        out = self._to_output(sched, sampled)
        if plan is not None and prompt_lp is not None:
            lists = (prompt_lp[0].tolist(), prompt_lp[1].tolist(), prompt_lp[2].tolist())
            out.prompt_logprobs = split_prompt_logprobs(sched, plan, lists, self.vocab_size)
        return out

    def _prepare_inputs(
        self, sched: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, CommonAttentionMetadata, torch.Tensor]:
        token_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        for item in sched.scheduled:
            start, n = item.num_computed_tokens, item.num_new_tokens
            token_ids.extend(item.request.token_ids_slice(start, start + n))
            positions.extend(range(start, start + n))
            query_lens.append(n)
            seq_lens.append(start + n)
            if item.sample:
                logits_indices.extend([len(token_ids) - 1] * (1 + len(item.fork_requests)))
        max_blocks = max(len(item.block_table) for item in sched.scheduled)
        block_tables = torch.tensor(
            [item.block_table + [0] * (max_blocks - len(item.block_table)) for item in sched.scheduled],
            dtype=torch.int64,
        )
        positions_t = torch.tensor(positions, dtype=torch.int64)
        query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
        query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
        # Each token's slot: its request's block for (position // block_size), plus the offset.
        request_index = torch.repeat_interleave(torch.arange(len(query_lens)), query_lens_t)
        bs = self.block_size
        slot_mapping = block_tables[request_index, positions_t // bs] * bs + positions_t % bs
        common = CommonAttentionMetadata(
            num_tokens=len(token_ids),
            num_seqs=len(query_lens),
            block_size=bs,
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=query_start_loc.to(self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
            block_tables=block_tables.to(self.device),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        logits_idx = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
        return input_ids, positions_t.to(self.device), common, logits_idx

    @staticmethod
    def _copy_blocks(
        pairs: list[tuple[int, int]], src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor]
    ) -> None:
        """Copies whole blocks (K and V, every layer) between caches, possibly across devices."""
        src = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src_caches[0].device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst_caches[0].device)
        for src_cache, dst_cache in zip(src_caches, dst_caches, strict=True):
            dst_cache[:, dst] = src_cache[:, src].to(dst_cache.device, non_blocking=True)

    def _to_output(self, sched: SchedulerOutput, sampled) -> ModelRunnerOutput:
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

        out = ModelRunnerOutput([], [], [], [])
        row = 0
        for item in sched.scheduled:
            if not item.sample:
                out.sampled_token_ids.append(None)
                out.logprobs.append(None)
                out.fork_token_ids.append([])
                out.fork_logprobs.append([])
                continue
            out.sampled_token_ids.append(token_ids[row])
            out.logprobs.append(row_logprobs(row, item.request))
            siblings = range(row + 1, row + 1 + len(item.fork_requests))
            out.fork_token_ids.append([token_ids[r] for r in siblings])
            out.fork_logprobs.append([row_logprobs(r, s) for r, s in zip(siblings, item.fork_requests, strict=True)])
            row += 1 + len(item.fork_requests)
        return out
