"""Build a model from a Hugging Face folder or a GGUF file and load its weights by name.

    config.json                       -> AutoConfig -> registry (config.architectures[0])
    model.safetensors                 -> one file, or
    model.safetensors.index.json      -> {"weight_map": {tensor name: shard file}}
    model.gguf                        -> config, names and dequantized tensors (models/gguf.py)

Weights go through each parameter's `weight_loader`, so fused projections are filled
shard by shard via the model's `stacked_params_mapping`; afterwards every parameter (and
every shard of a fused one) must have been loaded. A model may rename checkpoint tensors
(`map_checkpoint_name`: prefixes of older checkpoints, buffers to skip).

With a QuantizationConfig every linear layer of the base model gets the config's method
before loading and is quantized as soon as its last shard is in, so the full-precision
weights of all layers never coexist: peak memory ~ the quantized model plus one layer
(untouched `torch.empty` pages of the not-yet-loaded layers are never resident).
Without one, CPU float32/bfloat16 layers are repacked the same way for oneDNN's GEMM
(quantization/packed.py).

A GGUF file's quantized matrices are served from the file's own blocks by default (on CPU, at
one rank; `QuantizationConfig("gguf")` says so explicitly): a linear layer whose tensors all
have an exact integer form (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS)
gets a method that takes the raw `GGUFQuantizedTensor` blocks (`iter_gguf_tensors(...,
keep_quantized=True)`, rows already in HF order) and installs them as group-wise int8 / int4
channel tiles without requantizing (quantization/gguf_blocks.py); by default the LM head (or
the tied embedding's blocks) too, installed after loading. Every other tensor (norms, the
embedding table, other types, float layers) is dequantized into the serving dtype (`dtype`
chooses the activations only); models/gguf.py logs which types and what it cost. An int8 /
int4 QuantizationConfig requantizes the dequantized weights instead; `load_model(...,
gguf_blocks=False)` dequantizes everything (the reference path).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagedserve import envs
from pagedserve.distributed.parallel_state import (
    TPGroup,
    check_tensor_parallel_size,
    tensor_parallel,
)
from pagedserve.models.gguf import (
    QUANTIZED_TYPES,
    GGUFQuantizedTensor,
    gguf_raw_tensor,
    gguf_tensor_types,
    gguf_weight_types,
    iter_gguf_tensors,
    load_gguf_config,
)
from pagedserve.models.hub import is_gguf
from pagedserve.models.layers.embedding import LMHead
from pagedserve.models.layers.linear import LinearBase, RowParallelLinear, default_weight_loader
from pagedserve.models.registry import get_model_class
from pagedserve.quantization import PER_CHANNEL, QuantizationConfig, UnquantizedLinearMethod
from pagedserve.quantization.packed import PACKED, onednn_available
from pagedserve.quantization.selector import get_linear_method, gguf_activations

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Checkpoint tensors that are derived at run time, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_path: str | Path,
    dtype: torch.dtype,
    device: torch.device,
    quantization: QuantizationConfig | None = None,
    tp: TPGroup | None = None,
    gguf_blocks: bool = True,
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the model for the folder's config on `device` in `dtype` and load its weights.

    With `quantization`, linear weights are quantized while loading (see module docstring).
    Without, a quantized .gguf file's blocks are served as they are unless `gguf_blocks` is
    False (every tensor dequantized at load: the reference path tests and benchmarks compare).
    With a tensor-parallel group `tp`, this rank's shard is built and loaded (every rank reads
    the full checkpoint and narrows each tensor), then quantized: each rank quantizes its shard.

    Raises:
        ValueError: unsupported dtype, architecture (names it, lists the supported ones),
            config option (names it), pre-quantized checkpoint, or missing/unexpected weights.
        FileNotFoundError: no safetensors checkpoint in the folder.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"unsupported dtype {dtype}; supported: {', '.join(map(str, SUPPORTED_DTYPES))}"
        )
    path = Path(model_path)
    config = load_hf_config(path)
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{path / 'config.json'} names no 'architectures'")
    model_cls = get_model_class(architectures[0])
    if tp is not None:
        check_tensor_parallel_size(config, tp.size)
    serve_blocks = quantization is not None and quantization.method == "gguf"
    if serve_blocks:
        check_gguf_quantization(path, tp)
    elif quantization is None and gguf_blocks and _serves_gguf_blocks_by_default(path, torch.device(device), tp):
        serve_blocks = True  # a quantized file is served as it is, as llama.cpp does
    native: frozenset[str] = frozenset()
    head_blocks, head_name = False, ""
    with _default_dtype(dtype), torch.device(device), tensor_parallel(tp):
        model = model_cls(config)
        if serve_blocks:
            types = gguf_tensor_types(path, config)
            activations = gguf_activations(quantization)
            native = attach_gguf_methods(model, types, torch.device(device), activations)
            head_name, head_type = _head_tensor(types, config)
            # quantization="gguf" serves the head from the file's blocks too, as the default
            # does (it dequantized it to float32: 519 of the 0.5B's 777 MiB a step); only
            # quantize_lm_head asks for the int8 copy instead.
            head_blocks = not (quantization is not None and quantization.quantize_lm_head) \
                and _attach_head_method(model, head_type, activations)
            if quantization is not None and quantization.quantize_lm_head:
                # int8 blocks of 32: a Q8_0 head's own numbers
                attach_quant_methods(model, QuantizationConfig("int8", quantize_lm_head=True),
                                     torch.device(device), heads_only=True)
        elif quantization is not None:
            attach_quant_methods(model, quantization, torch.device(device))
        attach_packed_methods(model, torch.device(device))
    if is_gguf(path):
        load_weights(model, iter_gguf_tensors(path, config, dtype, keep_quantized=native))
        if head_blocks:
            from pagedserve.quantization.gguf_blocks import install_head

            tied = bool(getattr(config, "tie_word_embeddings", False))
            install_head(_lm_head(model), gguf_raw_tensor(path, config, head_name), tied)
    else:
        load_weights(model, iter_checkpoint(path))
    logger.info("weights: %.1f MiB resident (%s)", weight_bytes(model) / 2**20, _describe(model))
    return model.eval(), config


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """The model's config: config.json of a folder, or the metadata of a .gguf file."""
    if is_gguf(path):
        return load_gguf_config(path)
    config = AutoConfig.from_pretrained(path)
    _check_not_quantized(config)
    return config


