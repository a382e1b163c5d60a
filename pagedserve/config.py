"""Engine configuration: frozen, composed per component.

Values derived at start-up (number of KV blocks, the resolved max_model_len, the EOS id)
live on the engine, never written back here.

Plain values only, no torch: `core/` reads these settings and stays importable without
torch. The torch objects they name (device, dtypes) are resolved in `dtypes.py`.

This module is the one home of every setting's default and allowed values: `EngineArgs`
(the CLI and `LLM(...)`) takes its defaults from these dataclasses and its choice lists from
the tuples below, and `core/`, `worker/` and `quantization/` import the tuples they check
against (tests/test_settings_single_source.py fails when one is written twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.compilation.config import CompilationConfig
from pagedserve.spec_decode.config import SpeculativeConfig

QUANTIZATION_METHODS = ("int8", "int4", "gguf")
# quantization="none": nothing is quantized, a quantized .gguf file included (its tensors are
# dequantized at load into the dtype: the reference the quantized paths are measured against).
# None (the default) serves a quantized .gguf file's own blocks on CPU.
NO_QUANTIZATION = "none"
QUANTIZATION_CHOICES = (*QUANTIZATION_METHODS, NO_QUANTIZATION)
GROUP_SIZES = (32, 64, 128, 256)
PER_CHANNEL = -1  # int8 only: one scale per output channel
# group_size None picks these; BENCHMARKS.md ("Real-text quality") shows why int8 uses 32.
DEFAULT_GROUP_SIZES = {"int8": 32, "int4": 32, "gguf": 32}  # gguf: the file's blocks of 32
QUANTIZATION_ACTIVATIONS = ("auto", "int8", "none")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "int8")
# "paged" is the product; the others are the benchmarks' contiguous-allocation baselines.
KV_ALLOCATIONS = ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle")
# "continuous" is the product; the others are the benchmarks' batching baselines.
BATCHING_POLICIES = ("continuous", "static", "dynamic")
PREEMPTION_MODES = ("recompute", "swap", "auto")
SCHEDULING_POLICIES = ("fcfs", "priority")
LORA_DTYPES = ("auto", "float32", "bfloat16")
STRUCTURED_OUTPUT_BACKENDS = ("auto", "llguidance", "xgrammar")
# What "auto" picks: faster to compile (benchmarks/structured.py, see BENCHMARKS.md).
DEFAULT_STRUCTURED_OUTPUT_BACKEND = "llguidance"


def _check_choice(setting: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{setting} must be one of {', '.join(map(str, choices))}; got {value!r}")


@dataclass(frozen=True)
class QuantizationConfig:
    """What to quantize and how (`quantization.selector.get_linear_method` turns it into a layer method).

    Args:
        method: "int8" (symmetric, group-wise or per output channel), "int4" (group-wise,
            affine), or "gguf" (a GGUF file's quantized blocks as they are: the file decides
            each layer's format; models/loader.py).
        group_size: group along the input dim: 32, 64, 128 or 256; for int8 also -1 (one
            scale per output channel). None: the method's default (32 for both).
        quantize_lm_head: also quantize the LM head (embeddings always stay full precision;
            a tied head gets its own quantized copy). With "gguf" the head becomes group-wise
            int8 in blocks of 32 from its loaded values: exactly the file's numbers when the
            file stores it (or the tied token embedding) as Q8_0, as llama.cpp serves it.
        activations: group-wise int8 and gguf: "int8" rounds the activations to int8 per
            block of 32 (the `gemv_int8_q8` / `gemv_bits_q8` kernels; W8A8 dynamic, as
            llama.cpp multiplies its quantized types), "none" keeps them float (weight-only);
            "auto": quantization.DEFAULT_INT8_ACTIVATIONS / DEFAULT_GGUF_ACTIVATIONS. Prefill
            steps round x the same way; layers the kernels cannot take stay weight-only.
    """

    method: str
    group_size: int | None = None
    quantize_lm_head: bool = False
    activations: str = "auto"

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} or None; "
                f"got {self.method!r}"
            )
        if self.method == "gguf" and self.group_size is not None:
            raise ValueError("quantization_group_size cannot be set with quantization='gguf' "
                             "(the file's blocks of 32 are served as they are)")
        if self.activations not in QUANTIZATION_ACTIVATIONS:
            raise ValueError(f"quantization_activations must be one of {', '.join(QUANTIZATION_ACTIVATIONS)}, "
                             f"got {self.activations!r}")
        if self.activations == "int8" and (self.method not in ("int8", "gguf") or self.group_size == PER_CHANNEL):
            raise ValueError("quantization_activations applies to group-wise quantization='int8' and to "
                             "quantization='gguf' only")
        allowed = GROUP_SIZES + ((PER_CHANNEL,) if self.method == "int8" else ())
        if self.group_size is not None and self.group_size not in allowed:
            raise ValueError(
                f"quantization_group_size for {self.method} must be one of {allowed}, got {self.group_size}"
            )

    @property
    def effective_group_size(self) -> int:
        return self.group_size if self.group_size is not None else DEFAULT_GROUP_SIZES[self.method]

# ModelConfig.dtype's accepted names -> torch's name for the dtype.
DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


@dataclass(frozen=True)
class ModelConfig:
    model: str
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    # Weight-only quantization: None, "int8" or "int4" (at load time), "gguf" (a .gguf file's
    # quantized blocks as they are), or "none" (a quantized .gguf file dequantized at load);
    # see pagedserve/quantization.
    quantization: str | None = None
    quantization_group_size: int | None = None  # None: the method's default (32)
    quantize_lm_head: bool = False
    quantization_activations: str = "auto"  # group-wise int8 / gguf: "int8" | "none" | "auto" (default)
    # Hub ids: the revision (branch, tag or commit) and the cache folder (default HF_HUB_CACHE).
    revision: str | None = None
    download_dir: str | None = None
    # "auto": generation_config.json's sampling defaults and EOS ids apply (vLLM's default);
    # "vllm": ignore it (vLLM's own defaults); or a folder holding a generation_config.json.
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        self.quant_config()  # validates
        if self.dtype != "auto" and self.dtype not in DTYPE_ALIASES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPE_ALIASES)}; got {self.dtype!r}")
        if self.quantize_lm_head and self.quant_config() is None:
            raise ValueError("quantize_lm_head=True needs quantization='int8', 'int4' or 'gguf'")
        if self.quantization_activations != "auto" and self.quant_config() is None:
            raise ValueError("quantization_activations needs quantization='int8' (group-wise) or 'gguf' "
                             "(a quantized .gguf file: quantization='gguf' chooses its activations)")

    @property
    def serves_gguf_blocks(self) -> bool:
        """Whether a quantized .gguf file may be served from its own blocks when no method is
        asked (models/loader.py decides per file and device); False with quantization='none'."""
        return self.quantization != NO_QUANTIZATION

    def quant_config(self) -> QuantizationConfig | None:
        if self.quantization is None or self.quantization == NO_QUANTIZATION:
            return None
        return QuantizationConfig(
            self.quantization, self.quantization_group_size, self.quantize_lm_head,
            self.quantization_activations,
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # None: a share of free memory (see worker/kv_cache.py).
    kv_cache_memory_bytes: int | None = None
    # vLLM's gpu_memory_utilization: share of memory for weights + KV (None: the default budget).
    memory_utilization: float | None = None
    # Exact number of KV blocks, overriding the memory budget (tests, benchmarks).
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    # Host memory for swapped-out KV blocks (preemption by swap).
    swap_space_bytes: int = 1 << 30
    # "paged" (the product) or a contiguous-allocation baseline for the benchmarks:
    # "contiguous-max", "contiguous-pow2", "contiguous-oracle" (see core/factory.py).
    kv_allocation: str = "paged"
    # "auto": the model's dtype; "int8": int8 K/V with a float32 scale per token and head.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("kv_allocation", self.kv_allocation, KV_ALLOCATIONS)
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    # A CPU runs ~2k tokens per forward pass in a fraction of a second; larger budgets
    # mostly add decode latency when a long prompt arrives.
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # "continuous" (the product), or the "static" / "dynamic" baselines for the benchmarks.
    batching: str = "continuous"
    # dynamic batching: launch a partial batch once its oldest request waited this long.
    batch_window_s: float = 0.05
    # How to preempt under memory pressure: "recompute", "swap", or "auto" (cost model).
    preemption_mode: str = "auto"
    # "fcfs", or "priority": lower request priority values are admitted first, preempted last.
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        _check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _check_choice("batching", self.batching, BATCHING_POLICIES)
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ParallelConfig:
    # Ranks one model is split over (worker processes, torch.distributed; see
    # distributed/tp_workers.py). Whether the model's heads split this way is checked at load.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 4  # adapters resident on the device at once
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # host cache size; None = max(max_loras, 16)
    # Adapters' dtype in the pool: "auto" = the model's; "bfloat16" halves their memory and
    # the bytes a decode step reads (weights rounded once; products still accumulate in fp32).
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        _check_choice("lora_dtype", self.lora_dtype, LORA_DTYPES)


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config: {"backend": ..., "compile_timeout_s": ...}."""

    backend: str = "auto"  # one of STRUCTURED_OUTPUT_BACKENDS
    # A grammar that takes longer to compile fails its request (a 400), not the batch.
    compile_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check_choice("structured_outputs_config.backend", self.backend, STRUCTURED_OUTPUT_BACKENDS)
        if not self.compile_timeout_s > 0:
            raise ValueError(f"structured_outputs_config.compile_timeout_s must be > 0, got {self.compile_timeout_s}")

    @classmethod
    def from_value(cls, value: StructuredOutputsConfig | dict | str | None) -> StructuredOutputsConfig:
        """From a config, a dict, or its JSON text (the CLI flag); unknown keys are refused."""
        import json

        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"structured_outputs_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("structured_outputs_config must be a JSON object")
        unknown = set(value) - {"backend", "compile_timeout_s"}
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown keys {sorted(unknown)} (known: backend, compile_timeout_s)")
        return cls(**value)

    @property
    def resolved_backend(self) -> str:
        return DEFAULT_STRUCTURED_OUTPUT_BACKEND if self.backend == "auto" else self.backend


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "auto"  # "auto" (cuda when available), "cpu", "cuda", "cuda:N"
    lora: LoRAConfig | None = None  # None: LoRA off
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)  # level 0: eager

    def __post_init__(self) -> None:
        if self.compilation.enabled and self.lora is not None:
            # LoRA wrappers read their step's segments from a context the graph cannot see.
            raise ValueError("compilation_config: level 3 (compiled decode) does not support enable_lora; "
                             "use level 0 or enforce_eager=True with LoRA")
        if self.compilation.enabled and self.parallel.tensor_parallel_size > 1:
            # Rank 0 pads its batch to a compiled size; the other ranks run the unpadded step,
            # and their all-reduces would disagree on the shape.
            raise ValueError("compilation_config: level 3 (compiled decode) does not support "
                             "tensor_parallel_size > 1; use level 0 or enforce_eager=True")
        if self.speculative is not None and (
            self.cache.kv_allocation != "paged" or self.scheduler.batching != "continuous"
        ):
            raise ValueError(
                "speculative_config needs the paged KV cache and continuous batching "
                f"(got kv_allocation={self.cache.kv_allocation!r}, batching={self.scheduler.batching!r})"
            )
        if self.lora is not None and self.cache.kv_allocation != "paged":
            # Adapters are paged into the KV block pool; a contiguous baseline has none.
            raise ValueError(f"enable_lora needs kv_allocation='paged', got {self.cache.kv_allocation!r}")
