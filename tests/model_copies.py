"""Model folders the speculative-decoding tests and benchmark need, built once and cached
under the demo-model cache dir: the real SmolLM2-135M-Instruct, and draft models made from
a target (its first layers; a copy with noisy weights).

SmolLM2 comes from the package's one GGUF -> HF converter (tests/real_model.py).
"""

from __future__ import annotations

import pathlib

from pagedserve.demo_models import _build_once, default_cache_dir, truncated_copy

__all__ = ["add_hub_snapshot", "noisy_copy", "smollm2_path", "truncated_copy"]


def add_hub_snapshot(cache: pathlib.Path, repo_id: str, source: pathlib.Path, refs: dict[str, str]) -> None:
    """Puts a copy of `source` in a Hugging Face cache the way huggingface_hub lays it out:
    models--org--name/snapshots/<commit>/... and refs/<ref> -> commit, for each ref."""
    import shutil

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref, commit in refs.items():
        if not (repo / "snapshots" / commit).exists():
            shutil.copytree(source, repo / "snapshots" / commit)
        (repo / "refs" / ref).write_text(commit)


def smollm2_path() -> pathlib.Path | None:
    """The converted HF folder (pagedserve.demo_adapters' one converter); None if the GGUF is
    not installed."""
    from real_model import smollm2_hf_folder

    return smollm2_hf_folder()


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
