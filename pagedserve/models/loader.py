"""Build a model from a Hugging Face folder and load its safetensors weights by name.

    config.json                       -> AutoConfig -> registry (config.architectures[0])
    model.safetensors                 -> one file, or
    model.safetensors.index.json      -> {"weight_map": {tensor name: shard file}}

Weights go through each parameter's `weight_loader`, so fused projections are filled
shard by shard via the model's `stacked_params_mapping`; afterwards every parameter (and
every shard of a fused one) must have been loaded.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from pagedserve.models.layers.linear import default_weight_loader
from pagedserve.models.registry import get_model_class

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Checkpoint tensors that are derived at run time, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    model_path: str | Path, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, PretrainedConfig]:
    """Build the model for the folder's config on `device` in `dtype` and load its weights.

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
    config = AutoConfig.from_pretrained(path)
    _check_not_quantized(config)
    architectures = getattr(config, "architectures", None) or []
    if not architectures:
        raise ValueError(f"{path / 'config.json'} names no 'architectures'")
    model_cls = get_model_class(architectures[0])
    with _default_dtype(dtype), torch.device(device):
        model = model_cls(config)
    load_weights(model, iter_checkpoint(path))
    return model.eval(), config


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


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors into `model`'s parameters; ValueError if any is missing/unexpected."""
    params = dict(model.named_parameters())  # a tied lm_head appears once, as the embedding
    mapping = getattr(model, "stacked_params_mapping", [])
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    loaded: set[tuple[str, object]] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
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
    expected = {(n, s) for n, p in params.items() for s in getattr(p, "shard_ids", (None,))}
    missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match {type(model).__name__}: "
            f"missing {missing[:10]}{'...' if len(missing) > 10 else ''}, "
            f"unexpected {unexpected[:10]}{'...' if len(unexpected) > 10 else ''}"
        )