def checkpoint_dtype(path: str | Path, config: PretrainedConfig) -> torch.dtype | None:
    """The dtype the weights are stored in: config.json's `dtype`/`torch_dtype` for a folder;
    for a GGUF file float32 if every matrix is F32, float16/bfloat16 if all are, and None
    when they are quantized (dequantized at load, so any float dtype is as exact)."""
    if is_gguf(path):
        types = gguf_weight_types(path)
        by_type = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        dtypes = {by_type.get(t) for t in types}
        return dtypes.pop() if len(dtypes) == 1 else None
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) else None


def attach_quant_methods(
    model: nn.Module, quantization: QuantizationConfig, device: torch.device, heads_only: bool = False
) -> None:
    """Give every linear layer (and the LM head if asked) the config's method, before loading;
    `heads_only`: the LM head alone (quantization='gguf' with quantize_lm_head).

    A layer the method cannot take (input size not a multiple of its group size; for int4
    also output size not a multiple of 16) gets per-channel int8 instead, and is named in
    a warning.
    """
    if device.type != "cpu":
        raise ValueError(
            f"quantization={quantization.method!r} has CPU kernels only (device {device}); "
            "a GPU kernel slots in as another LinearMethod"
        )
    method = get_linear_method(quantization)
    fallback = get_linear_method(QuantizationConfig("int8", group_size=PER_CHANNEL))
    fell_back = []
    for name, module in model.named_modules():
        wanted = (isinstance(module, LinearBase) and not heads_only) or (
            isinstance(module, LMHead) and quantization.quantize_lm_head
        )
        if not wanted:
            continue
        _check_groups_within_shard(name, module, quantization)
        if method.supports(module):
            module.set_quant_method(method)
        else:
            module.set_quant_method(fallback)
            fell_back.append(name)
    if fell_back:
        logger.warning(
            "%s kernel cannot take these layers' shapes; they use %s: %s",
            method.name, fallback.name, ", ".join(fell_back),
        )


