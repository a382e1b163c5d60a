"""Builds what an `LLMEngine` runs on, from its frozen config: everything that is decided once.

    resolve_max_model_len   the config's max_model_len against the model's limit
    start_tp_workers        ranks 1..N-1 of a tensor-parallel model (processes)
    load_draft              speculative decoding's draft model runner, checked against the target
    size_kv_cache           the number of KV blocks the memory budget holds (target + draft)
    preemption_policy       the scheduler's recompute-or-swap cost model for this model
    start_lora              the adapters' manager, placing them in the KV block pool
    start_speculator        the speculator (n-gram or draft model)

The engine (`llm_engine.py`) keeps the request lifecycle and the step; nothing here runs per step.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from pagedserve import envs
from pagedserve.config import EngineConfig
from pagedserve.core.hybrid_kv_manager import HybridKVCacheManager
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.scheduler import PreemptionPolicy
from pagedserve.distributed.tp_workers import TPWorkers, WorkerSpec, worker_threads
from pagedserve.dtypes import lora_dtype
from pagedserve.lora.layers import lora_targets
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.peft_loader import module_dims_for
from pagedserve.models.loader import check_shardable
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.speculator import Speculator
from pagedserve.worker.kv_cache import default_kv_cache_bytes, kv_cache_bytes_for_utilization
from pagedserve.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedserve.models.source import ModelSource

logger = logging.getLogger(__name__)


def resolve_max_model_len(hf_config: Any, requested: int | None) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if limit is None:
        raise ValueError("config.json has no max_position_embeddings; pass max_model_len")
    if requested is None:
        return int(limit)
    if requested > limit:
        raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings ({limit})")
    return requested


def start_tp_workers(config: EngineConfig, source: ModelSource, device: torch.device,
                     dtype: torch.dtype) -> TPWorkers | None:
    """Spawns ranks 1..N-1 (tensor_parallel_size N > 1); each loads its own shard."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return None
    # Refused before any process starts: heads, MLP and quantization groups must split.
    check_shardable(source.path, size, config.model.quant_config())
    if device.type == "cuda" and torch.cuda.device_count() < size:
        raise ValueError(
            f"tensor_parallel_size={size} needs {size} CUDA devices, found {torch.cuda.device_count()}")
    timeout_s = envs.tp_timeout_s()
    spec = WorkerSpec(
        model_path=str(source.path), dtype=dtype, device_type=device.type,
        block_size=config.cache.block_size, quantization=config.model.quant_config(),
        kv_cache_dtype=config.cache.kv_cache_dtype,
        lora_dtype=lora_dtype(config.lora, dtype) if config.lora else None, tp_size=size, store_port=0,
        timeout_s=timeout_s, num_threads=worker_threads(size),
    )
    logger.info("tensor parallelism: starting %d worker processes", size - 1)
    return TPWorkers(spec, device, timeout_s)


def load_draft(config: EngineConfig, device: torch.device, dtype: torch.dtype, vocab_size: int,
               max_model_len: int) -> ModelRunner | None:
    """The draft model's runner (speculative decoding with method 'draft_model'), checked
    against the target: same vocabulary, long enough context."""
    spec_cfg = config.speculative
    if spec_cfg is None or spec_cfg.model is None:
        return None
    draft = ModelRunner(spec_cfg.model, dtype, device, config.cache.block_size,
                        kv_cache_dtype=config.cache.kv_cache_dtype)
    if draft.vocab_size != vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft model's vocab_size ({draft.vocab_size}) differs from "
            f"the target's ({vocab_size}); a draft must share the target's tokenizer"
        )
    draft_len = getattr(draft.hf_config, "max_position_embeddings", None)
    if draft_len is not None and draft_len < max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft model's max_position_embeddings ({draft_len}) is below "
            f"max_model_len ({max_model_len}); lower max_model_len"
        )
    return draft


