"""Every engine setting, defined once (vLLM's `EngineArgs` pattern).

One field of :class:`EngineArgs` is one setting. Its metadata (help text, group, flag name,
aliases, parser, choices) generates the `pagedserve serve|generate` flags; the dataclass
constructor checks `LLM(**kwargs)` (an unknown keyword is a TypeError naming it); and
:meth:`EngineArgs.create_engine_config` builds the frozen :class:`~pagedserve.config.EngineConfig`.

No torch here: `pagedserve --help` builds its parser from this module without paying for torch.
Defaults and choice lists are the config dataclasses' (`config.py`), referred to, never restated.

    field ──metadata──► argparse flag (add_cli_args) ──► Namespace ──► from_cli_args ─┐
      └──────────────────────── LLM(**kwargs) ────────────────────────────────────────┴─► EngineArgs
                                                                                           │
                                                                    create_engine_config() ▼
                                                                                      EngineConfig
"""

from __future__ import annotations

import argparse
import logging
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pagedserve.compilation.config import CompilationConfig
from pagedserve.config import (
    KV_CACHE_DTYPES,
    LORA_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATION_ACTIVATIONS,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUT_BACKENDS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
)
from pagedserve.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*")


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648, '512MB' -> 512000000, '1e9' -> 1000000000."""
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 1e9)")
    value = int(float(match.group(1)) * _BYTE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be > 0, got {text!r}")
    return value


def parse_gib(text: str) -> float:
    """vLLM's --swap-space: a bare number is GiB ('4' -> 4.0); a size with a unit is converted."""
    match = _SIZE.fullmatch(text)
    if match is not None and not match.group(2):
        value = float(match.group(1))
        if value < 0:
            raise argparse.ArgumentTypeError(f"size must be >= 0, got {text!r}")
        return value
    return parse_bytes(text) / 2**30


def parse_model_len(text: str) -> int | None:
    """vLLM's --max-model-len: '2048', '16k' (x1000), '16K' (x1024), '1m', '1M', or 'auto' / '-1'
    (the model's maximum, returned as None)."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kKmMgG]?)", value)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a length: {text!r} (examples: 4096, 16k, 16K, 1M, auto)")
    unit = match.group(2)
    scale = {"": 1, "k": 10**3, "K": 2**10, "m": 10**6, "M": 2**20, "g": 10**9, "G": 2**30}[unit]
    tokens = int(float(match.group(1)) * scale)
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"max-model-len must be >= 1, got {text!r}")
    return tokens


def _parse_compilation_config(text: str) -> Any:
    """--compilation-config / -O: a level or JSON, checked while parsing."""
    try:
        return CompilationConfig.from_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse_speculative_config(text: str) -> Any:
    """--speculative-config: checked while parsing, so a bad key is a usage error naming it."""
    try:
        return SpeculativeConfig.from_value(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _default(config: type, name: str) -> Any:
    """A config dataclass field's default: the one place each default is written."""
    (default,) = (f.default for f in fields(config) if f.name == name)
    return default


def _setting(
    help: str,
    *,
    group: str = "engine",
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    cli: bool = True,
    ignored: str | None = None,
    vllm: str = "same",
) -> dict[str, Any]:
    """Field metadata: how the setting appears on the command line (`cli=False`: API only).

    `ignored`: why the setting has no effect here (vLLM's GPU-only knobs); it is accepted, so a
    vLLM command line runs unchanged, and a non-default value is logged once.
    """
    if ignored:
        help = f"{help} [accepted for vLLM compatibility; no effect here: {ignored}]"
    return {
        "help": help, "group": group, "flag": flag, "aliases": aliases, "parse": parse,
        "choices": choices, "metavar": metavar, "cli": cli, "ignored": ignored,
        "vllm": f"accepted, no effect: {ignored}" if ignored else vllm,
    }


