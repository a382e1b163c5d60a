"""Reading a PEFT LoRA adapter folder into fp32 per-(layer, module) weights, or refusing it.

A folder holds `adapter_config.json` and `adapter_model.safetensors` (or `.bin`) with, per
adapted projection (PEFT's key names, no adapter name since peft 0.3):

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   (r, in_dim)
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   (out_dim, r)

and delta W = scale * B @ A with scale = alpha / r (alpha / sqrt(r) with use_rslora), r and
alpha per module from rank_pattern / alpha_pattern, matched against the module key
`model.layers.{i}.self_attn.q_proj` exactly as peft matches them.

The weights file decides which modules are adapted (so layers_to_transform and
exclude_modules need no special handling); target_modules is only cross-checked.
fan_in_fan_out is accepted and ignored: it describes the *base* weight's storage (GPT-2's
Conv1D), while lora_A / lora_B are always nn.Linear-shaped, and peft itself resets it to
False for nn.Linear targets (peft/tuners/lora/layer.py), as every Llama/Qwen2 projection is.

Models whose MLPs take no adapters (Qwen3-MoE: experts and a router; models/qwen3_moe.py)
pass `module_dims_for(config, modules)` only their attention projections; an adapter that
adapts anything else is refused naming the module (an MLP, expert or router weight).

Fused projections (Phi-3's `qkv_proj` and `gate_up_proj`, which the model splits at load)
are split here too: the fused delta scale * B @ A is, row block by row block, scale * B_q @ A,
scale * B_k @ A, ..., so each part is a LoRA of the same rank sharing A, exactly.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedserve.lora.request import LoRARequest

TARGETABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT_MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Fused checkpoint projections -> their parts, in the order of the fused weight's rows.
FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_EMBEDDINGS = ("embed_tokens", "lm_head")
_CONFIG = "adapter_config.json"
_SAFETENSORS = "adapter_model.safetensors"
_BIN = "adapter_model.bin"
_KEY_RE = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[A-Za-z_][\w-]*)?\.weight$")
_MODULE_RE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<parent>self_attn|mlp)\.(?P<name>\w+)$")
_PREFIX = "base_model.model."

# Config options this loader refuses: key -> (is it in use?, what to say).
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "use_dora": (bool, "DoRA (use_dora=true) is not supported"),
    "modules_to_save": (bool, "modules_to_save (fully trained extra modules) is not supported"),
    "lora_bias": (bool, "lora_bias=true is not supported"),
    "layer_replication": (bool, "layer_replication is not supported"),
    "trainable_token_indices": (bool, "trainable_token_indices is not supported"),
    "use_qalora": (bool, "QALoRA (use_qalora=true) is not supported"),
    "alora_invocation_tokens": (bool, "activated LoRA (alora_invocation_tokens) is not supported"),
}


class LoRALoadError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the problem."""


@dataclass
class LoRAModuleWeights:
    lora_a: torch.Tensor  # (rank, in_dim) float32
    lora_b: torch.Tensor  # (out_dim, rank) float32
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    int_id: int
    path: str
    rank: int  # max over modules
    weights: dict[tuple[int, str], LoRAModuleWeights]  # (layer index, module name)


Fail = Callable[[str], LoRALoadError]


