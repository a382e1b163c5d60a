"""Every environment variable pagedserve reads, in one place, with its type and default.

Read lazily (each accessor reads `os.environ` when called), so tests can set a variable
with `monkeypatch.setenv` after import.

    PAGEDSERVE_ATTENTION_BACKEND   "torch" | "cpp" | unset (auto: cpp on CPU when it builds)
    TORCH_EXTENSIONS_DIR           build cache for C++ extensions (torch's own variable);
                                   unset: ~/.cache/pagedserve/torch_extensions
"""

from __future__ import annotations

import os
import pathlib
from typing import Literal

AttentionBackendName = Literal["torch", "cpp"]
_ATTENTION_BACKENDS: tuple[AttentionBackendName, ...] = ("torch", "cpp")


def attention_backend() -> AttentionBackendName | None:
    """The forced attention backend, or None to choose automatically."""
    value = os.environ.get("PAGEDSERVE_ATTENTION_BACKEND", "").strip().lower()
    if not value or value == "auto":
        return None
    for name in _ATTENTION_BACKENDS:
        if value == name:
            return name
    raise ValueError(
        f"PAGEDSERVE_ATTENTION_BACKEND must be one of {', '.join(_ATTENTION_BACKENDS)} "
        f"(or unset / auto); got {value!r}"
    )


def torch_extensions_dir() -> pathlib.Path:
    """Where C++ extensions are built and cached between processes."""
    value = os.environ.get("TORCH_EXTENSIONS_DIR")
    if value:
        return pathlib.Path(value).expanduser()
    return pathlib.Path.home() / ".cache" / "pagedserve" / "torch_extensions"