def check_shardable(
    path: str | Path, tp_size: int, quantization: QuantizationConfig | None = None
) -> None:
    """ValueError naming the setting when this model cannot be split over `tp_size` ranks:
    heads, MLP or (with `quantization`) a row-parallel layer's quantization groups. The
    model is built on the meta device as rank 0 would build it (no memory, no weights), so
    the engine refuses before starting any worker process."""
    config = load_hf_config(path)
    check_tensor_parallel_size(config, tp_size)
    if quantization is not None and quantization.method == "gguf":
        check_gguf_quantization(path, TPGroup(rank=0, size=tp_size))
    with torch.device("meta"), tensor_parallel(TPGroup(rank=0, size=tp_size)):
        model = get_model_class(config.architectures[0])(config)
    if quantization is not None:
        for name, module in model.named_modules():
            _check_groups_within_shard(name, module, quantization)


def _check_groups_within_shard(name: str, module: nn.Module, quantization: QuantizationConfig) -> None:
    """A row-parallel layer's shard must hold whole quantization groups: a group straddling
    two ranks' columns would need both halves to compute its scale."""
    if not isinstance(module, RowParallelLinear) or module.tp.size == 1:
        return
    group = quantization.effective_group_size
    if group != PER_CHANNEL and module.total_input_size % group == 0 and module.input_size % group:
        raise ValueError(
            f"quantization_group_size={group} does not divide {name}'s input shard of "
            f"{module.input_size} columns (input {module.total_input_size} / tensor_parallel_size="
            f"{module.tp.size}): its groups would straddle two ranks; use a smaller group size "
            "or another tensor_parallel_size"
        )


def _serves_gguf_blocks_by_default(path: Path, device: torch.device, tp: TPGroup | None) -> bool:
    """No quantization asked: a .gguf file with quantized matrices is served from its own
    blocks (quantization='gguf') on CPU at one rank; elsewhere (GPU, tensor parallel: the
    blocks are not sharded) it is dequantized at load as before."""
    if not is_gguf(path) or device.type != "cpu" or (tp is not None and tp.size > 1):
        return False
    return bool(gguf_weight_types(path) & set(QUANTIZED_TYPES))


def _head_tensor(types: dict[str, str], config: PretrainedConfig) -> tuple[str, str]:
    """(HF name, GGUF type) of the LM head's weight: the token embedding's when they are tied."""
    if getattr(config, "tie_word_embeddings", False) or "lm_head.weight" not in types:
        return next(((n, t) for n, t in types.items() if n.endswith("embed_tokens.weight")), ("", "missing"))
    return "lm_head.weight", types["lm_head.weight"]


def _lm_head(model: nn.Module) -> nn.Module:
    return next(m for m in model.modules() if isinstance(m, LMHead))


def _attach_head_method(model: nn.Module, qtype: str, activations: str) -> bool:
    """By default the LM head too is served from the file's blocks (it is a tenth to a third
    of a small model's bytes per token: Qwen2.5-Coder-1.5B's Q6_K head dequantized to float32
    read 0.93 GB a token): its GGUF method, before loading, so no float copy is packed; the
    blocks go in after loading (`install_head`). Whether it was attached."""
    from pagedserve.quantization import gemv
    from pagedserve.quantization.gguf_blocks import gguf_method

    head = _lm_head(model)
    if head.tp.size != 1:
        return False
    method = gguf_method({qtype}, gemv.gemv_ops() is not None and head.output_size % gemv.TILE == 0, activations)
    if method is None:
        return False
    head.set_quant_method(method)
    return True


def check_gguf_quantization(path: str | Path, tp: TPGroup | None = None) -> None:
    """quantization='gguf' serves a .gguf file's blocks; anything else is refused (named)."""
    if not is_gguf(path):
        raise ValueError(
            f"quantization='gguf' serves the quantized blocks of a .gguf model file, but the "
            f"model {str(path)!r} is not one (use int8 / int4 to quantize other checkpoints)"
        )
    if tp is not None and tp.size > 1:
        # The file's blocks are loaded whole; cutting them into rank shards is not written yet.
        raise ValueError(
            "quantization='gguf' is not supported with tensor_parallel_size > 1 (the GGUF "
            "blocks are not sharded); use int8 / int4, which quantize each rank's shard"
        )