@dataclass
class EngineArgs:
    """The engine's settings, with vLLM's names where vLLM has the setting."""

    model: str | None = field(default=None, metadata=_setting(
        "a Hugging Face model folder, a .gguf file, a hub id (org/name, from the local Hugging Face "
        "cache), or a built-in demo model name (demo, llama-gqa, ...)", cli=False,
        vllm="same, offline: a hub id is looked up in the local cache, never downloaded"))
    tokenizer: str | None = field(default=_default(ModelConfig, "tokenizer"), metadata=_setting(
        "tokenizer folder, .gguf file or hub id, if not the model's"))
    revision: str | None = field(default=_default(ModelConfig, "revision"), metadata=_setting(
        "hub ids: the branch, tag or commit (default main)"))
    download_dir: str | None = field(default=_default(ModelConfig, "download_dir"), metadata=_setting(
        "hub ids: the Hugging Face cache folder to look in (default $HF_HUB_CACHE)",
        vllm="same, but only read: nothing is downloaded"))
    generation_config: str = field(default=_default(ModelConfig, "generation_config"), metadata=_setting(
        "auto: the model's generation_config.json gives the sampling defaults (temperature, top_p, "
        "top_k, min_p, repetition_penalty, max_new_tokens) and extra EOS ids; vllm: ignore it; "
        "or a folder holding a generation_config.json"))
    skip_tokenizer_init: bool = field(default=_default(ModelConfig, "skip_tokenizer_init"), metadata=_setting(
        "no tokenizer: prompts must be token ids and outputs have no text"))
    dtype: str = field(default=_default(ModelConfig, "dtype"), metadata=_setting(
        "auto (the checkpoint's dtype; float16 -> bfloat16 on CPU; a quantized GGUF -> bfloat16 on "
        "CPUs with native bf16, else float32; float32 if the checkpoint does not say), float32, "
        "bfloat16 or float16",
        vllm="same; a quantized GGUF is dequantized at load into this dtype"))
    seed: int = field(default=_default(ModelConfig, "seed"), metadata=_setting("seed of the engine's random generator"))
    max_model_len: int | None = field(default=_default(ModelConfig, "max_model_len"), metadata=_setting(
        "longest prompt + output in tokens: 4096, 16k (x1000), 16K (x1024), 1M, or auto "
        "(the default: the model's maximum)", parse=parse_model_len, metavar="LEN",
        vllm="same; `auto` is the model's maximum (vLLM may also shrink it to fit memory)"))
    device: str = field(default=_default(EngineConfig, "device"), metadata=_setting("auto, cpu or cuda"))
    quantization: str | None = field(default=_default(ModelConfig, "quantization"), metadata=_setting(
        "weight-only quantization of every linear layer at load time "
        "(group-wise: int8 symmetric like Q8_0, int4 affine like Q4_1), or gguf: a .gguf model's "
        "quantized linear weights served as they are (no requantizing; what a quantized .gguf "
        "file gets by default on CPU), or none: nothing quantized, a .gguf file's tensors "
        "dequantized at load into --dtype", choices=QUANTIZATION_CHOICES,
        vllm="differs: vLLM names checkpoint formats (awq, gptq, fp8, gguf, ...); here int8 / int4 "
             "quantize a full-precision checkpoint at load; gguf is vLLM's name; none is pagedserve's"))
    quantization_group_size: int | None = field(default=_default(ModelConfig, "quantization_group_size"), metadata=_setting(
        "group size along the input dim: 32 (default), 64, 128 or 256; int8 also -1 "
        "(one scale per output channel)", vllm="pagedserve only"))
    quantize_lm_head: bool = field(default=_default(ModelConfig, "quantize_lm_head"), metadata=_setting(
        "also quantize the LM head (embeddings stay full precision); with gguf: int8 blocks of 32, "
        "the file's own numbers when it stores the head as Q8_0", vllm="pagedserve only"))
    quantization_activations: str = field(default=_default(ModelConfig, "quantization_activations"), metadata=_setting(
        "int8 (group-wise) and gguf: int8 rounds the activations to int8 per block of 32 (scale "
        "absmax / 127, as llama.cpp multiplies its quantized types; W8A8 dynamic); none keeps them "
        "float (weight-only); auto: pagedserve's default (int8: none; gguf: int8)",
        choices=QUANTIZATION_ACTIVATIONS, vllm="pagedserve only"))

    block_size: int = field(default=_default(CacheConfig, "block_size"), metadata=_setting("tokens per KV cache block"))
    kv_cache_memory_bytes: int | None = field(default=_default(CacheConfig, "kv_cache_memory_bytes"), metadata=_setting(
        "memory for the KV cache, e.g. 512MiB or 2GiB (default: a share of free memory)",
        flag="--kv-cache-memory", aliases=("--kv-cache-memory-bytes",), parse=parse_bytes,
        metavar="BYTES", vllm="same; units accepted (512MiB); also --kv-cache-memory"))
    gpu_memory_utilization: float | None = field(default=_default(CacheConfig, "memory_utilization"), metadata=_setting(
        "share of memory for the weights + KV cache, in (0, 1]. On CPU the share is of the memory "
        "available at start-up (weights included); on CUDA of the device's free memory. Ignored "
        "when --kv-cache-memory-bytes or --num-gpu-blocks-override is given",
        vllm="same on CUDA; on CPU the share of host memory available at start-up "
             "(vLLM's CPU backend reads VLLM_CPU_KVCACHE_SPACE instead); default: 25% of "
             "available memory, at most 4 GiB, for the KV cache"))
    num_gpu_blocks_override: int | None = field(default=_default(CacheConfig, "num_gpu_blocks_override"), metadata=_setting(
        "exact number of KV blocks, overriding the memory budget"))
    enable_prefix_caching: bool = field(default=_default(CacheConfig, "enable_prefix_caching"), metadata=_setting(
        "reuse cached KV blocks of shared prompt prefixes"))
    swap_space: float = field(default=_default(CacheConfig, "swap_space_bytes") / 2**30, metadata=_setting(
        "host memory for swapped-out KV blocks, in GiB (vLLM's unit); units accepted: 512MiB",
        parse=parse_gib, metavar="GiB"))
    kv_cache_dtype: str = field(default=_default(CacheConfig, "kv_cache_dtype"), metadata=_setting(
        "auto (the model's dtype) or int8 (per-token-per-head scales, ~2x the blocks of bf16, "
        "~4x of fp32)", choices=KV_CACHE_DTYPES))
    # Benchmark baselines (core/contiguous.py, core/batching.py): API only, not product flags.
    kv_allocation: str = field(default=_default(CacheConfig, "kv_allocation"), metadata=_setting(
        "paged, or a contiguous baseline: contiguous-max, contiguous-pow2, contiguous-oracle", cli=False,
        vllm="pagedserve only (benchmark baselines)"))

    max_num_seqs: int = field(default=_default(SchedulerConfig, "max_num_seqs"), metadata=_setting("most requests in one step"))
    max_num_batched_tokens: int = field(default=_default(SchedulerConfig, "max_num_batched_tokens"), metadata=_setting("token budget of one step"))
    enable_chunked_prefill: bool = field(default=_default(SchedulerConfig, "enable_chunked_prefill"), metadata=_setting(
        "split long prompts over several steps"))
    preemption_mode: str = field(default=_default(SchedulerConfig, "preemption_mode"), metadata=_setting(
        "how to preempt under memory pressure (auto: swap when copying is cheaper)",
        choices=PREEMPTION_MODES, vllm="pagedserve only (vLLM v1 always recomputes)"))
    scheduling_policy: str = field(default=_default(SchedulerConfig, "scheduling_policy"), metadata=_setting(
        "fcfs, or priority: requests with lower `priority` values are admitted first and "
        "preempted last (first come first served within a priority)", choices=SCHEDULING_POLICIES))
    batching: str = field(default=_default(SchedulerConfig, "batching"), metadata=_setting(
        "continuous, or a baseline: static, dynamic", cli=False, vllm="pagedserve only (benchmark baselines)"))
    batch_window_s: float = field(default=_default(SchedulerConfig, "batch_window_s"), metadata=_setting(
        "dynamic batching's longest wait for a partial batch", cli=False,
        vllm="pagedserve only (benchmark baselines)"))

    enable_lora: bool = field(default=False, metadata=_setting(
        "serve PEFT LoRA adapters on the base model", group="LoRA adapters"))
    max_loras: int = field(default=_default(LoRAConfig, "max_loras"), metadata=_setting(
        "adapters resident in the KV memory pool at once", group="LoRA adapters"))
    max_lora_rank: int = field(default=_default(LoRAConfig, "max_lora_rank"), metadata=_setting(
        "largest adapter rank accepted", group="LoRA adapters"))
    max_cpu_loras: int | None = field(default=_default(LoRAConfig, "max_cpu_loras"), metadata=_setting(
        "adapters kept in the host cache (default max(max_loras, 16))", group="LoRA adapters"))
    lora_dtype: str = field(default=_default(LoRAConfig, "lora_dtype"), metadata=_setting(
        "adapters' dtype in the KV pool (auto: the model's; bfloat16 halves their memory)",
        group="LoRA adapters", choices=LORA_DTYPES))
    speculative_config: Any = field(default=None, metadata=_setting(
        "speculative decoding, vLLM's JSON form: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' or '{\"model\": \"/path/draft\", "
        "\"num_speculative_tokens\": 4}' (LLM(...) also takes a dict)",
        group="speculative decoding", parse=_parse_speculative_config, metavar="JSON",
        vllm="same JSON form; methods `ngram` and a draft `model` (no EAGLE / Medusa / MTP); "
             "extra keys for the auto-off: `disable_by_batch_size`, `min_acceptance_rate`, `backoff_steps`"))

    data_parallel_size: int = field(default=1, metadata=_setting(
        "engine replicas behind one endpoint (each a full engine; needs "
        "--distributed-executor-backend ray)", group="distributed", aliases=("-dp",)))
    tensor_parallel_size: int = field(default=_default(ParallelConfig, "tensor_parallel_size"), metadata=_setting(
        "split one model over N ranks: rank 0 in the engine process, N-1 worker processes it starts "
        "(torch.distributed: gloo on CPU, NCCL on CUDA); heads, MLP and vocabulary are sharded",
        group="distributed", aliases=("-tp",),
        vllm="same; on CPU the ranks share the host's cores"))
    distributed_executor_backend: str | None = field(default=None, metadata=_setting(
        "where replicas run: ray (a local Ray cluster, or the one RAY_ADDRESS names)",
        group="distributed", choices=("ray",)))

    structured_outputs_config: dict | str | None = field(default=None, metadata=_setting(
        'structured outputs (JSON schema / regex / choice / grammar constraints), as JSON: '
        '{"backend": "auto"|"llguidance"|"xgrammar", "compile_timeout_s": 10} (auto = llguidance)',
        group="structured outputs", metavar="JSON",
        vllm="same keys backend (llguidance, xgrammar; not outlines / guidance) and, pagedserve only, "
             "compile_timeout_s"))
    guided_decoding_backend: str | None = field(default=None, metadata=_setting(
        "the structured outputs backend alone (vLLM's older flag)", group="structured outputs",
        choices=STRUCTURED_OUTPUT_BACKENDS, vllm="same (vLLM <= 0.10)"))

    compilation_config: Any = field(default=None, metadata=_setting(
        "torch.compile over the decode forward, vLLM's form: a level (0 eager, the default; 3 "
        "compiled) or JSON '{\"level\": 3, \"compile_sizes\": [1, 2, 4, 8]}': decode steps of up "
        "to max(compile_sizes) tokens run one static graph per size (batch padded up), compiled "
        "at start-up (tens of seconds per size on 2 cores); prefill stays eager",
        group="compilation", aliases=("-O",), parse=_parse_compilation_config, metavar="LEVEL|JSON",
        vllm="same flag and -O; keys `level` (0 or 3), `compile_sizes` (the padded batch sizes, vLLM's "
             "cudagraph_capture_sizes) and `inductor_compile_config`; the default here is 0 (eager)"))
    enforce_eager: bool = field(default=False, metadata=_setting(
        "always run eagerly: no compiled decode, whatever compilation_config says",
        group="compilation", vllm="same (this engine has no CUDA graphs; it turns compilation off)"))

    # vLLM settings with no effect in this engine: accepted so vLLM command lines and scripts
    # run unchanged (see docs/vllm_compatibility.md).
    trust_remote_code: bool = field(default=False, metadata=_setting(
        "allow a checkpoint's own Python code", group="vLLM compatibility",
        ignored="only the built-in architectures load; no checkpoint code is ever run"))
    load_format: str = field(default="auto", metadata=_setting(
        "weight file format", group="vLLM compatibility",
        ignored="the format is read from the files (safetensors, .bin, GGUF)"))
    tokenizer_mode: str = field(default="auto", metadata=_setting(
        "which tokenizer implementation", group="vLLM compatibility",
        ignored="the Hugging Face fast tokenizer is always used"))
    disable_log_stats: bool = field(default=False, metadata=_setting(
        "no periodic stats log lines", group="vLLM compatibility",
        ignored="the engine logs no periodic stats; /metrics has them"))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, model_help: str | None = None) -> None:
        """Adds the MODEL positional (and --model) plus one flag per CLI setting, in groups."""
        model_help = model_help or fields(cls)[0].metadata["help"]
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=model_help)
        groups: dict[str, argparse._ArgumentGroup] = {}
        groups["engine"] = parser.add_argument_group("engine")
        groups["engine"].add_argument("--model", dest="model", default=None,
                                      help="the model, as an option (same as MODEL)")
        for f in fields(cls):
            meta = f.metadata
            if not meta.get("cli"):
                continue
            group = groups.get(meta["group"]) or groups.setdefault(
                meta["group"], parser.add_argument_group(meta["group"]))
            names = [meta["flag"] or "--" + f.name.replace("_", "-"), *meta["aliases"]]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
            if f.type in ("bool", bool):
                kwargs["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            else:
                kwargs["type"] = meta["parse"] or _parser_for(f.type)
                if meta["choices"]:
                    kwargs["choices"] = meta["choices"]
                if meta["metavar"]:
                    kwargs["metavar"] = meta["metavar"]
            group.add_argument(*names, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The settings parsed by `add_cli_args` (MODEL and --model must agree if both are given)."""
        model = getattr(args, "model", None)
        tag = getattr(args, "model_tag", None)
        if model is not None and tag is not None and model != tag:
            raise ValueError(f"the model is given twice: {tag!r} and --model {model!r}")
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        values["model"] = model if model is not None else tag
        return cls(**values)

    def replace(self, **changes: Any) -> EngineArgs:
        return EngineArgs(**{**asdict(self), **changes})

    def create_engine_config(self) -> EngineConfig:
        """The frozen config; each component validates its own fields (ValueError names one)."""
        if self.model is None:
            raise ValueError("model: no model given")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size: one engine is one replica; {self.data_parallel_size} replicas are "
                "served by `pagedserve serve --data-parallel-size N --distributed-executor-backend ray`")
        self._log_ignored()
        return EngineConfig(
            model=ModelConfig(
                model=str(self.model),
                tokenizer=str(self.tokenizer) if self.tokenizer is not None else None,
                skip_tokenizer_init=self.skip_tokenizer_init,
                dtype=self.dtype,
                seed=self.seed,
                max_model_len=self.max_model_len,
                quantization=self.quantization,
                quantization_group_size=self.quantization_group_size,
                quantize_lm_head=self.quantize_lm_head,
                quantization_activations=self.quantization_activations,
                revision=self.revision,
                download_dir=self.download_dir,
                generation_config=self.generation_config,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                memory_utilization=self.gpu_memory_utilization,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                enable_prefix_caching=self.enable_prefix_caching,
                swap_space_bytes=int(self.swap_space * 2**30),
                kv_allocation=self.kv_allocation,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                enable_chunked_prefill=self.enable_chunked_prefill,
                preemption_mode=self.preemption_mode,
                scheduling_policy=self.scheduling_policy,
                batching=self.batching,
                batch_window_s=self.batch_window_s,
            ),
            device=self.device,
            lora=LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, self.lora_dtype)
            if self.enable_lora else None,
            speculative=SpeculativeConfig.from_value(self.speculative_config),
            structured_outputs=self._structured_outputs_config(),
            parallel=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size),
            compilation=CompilationConfig.from_value(self.compilation_config).with_enforce_eager(self.enforce_eager),
        )

    def _structured_outputs_config(self) -> Any:
        config = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        backend = self.guided_decoding_backend
        if backend is not None and backend != config.backend:
            if self.structured_outputs_config is not None:
                raise ValueError(f"guided_decoding_backend ({backend}) contradicts structured_outputs_config "
                                 f"(backend {config.backend}); give one of them")
            config = StructuredOutputsConfig(backend=backend, compile_timeout_s=config.compile_timeout_s)
        return config


    def _log_ignored(self) -> None:
        for f in fields(self):
            reason = f.metadata.get("ignored")
            if reason and getattr(self, f.name) != f.default and f.name not in _LOGGED_IGNORED:
                _LOGGED_IGNORED.add(f.name)
                logger.info("%s=%r is accepted and ignored: %s", f.name, getattr(self, f.name), reason)


_LOGGED_IGNORED: set[str] = set()  # each ignored setting is logged once per process


@dataclass
class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the settings of an engine served asynchronously: the same settings."""


def _parser_for(annotation: str) -> Callable[[str], Any]:
    """argparse type of a field from its (string) annotation: int, float or str."""
    base = annotation.replace(" | None", "")
    return {"int": int, "float": float}.get(base, str)


def compatibility_table() -> str:
    """The engine-settings table of docs/vllm_compatibility.md (a test keeps the doc equal to it)."""
    flags = cli_flag_names()
    lines = ["| setting (`LLM(...)`) | flags | compared with vLLM |", "|---|---|---|"]
    for f in fields(EngineArgs):
        flag = ", ".join(f"`{name}`" for name in flags.get(f.name, [])) or "(API only)"
        if f.name == "model":
            flag = "`MODEL`, `--model`"
        lines.append(f"| `{f.name}` | {flag} | {f.metadata['vllm']} |")
    return "\n".join(lines) + "\n"


def engine_setting_names() -> list[str]:
    """Every setting's name, in definition order (the keywords `LLM(...)` accepts)."""
    return [f.name for f in fields(EngineArgs)]


def cli_flag_names() -> dict[str, list[str]]:
    """setting -> its flags, for the settings that have flags (docs and tests)."""
    return {
        f.name: [f.metadata["flag"] or "--" + f.name.replace("_", "-"), *f.metadata["aliases"]]
        for f in fields(EngineArgs) if f.metadata.get("cli")
    }



if __name__ == "__main__":
    print(compatibility_table(), end="")
