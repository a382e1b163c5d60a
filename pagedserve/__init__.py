"""pagedserve: a paged-KV-cache LLM serving engine."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "BeamSearchParams", "LoRARequest", "RequestOutput", "CompletionOutput",
    "__version__",
]


def __getattr__(name: str):
    # Lazy so that `import pagedserve` stays cheap (CLI --help, server start-up).
    if name == "LLM":
        from pagedserve.entrypoints.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pagedserve.sampling_params import SamplingParams

        return SamplingParams
    if name == "LoRARequest":
        from pagedserve.lora.request import LoRARequest

        return LoRARequest
    if name == "BeamSearchParams":
        from pagedserve.beam_search import BeamSearchParams

        return BeamSearchParams
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedserve import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