def attach_gguf_methods(
    model: nn.Module, types: dict[str, str], device: torch.device, activations: str = "none"
) -> frozenset[str]:
    """quantization='gguf' (the default for a quantized .gguf file): each linear layer whose
    checkpoint tensors (every shard of a fused one) all have a type with an exact integer
    form (quantization/gguf_decode.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, IQ4_NL,
    IQ4_XS) gets a method serving those numbers (quantization/gguf_blocks.py: int4 channel
    tiles for 4-bit types alone, else int8); the rest stay full precision (dequantized at
    load). Layers that only the GEMV kernel could serve, where it cannot take them (no AVX2,
    rows not a multiple of 16), are named in a warning and load dequantized.

    Returns: the checkpoint names (HF) of the tensors the methods take as raw blocks."""
    from pagedserve.quantization import gemv
    from pagedserve.quantization.gguf_blocks import TARGETS, gguf_method

    if device.type != "cpu":
        raise ValueError(f"quantization='gguf' has CPU kernels only (device {device})")
    mapping = getattr(model, "stacked_params_mapping", [])
    dequantized, counts = [], defaultdict(int)
    native: set[str] = set()
    kernel = gemv.gemv_ops() is not None
    for prefix, module in model.named_modules():
        if not isinstance(module, LinearBase):
            continue
        param_name = f"{prefix}.weight"
        names = [param_name.replace(ours, theirs) for theirs, ours, _ in mapping if ours in param_name]
        qtypes = {types.get(n, "missing") for n in (names or [param_name])}
        method = gguf_method(qtypes, kernel and module.output_size % gemv.TILE == 0, activations)
        if method is not None:
            module.set_quant_method(method)
            counts[method.name] += 1
            native.update(names or [param_name])
        elif qtypes <= set(TARGETS):  # quantized, but a form only the kernel serves
            dequantized.append(f"{prefix} ({'+'.join(sorted(qtypes))})")
    logger.info("quantization=gguf: %s", ", ".join(f"{n} {k} layers" for k, n in counts.items()) or "no layer")
    if dequantized:
        logger.warning("quantization=gguf: the GEMV kernel cannot take these layers here; they "
                       "load dequantized: %s", ", ".join(dequantized))
    return frozenset(native)


