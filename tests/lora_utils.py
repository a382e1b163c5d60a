"""PEFT LoRA adapters for the tests, built with peft on the random demo models and cached.

`make_peft_adapter` trains nothing: it creates the adapter with peft's own LoraConfig /
get_peft_model / save_pretrained, so the folder is exactly what peft writes, with weights
that really change the model: A keeps peft's random init (init_lora_weights=False) and B
is random too, rescaled per module so that the delta scale * B @ A has `strength` times
the Frobenius norm of the base weight (0.3: greedy tokens change within a few steps, logits
stay of the same size).

Folders are cached under `<out_dir or ~/.cache/pagedserve/adapters>/<hash of the arguments
and the base model folder>`, written to a temporary folder and renamed into place.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from typing import Any

import torch

_FORMAT = 1  # bump when the construction below changes


def _cache_root(out_dir: str | os.PathLike[str] | None) -> pathlib.Path:
    if out_dir is not None:
        return pathlib.Path(out_dir)
    from pagedserve.demo_models import default_cache_dir

    return default_cache_dir() / "adapters"


def make_peft_adapter(
    base_model_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None,
    r: int,
    target_modules: list[str] | str,
    alpha: float | None = None,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    strength: float = 0.3,
) -> str:
    """Build (or reuse) a PEFT LoRA adapter of the model at `base_model_path`; its folder.

    Args:
        out_dir: parent folder of the cache (None: ~/.cache/pagedserve/adapters).
        target_modules: as LoraConfig takes it: names, a regex string or "all-linear".
        alpha: lora_alpha (default 2 * r).
        strength: ||scale * B @ A||_F / ||W||_F per adapted module.
    """
    spec = {
        "base": str(pathlib.Path(base_model_path).resolve()),
        "r": r, "target_modules": target_modules, "alpha": 2 * r if alpha is None else alpha,
        "use_rslora": use_rslora, "rank_pattern": rank_pattern or {},
        "alpha_pattern": alpha_pattern or {}, "seed": seed, "strength": strength,
        "format": _FORMAT,
    }
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    root = _cache_root(out_dir)
    folder = root / f"lora-r{r}-{digest}"
    if (folder / "adapter_config.json").is_file():
        return str(folder)
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    try:
        _build(spec, tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # built concurrently by another process: keep theirs
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def _build(spec: dict[str, Any], out: pathlib.Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32)
    config = LoraConfig(
        r=spec["r"], lora_alpha=spec["alpha"], target_modules=spec["target_modules"],
        use_rslora=spec["use_rslora"], rank_pattern=spec["rank_pattern"],
        alpha_pattern=spec["alpha_pattern"], lora_dropout=0.0, bias="none",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(spec["seed"] + 1)
    with torch.no_grad():
        for module in peft_model.modules():
            if not hasattr(module, "lora_A") or "default" not in module.lora_A:
                continue
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            b.copy_(torch.randn(b.shape, generator=gen))
            delta = module.scaling["default"] * b @ a
            b.mul_(spec["strength"] * module.base_layer.weight.norm() / delta.norm())
    peft_model.save_pretrained(str(out))


@functools.lru_cache(maxsize=8)
def peft_reference_model(base_model_path: str, adapter_path: str) -> Any:
    """`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)`, fp32,
    eval mode (cached: treat it as read-only)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_model_path), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_path))
    model.eval()
    return model


def peft_module_deltas(model: Any) -> dict[tuple[int, str], torch.Tensor]:
    """(layer, module name) -> peft's own delta W = scaling * B @ A, for every LoRA module."""
    deltas = {}
    for name, module in model.named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1])
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        deltas[(layer, parts[-1])] = (module.scaling["default"] * b @ a).detach()
    return deltas


@torch.inference_mode()
def peft_greedy(base_model_path: str, adapter_path: str, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy generate of the PEFT reference model for one prompt, without padding."""
    model = peft_reference_model(str(base_model_path), str(adapter_path))
    ids = torch.tensor([prompt])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
        do_sample=False, pad_token_id=model.config.pad_token_id,
    )
    return out[0, len(prompt):].tolist()


def peft_eager(model_path, adapter_path: str | None):
    """transformers (float32, eager attention) on `model_path`, with the PEFT adapter applied."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, attn_implementation="eager")
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_path)
    return model.eval()


def hf_greedy_tokens(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Exactly `new_tokens` greedy tokens after `prompt` (EOS not allowed to end early)."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