def module_dims_for(config: Any, modules: Sequence[str] = TARGETABLE) -> dict[str, tuple[int, int]]:
    """(in_dim, out_dim) of the projections of a Llama-style HF config that take adapters:
    `modules` of TARGETABLE (the model's `lora_targets`, lora/layers.py)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    dims = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    return {name: dims[name] for name in TARGETABLE if name in modules}


def load_peft_adapter(
    request: LoRARequest,
    module_dims: dict[str, tuple[int, int]],
    num_layers: int,
    max_lora_rank: int,
    confine_to: pathlib.Path | None = None,
) -> LoRAAdapter:
    """Read, validate and convert the adapter at `request.lora_path` on the calling thread
    (`read_peft_adapter`, then `to_adapter`; see there for the arguments and errors)."""
    return to_adapter(read_peft_adapter(request, module_dims, num_layers, max_lora_rank, confine_to))


@dataclass
class _StoredModule:
    """One adapted projection (fused ones whole) as stored in the file, already checked."""

    key: str
    layer: int
    parts: tuple[str, ...]
    out_dims: list[int]
    lora_a: torch.Tensor  # the file's dtype
    lora_b: torch.Tensor
    scale: float


@dataclass
class AdapterFile:
    """An adapter folder read and checked, its tensors as stored: `read_peft_adapter`'s result.

    Split from `to_adapter` so that a background thread does the file reading and runs no torch
    operator: an operator large enough to go parallel starts an OpenMP worker pool for that
    thread, and with two pools in the process every parallel region of the engine thread costs
    ~50 us more (after one adapter load, the engine thread's 64k-float add took 73 us instead
    of 8.5; engine/engine_thread.py)."""

    request: LoRARequest
    modules: list[_StoredModule]


def read_peft_adapter(
    request: LoRARequest,
    module_dims: dict[str, tuple[int, int]],
    num_layers: int,
    max_lora_rank: int,
    confine_to: pathlib.Path | None = None,
) -> AdapterFile:
    """Read and validate the adapter at `request.lora_path`; no torch arithmetic (any thread).

    Args:
        module_dims: module name -> (in_dim, out_dim) of the base model's projection.
        num_layers: decoder layers of the base model.
        max_lora_rank: the engine's largest servable rank.
        confine_to: if given (a resolved folder), every file read must resolve inside it,
            so a symlink cannot make the loader read elsewhere (the server's --lora-dir).

    Raises:
        LoRALoadError: missing or corrupt files, an unsupported feature (DoRA,
            modules_to_save, biases, embedding / lm_head LoRA, untargetable modules), shapes
            that do not fit the model, a rank above max_lora_rank or a layer out of range.
    """
    fail = _failure(request)
    files = _AdapterFiles(pathlib.Path(request.lora_path), confine_to, fail)
    try:
        config = _read_config(files, fail)
        _check_config(config, tuple(module_dims), fail)
        tensors = _read_tensors(files, fail)
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, no permission ...
        if isinstance(exc, LoRALoadError):
            raise
        raise fail(f"cannot read the adapter folder: {exc}") from exc
    pairs = _group_tensors(tensors, fail)
    modules: list[_StoredModule] = []
    adapted: set[tuple[int, str]] = set()
    for key, ab in sorted(pairs.items()):
        layer, name = _locate(key, config["target_modules"], num_layers, module_dims, fail)
        parts = FUSED_TARGETS.get(name, (name,))
        out_dims = [module_dims[part][1] for part in parts]
        a, b, scale = _check_module(key, ab, config, (module_dims[parts[0]][0], sum(out_dims)), max_lora_rank, fail)
        for part in parts:
            if (layer, part) in adapted:
                raise fail(f"{key}: layer {layer}'s {part} is adapted twice (fused and on its own)")
            adapted.add((layer, part))
        modules.append(_StoredModule(key, layer, parts, out_dims, a, b, scale))
    if not modules:
        raise fail("the weights file holds no lora_A / lora_B tensors")
    return AdapterFile(request, modules)


def to_adapter(read: AdapterFile) -> LoRAAdapter:
    """fp32 weights per (layer, module), fused projections split; on the thread that runs the model.

    Raises:
        LoRALoadError: non-finite values in the weights.
    """
    fail = _failure(read.request)
    weights: dict[tuple[int, str], LoRAModuleWeights] = {}
    for module in read.modules:
        a, b = module.lora_a.float().contiguous(), module.lora_b.float().contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise fail(f"{module.key}: non-finite values in the weights")
        for part, b_part in zip(module.parts, b.split(module.out_dims), strict=True):
            weights[(module.layer, part)] = LoRAModuleWeights(a, b_part.contiguous(), module.scale)
    rank = max(w.rank for w in weights.values())
    request = read.request
    return LoRAAdapter(request.lora_name, request.lora_int_id, request.lora_path, rank, weights)


def _failure(request: LoRARequest) -> Fail:
    def fail(problem: str) -> LoRALoadError:
        return LoRALoadError(
            f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}, "
            f"{request.lora_path}): {problem}"
        )

    return fail


class _AdapterFiles:
    """The adapter folder's files, each checked to resolve inside `confine_to` when given."""

    def __init__(self, folder: pathlib.Path, confine_to: pathlib.Path | None, fail: Fail) -> None:
        self.folder = folder
        self.confine_to = confine_to
        self.fail = fail

    def is_dir(self) -> bool:
        return self.folder.is_dir()

    def path(self, name: str) -> pathlib.Path | None:
        """The file to open (resolved), or None if there is none; refused if it escapes."""
        path = self.folder / name
        if not path.is_file():
            return None
        if self.confine_to is None:
            return path
        resolved = pathlib.Path(path.resolve())
        if not resolved.is_relative_to(self.confine_to):
            raise self.fail(f"{name} resolves outside the allowed folder {self.confine_to} (a symlink?)")
        return resolved


def _read_config(files: _AdapterFiles, fail: Fail) -> dict[str, Any]:
    if not files.is_dir():
        raise fail("adapter folder not found")
    path = files.path(_CONFIG)
    if path is None:
        raise fail(f"missing {_CONFIG}")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise fail(f"corrupt {_CONFIG}: {exc}") from exc
    if not isinstance(config, dict):
        raise fail(f"corrupt {_CONFIG}: not a JSON object")
    return config


def _check_config(config: dict[str, Any], adaptable: tuple[str, ...], fail: Fail) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise fail(f"peft_type {peft_type!r} is not supported (only LORA)")
    for key, (in_use, message) in _REFUSED.items():
        if in_use(config.get(key)):
            raise fail(message)
    # transformers 5 stores MoE experts and routers as raw parameters, which PEFT adapts here
    # (it turns target_modules=["down_proj"] on Qwen3-MoE into target_parameters ["down_proj"]).
    if config.get("target_parameters"):
        raise fail(f"target_parameters {config['target_parameters']!r} is not supported (LoRA on raw "
                   f"parameters, such as MoE experts and routers); adapters may target {', '.join(adaptable)}")
    bias = config.get("bias", "none")
    if bias != "none":
        raise fail(f"bias={bias!r} is not supported (only bias='none')")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise fail(f"invalid r={r!r} in {_CONFIG}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise fail(f"invalid lora_alpha={alpha!r} in {_CONFIG}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise fail(f"invalid {key} in {_CONFIG} (expected an object)")
    _check_targets(config.get("target_modules"), adaptable, fail)


def _not_adaptable(module: str, adaptable: tuple[str, ...]) -> str:
    return (f"{module} is not a projection this model takes adapters on (an MLP, expert or router "
            f"weight?); it takes them on {', '.join(adaptable)} only")


def _check_targets(targets: Any, adaptable: tuple[str, ...], fail: Fail) -> None:
    """target_modules: a list of (suffixes of) module names, a regex, or "all-linear"."""
    if isinstance(targets, str):
        if targets.lower() == "all-linear":
            return
        try:
            pattern = re.compile(targets)
        except re.error as exc:
            raise fail(f"target_modules regex {targets!r} is invalid: {exc}") from exc
        for name in ("model.embed_tokens", "lm_head"):
            if pattern.fullmatch(name):
                raise fail(f"embedding / lm_head LoRA is not supported (target_modules matches {name})")
        return
    if not isinstance(targets, list | tuple) or not targets:
        raise fail(f"target_modules must be a non-empty list or a string, got {targets!r}")
    for target in targets:
        last = str(target).rsplit(".", 1)[-1]
        if last in _EMBEDDINGS:
            raise fail(f"embedding / lm_head LoRA is not supported (target_modules has {target!r})")
        parts = FUSED_TARGETS.get(last, (last,))
        if any(part in TARGETABLE and part not in adaptable for part in parts):
            raise fail(f"target module {target!r}: " + _not_adaptable(str(target), adaptable))
        if parts[0] not in TARGETABLE:
            fused = [name for name, fused_parts in FUSED_TARGETS.items() if set(fused_parts) <= set(adaptable)]
            raise fail(f"target module {target!r} is not supported (targetable: {', '.join(adaptable + tuple(fused))})")


def _read_tensors(files: _AdapterFiles, fail: Fail) -> dict[str, torch.Tensor]:
    safetensors_path = files.path(_SAFETENSORS)
    if safetensors_path is not None:
        from safetensors.torch import load_file

        try:
            return load_file(str(safetensors_path))
        except Exception as exc:  # SafetensorError, OSError, ...: any unreadable file
            raise fail(f"corrupt {_SAFETENSORS}: {exc}") from exc
    bin_path = files.path(_BIN)
    if bin_path is not None:
        try:
            tensors = torch.load(bin_path, map_location="cpu", weights_only=True)
        except Exception as exc:  # pickle / zip errors, disallowed globals
            raise fail(f"corrupt {_BIN}: {exc}") from exc
        if not isinstance(tensors, dict) or not all(
            isinstance(t, torch.Tensor) for t in tensors.values()
        ):
            raise fail(f"corrupt {_BIN}: not a dict of tensors")
        return tensors
    raise fail(f"missing {_SAFETENSORS} (or {_BIN})")


def _group_tensors(
    tensors: dict[str, torch.Tensor], fail: Fail
) -> dict[str, dict[str, torch.Tensor]]:
    """File keys -> {module key: {"A": lora_A, "B": lora_B}}, refusing any other tensor."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if "lora_embedding_" in key:
            raise fail(f"embedding LoRA is not supported (tensor {key!r})")
        if "lora_magnitude_vector" in key:
            raise fail(f"DoRA is not supported (tensor {key!r})")
        match = _KEY_RE.match(key)
        if match is None:
            what = "lora_bias is not supported" if ".lora_" in key else "unexpected tensor"
            raise fail(f"{what} ({key!r})")
        module = match["module"].removeprefix(_PREFIX)
        pairs.setdefault(module, {})[match["ab"]] = tensor
    return pairs


def _locate(
    key: str,
    targets: Any,
    num_layers: int,
    module_dims: dict[str, tuple[int, int]],
    fail: Fail,
) -> tuple[int, str]:
    """Module key `model.layers.{i}.{self_attn|mlp}.{name}` -> (i, name), validated."""
    name = key.rsplit(".", 1)[-1]
    if name in _EMBEDDINGS:
        raise fail(f"embedding / lm_head LoRA is not supported ({key})")
    match = _MODULE_RE.match(key)
    parts = FUSED_TARGETS.get(name, (name,))
    adaptable = tuple(module_dims)
    if ".mlp." in key and not any(PARENT_MODULE[m] == "mlp" for m in adaptable):
        # Experts (`mlp.experts.E.gate_proj`), the router (`mlp.gate`) or a dense layer's MLP.
        raise fail(_not_adaptable(key, adaptable))
    if match is None or parts[0] not in TARGETABLE or PARENT_MODULE[parts[0]] != match["parent"]:
        raise fail(f"unsupported LoRA target {key!r} (targetable: {', '.join(TARGETABLE)}, "
                   f"or fused {', '.join(FUSED_TARGETS)})")
    missing = [part for part in parts if part not in module_dims]
    if missing:
        raise fail(f"{key}: the model has no {missing[0]} projection")
    layer = int(match["layer"])
    if layer >= num_layers:
        raise fail(f"{key}: layer index {layer} out of range (the model has {num_layers} layers)")
    if not _targeted(targets, key):
        raise fail(f"{key} has weights but is not in target_modules")
    return layer, name


def _targeted(targets: Any, key: str) -> bool:
    """peft's check_target_module_exists for the three forms of target_modules."""
    if isinstance(targets, str):
        return targets.lower() == "all-linear" or re.fullmatch(targets, key) is not None
    return key in targets or any(key.endswith(f".{t}") for t in targets)


def _check_module(
    key: str,
    ab: dict[str, torch.Tensor],
    config: dict[str, Any],
    dims: tuple[int, int],
    max_lora_rank: int,
    fail: Fail,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(lora_A, lora_B, scale) of one module key, shapes and ranks checked; tensors untouched."""
    if set(ab) != {"A", "B"}:
        raise fail(f"{key}: {'lora_B' if 'A' in ab else 'lora_A'} is missing from the weights file")
    a, b = ab["A"], ab["B"]
    in_dim, out_dim = dims
    r = a.shape[0] if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, in_dim) or tuple(b.shape) != (out_dim, r):
        raise fail(
            f"{key}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the model's "
            f"projection (in {in_dim}, out {out_dim}): expected (r, {in_dim}) / ({out_dim}, r)"
        )
    if r > max_lora_rank:
        raise fail(f"{key}: rank {r} exceeds max_lora_rank {max_lora_rank}")
    r_config, alpha = _rank_alpha(config, key)
    if r != r_config:
        raise fail(f"{key}: rank {r} in the weights, but {r_config} in {_CONFIG}")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    return a, b, float(scale)


def _rank_alpha(config: dict[str, Any], key: str) -> tuple[int, float]:
    """(r, alpha) of module `key` after rank_pattern / alpha_pattern, as peft resolves them."""
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    r = rank_pattern.get(_pattern_key(rank_pattern, key), config.get("r", 8))
    alpha = alpha_pattern.get(_pattern_key(alpha_pattern, key), config.get("lora_alpha", 8))
    return int(r), float(alpha)


def _pattern_key(patterns: Iterable[str], key: str) -> str:
    """peft.utils.other.get_pattern_key (first pattern matching a suffix of `key`, else key).

    peft is only a test dependency, so its helper is used when installed and mirrored here
    otherwise.
    """
    patterns = list(patterns)
    if not patterns:
        return key
    try:
        from peft.utils.other import get_pattern_key
    except ImportError:
        for pattern in patterns:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return pattern
        return key
    return get_pattern_key(patterns, key)