def attach_packed_methods(model: nn.Module, device: torch.device) -> None:
    """Full precision on CPU: multiply through oneDNN with prepacked weights when possible.

    Every linear layer and the LM head left in full precision (all of them, or the head of
    a quantized model) take it unless PAGEDSERVE_CPU_GEMM=torch, the torch build lacks
    oneDNN, or the dtype is not packable (float16 stays on F.linear).
    """
    choice = envs.cpu_gemm()
    if device.type != "cpu" or choice == "torch":
        return
    if not onednn_available():
        if choice == "onednn":
            raise ValueError("PAGEDSERVE_CPU_GEMM=onednn, but this torch build has no oneDNN")
        return
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        full_precision = method is None or isinstance(method, UnquantizedLinearMethod)
        if isinstance(module, LinearBase | LMHead) and full_precision and PACKED.supports(module):
            module.set_quant_method(PACKED)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` (shared storage counted once), plus
    the opaque prepacked weights a linear method may hold outside them."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            total += sum(
                t.numel() * t.element_size() for t in method.weight_tensors(module) if t.is_mkldnn
            )
    return total


def _describe(model: nn.Module) -> str:
    counts: dict[str, int] = defaultdict(int)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, LinearBase | LMHead) and method is not None:
            counts[method.name] += 1
    return ", ".join(f"{n} {name} linear layers" for name, n in sorted(counts.items()))


def _check_not_quantized(config: PretrainedConfig) -> None:
    quant = getattr(config, "quantization_config", None)
    if quant:
        method = (
            quant.get("quant_method")
            if isinstance(quant, dict)
            else getattr(quant, "quant_method", None)
        )
        raise ValueError(
            f"unsupported quantization_config (quant_method={method!r}): pre-quantized "
            "checkpoints (GPTQ, AWQ, ...) are not supported; use an unquantized checkpoint"
        )


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # Parameters are created with torch.empty under this default, so weights never exist
    # in float32 first when the model runs in bf16/fp16.
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the folder's safetensors checkpoint, on CPU."""
    index = path / "model.safetensors.index.json"
    single = path / "model.safetensors"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        by_file: dict[str, list[str]] = defaultdict(list)
        for name, file in weight_map.items():
            by_file[file].append(name)
        files = [(path / file, names) for file, names in sorted(by_file.items())]
    elif single.exists():
        files = [(single, None)]
    else:
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for file, names in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in names if names is not None else f.keys():
                yield name, f.get_tensor(name)


def load_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor | GGUFQuantizedTensor]]
) -> None:
    """Copy checkpoint tensors into `model`'s parameters; ValueError if any is missing/unexpected."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
    mapping = getattr(model, "stacked_params_mapping", [])
    rename = getattr(model, "map_checkpoint_name", None)
    # A checkpoint that stores projections fused (Phi-3's qkv_proj / gate_up_proj) is cut
    # into the per-projection tensors the stacked mapping routes to their shards.
    split = getattr(model, "split_checkpoint_tensor", None)
    if split is not None:
        weights = (part for name, tensor in weights for part in split(name, tensor))
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    quantizer = _QuantizeWhenLoaded(model, params)
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name) if rename is not None else ckpt_name
        if name is None or name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param_name, shard = name, None
        for ckpt_part, param_part, shard_id in mapping:
            if ckpt_part in name:
                param_name, shard = name.replace(ckpt_part, param_part), shard_id
                break
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        if isinstance(tensor, GGUFQuantizedTensor) and not getattr(param, "gguf_blocks", False):
            tensor = tensor.dequantize().to(param.dtype)  # a tensor served in full precision
        try:
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loader(param, tensor, shard)
            elif shard is None:
                default_weight_loader(param, tensor)  # plain parameters (norm weights)
            else:
                raise ValueError(f"parameter has no weight_loader for shard {shard!r}")
        except ValueError as e:
            raise ValueError(f"loading {name!r} into {param_name!r}: {e}") from e
        loaded.add((param_name, shard))
        quantizer.loaded(param_name, shard)
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match {type(model).__name__}: "
            f"missing {missing[:10]}{'...' if len(missing) > 10 else ''}, "
            f"unexpected {unexpected[:10]}{'...' if len(unexpected) > 10 else ''}"
        )
    quantizer.finish()


class _QuantizeWhenLoaded:
    """Runs each quantized layer's `process_weights_after_loading` once all its tensors
    (every shard of weight and bias) are loaded; `finish` does the rest (a tied LM head,
    whose weight is the embedding's and is never loaded under its own name)."""

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter]) -> None:
        self.params = params
        self.modules: dict[str, nn.Module] = {}
        self.waiting: dict[str, set[tuple[str, object]]] = {}
        for prefix, module in model.named_modules():
            method = getattr(module, "quant_method", None)
            if method is None or isinstance(method, UnquantizedLinearMethod):
                continue
            self.modules[prefix] = module
            self.waiting[prefix] = {
                (f"{prefix}.{n}", s)
                for n, p in module.named_parameters(recurse=False)
                if f"{prefix}.{n}" in params
                for s in getattr(p, "shard_ids", (None,))
            }

    def loaded(self, param_name: str, shard: object) -> None:
        prefix = param_name.rpartition(".")[0]
        waiting = self.waiting.get(prefix)
        if waiting is not None:
            waiting.discard((param_name, shard))
            if not waiting:
                self._process(prefix)

    def finish(self) -> None:
        for prefix in list(self.modules):
            self._process(prefix)

    def _process(self, prefix: str) -> None:
        module = self.modules.pop(prefix)
        del self.waiting[prefix]
        # Drop our references so the full-precision weight is freed as the method replaces it.
        for n, _ in module.named_parameters(recurse=False):
            self.params.pop(f"{prefix}.{n}", None)
        module.quant_method.process_weights_after_loading(module)
        release_free_memory()


def release_free_memory() -> None:
    """Hand memory freed by the allocator back to the OS (glibc `malloc_trim`; else a no-op).

    Freed full-precision weights and quantization temporaries of a few MiB land in glibc's
    heap (its mmap threshold rises after the first large free), which otherwise keeps them
    resident: without this, an int8 model's RSS after loading is that of the fp32 model.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None (another libc)."""
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