def size_kv_cache(config: EngineConfig, runner: ModelRunner, draft: ModelRunner | None, device: torch.device,
                  max_model_len: int) -> int:
    """The number of KV blocks; raises ValueError when they cannot hold one longest sequence."""
    spec = runner.kv_cache_spec()
    cache = config.cache
    # A draft model's K/V comes from the same budget: every block of the target's pool
    # has a twin in the draft's pool, so both hold the same number of tokens.
    bytes_per_block = spec.bytes_per_block
    if draft is not None:
        bytes_per_block += draft.kv_cache_spec().bytes_per_block
    if cache.num_gpu_blocks_override is not None:
        num_blocks = cache.num_gpu_blocks_override
        memory = num_blocks * bytes_per_block
    else:
        memory = cache.kv_cache_memory_bytes or _default_kv_cache_bytes(config, runner, device)
        num_blocks = memory // bytes_per_block
    capacity = num_blocks * spec.block_size
    # With windowed layers a block is one page of a layer group: count what the groups hold.
    need = runner.kv_groups.blocks_per_sequence(
        max_model_len, spec.block_size,
        config.scheduler.max_num_batched_tokens if config.scheduler.enable_chunked_prefill else max_model_len)
    if num_blocks < need:
        raise ValueError(
            f"The KV cache ({memory} bytes = {num_blocks} blocks = {capacity} tokens) cannot hold one "
            f"sequence of max_model_len={max_model_len} tokens; raise kv_cache_memory_bytes "
            f"or lower max_model_len."
        )
    logger.info(
        "KV cache: %d blocks = %d tokens (%.1f MiB), max concurrency %.2fx at max_model_len=%d",
        num_blocks, capacity, num_blocks * spec.bytes_per_block / 2**20, capacity / max_model_len, max_model_len,
    )
    return num_blocks


def _default_kv_cache_bytes(config: EngineConfig, runner: ModelRunner, device: torch.device) -> int:
    utilization = config.cache.memory_utilization
    if utilization is None:
        return default_kv_cache_bytes(device)
    model = runner.model
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}  # tied once
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return kv_cache_bytes_for_utilization(device, utilization, weight_bytes)


def preemption_policy(config: EngineConfig, runner: ModelRunner, device: torch.device) -> PreemptionPolicy:
    # Rough, device-independent estimates; they only need the right order of magnitude:
    # recomputing a token costs ~2 FLOPs per parameter, swapping a block costs copying its
    # bytes out and back.
    num_params = sum(p.numel() for p in runner.model.parameters())
    flops_per_s, bytes_per_s = (50e12, 20e9) if device.type == "cuda" else (50e9, 5e9)
    return PreemptionPolicy(
        mode=config.scheduler.preemption_mode,
        recompute_s_per_token=2 * num_params / flops_per_s,
        swap_s_per_block=2 * runner.kv_cache_spec().bytes_per_block / bytes_per_s,
    )


def start_lora(config: EngineConfig, kv_manager: Any, runner: ModelRunner, sharded: bool) -> LoRAManager | None:
    """The adapters' manager (None without LoRA), placing them in the KV block pool; the
    scheduler asks it what is resident and hands placements to the runner in each step."""
    if config.lora is None:
        return None
    # Windowed layers' per-group tables share one pool too; adapter runs sit in no table.
    assert isinstance(kv_manager, KVCacheManager | HybridKVCacheManager), "EngineConfig checks: LoRA needs the paged pool"
    return LoRAManager(
        config.lora,
        kv_manager.pool,
        module_dims_for(runner.hf_config, lora_targets(runner.model)),
        len(runner.attn_layers),
        runner.lora_block_elems(),
        runner.write_adapter,
        shard=runner.lora_shard if sharded else None,
        num_caches=len(runner.kv_caches),  # fewer than the layers with windowed layers
    )


def start_speculator(config: EngineConfig, draft: ModelRunner | None, num_blocks: int) -> Speculator | None:
    if config.speculative is None:
        return None
    proposer = None if draft is None else DraftModelProposer(draft, num_blocks, config.cache.block_size)
    return Speculator(config.speculative, proposer)
