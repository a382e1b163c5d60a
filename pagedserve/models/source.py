"""What the engine needs to know about a checkpoint before building anything.

    ModelConfig.model --hub.resolve_model_path--> a folder or a .gguf file
        -> hf config (config.json or GGUF metadata) -> serving dtype (dtype="auto")
        -> EOS ids (config, tokenizer, generation_config.json)
        -> sampling defaults (generation_config.json, `generation_config="auto"`)

Resolved once at start-up; the engine keeps the result, the frozen config is not touched.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from pagedserve.config import ModelConfig
from pagedserve.dtypes import serving_dtype
from pagedserve.models.gguf import gguf_eog_token_ids
from pagedserve.models.hub import is_gguf, looks_like_hub_id, resolve_hub_id, resolve_model_path
from pagedserve.models.loader import check_gguf_quantization, checkpoint_dtype, load_hf_config

logger = logging.getLogger(__name__)

# generation_config.json fields that become request defaults (vLLM's list), -> SamplingParams.
_SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class ModelSource:
    path: str  # a local folder or .gguf file
    tokenizer: str | None  # a local folder or .gguf file; None with skip_tokenizer_init
    hf_config: PretrainedConfig
    dtype: torch.dtype
    # From the checkpoint's generation_config.json (empty with generation_config="vllm"):
    # its EOS ids, and the sampling fields requests take unless they set them.
    generation_eos_ids: tuple[int, ...] = ()
    sampling_defaults: dict[str, Any] = field(default_factory=dict)


def resolve_model_source(model_cfg: ModelConfig, device: torch.device) -> ModelSource:
    """Locate the checkpoint and read what the engine decides from it.

    Raises:
        FileNotFoundError: no such model (the message says where it looked).
        ValueError: unsupported architecture, dtype or checkpoint.
    """
    path = resolve_model_path(model_cfg.model, model_cfg.revision, model_cfg.download_dir)
    if model_cfg.quantization == "gguf":
        check_gguf_quantization(path)  # before the tokenizer and config are read
    tokenizer = None
    if not model_cfg.skip_tokenizer_init:
        tokenizer = _resolve_tokenizer(model_cfg, path)
    hf_config = load_hf_config(path)
    stored = checkpoint_dtype(path, hf_config)
    dtype = serving_dtype(model_cfg.dtype, device, stored, dequantized=is_gguf(path) and stored is None)
    generation = _generation_config(model_cfg.generation_config, path)
    eos = generation.get("eos_token_id")
    eos_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
    if is_gguf(path) and model_cfg.generation_config == "auto":
        eos_ids += gguf_eog_token_ids(path)  # what llama.cpp ends on (Gemma's <end_of_turn>)
    defaults = {ours: generation[theirs] for theirs, ours in _SAMPLING_FIELDS.items()
                if generation.get(theirs) is not None}
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s "
                    "(--generation-config vllm ignores them)", defaults)
    return ModelSource(path, tokenizer, hf_config, dtype, eos_ids, defaults)


def _resolve_tokenizer(model_cfg: ModelConfig, model_path: str) -> str:
    name = model_cfg.tokenizer
    if name is None:
        return model_path
    if os.path.exists(name):
        return name
    if looks_like_hub_id(name):
        return str(resolve_hub_id(name, None, model_cfg.download_dir))
    raise FileNotFoundError(f"tokenizer {name!r}: no such folder or file, and not a hub id")


def _generation_config(mode: str, model_path: str) -> dict[str, Any]:
    """generation_config.json as a dict: the model folder's ("auto"), none ("vllm"), or the
    one in the folder `mode` names. A GGUF file has none."""
    if mode == "vllm":
        return {}
    folder = Path(model_path) if mode == "auto" else Path(mode)
    if mode != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder; {mode!r} is not a folder")
    file = folder / "generation_config.json"
    if not folder.is_dir() or not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file}: not a readable JSON file: {exc}") from exc


def eos_token_ids(hf_config: Any, tokenizer: Any, generation_eos: tuple[int, ...]) -> list[int]:
    """Every id that ends a sequence, the primary one first: config.json's eos_token_id
    (an int or a list: Llama 3 Instruct declares three), else the tokenizer's, then any
    more that generation_config.json lists."""
    eos = getattr(hf_config, "eos_token_id", None)
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    for extra in generation_eos:
        if extra not in ids:
            ids.append(extra)
    return ids
