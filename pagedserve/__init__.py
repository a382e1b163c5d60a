"""pagedserve: a paged-KV-cache LLM serving engine."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = [
    "LLM", "SamplingParams", "BeamSearchParams", "LoRARequest", "RequestOutput", "CompletionOutput",
    "EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLMEngine", "TextPrompt", "TokensPrompt",
    "RequestOutputKind", "PoolingParams", "EmbeddingRequestOutput", "__version__",
]

# name -> (module, attribute): everything vLLM exports at top level that pagedserve has.
_LAZY = {
    "LLM": ("pagedserve.entrypoints.llm", "LLM"),
    "SamplingParams": ("pagedserve.sampling_params", "SamplingParams"),
    "RequestOutputKind": ("pagedserve.sampling_params", "RequestOutputKind"),
    "LoRARequest": ("pagedserve.lora.request", "LoRARequest"),
    "BeamSearchParams": ("pagedserve.beam_search", "BeamSearchParams"),
    "RequestOutput": ("pagedserve.outputs", "RequestOutput"),
    "CompletionOutput": ("pagedserve.outputs", "CompletionOutput"),
    "EngineArgs": ("pagedserve.engine_args", "EngineArgs"),
    "AsyncEngineArgs": ("pagedserve.engine_args", "AsyncEngineArgs"),
    "LLMEngine": ("pagedserve.engine.llm_engine", "LLMEngine"),
    "AsyncLLMEngine": ("pagedserve.engine.async_engine", "AsyncLLMEngine"),
    "TextPrompt": ("pagedserve.inputs", "TextPrompt"),
    "TokensPrompt": ("pagedserve.inputs", "TokensPrompt"),
    "PoolingParams": ("pagedserve.pooling_params", "PoolingParams"),
    "EmbeddingRequestOutput": ("pagedserve.outputs", "EmbeddingRequestOutput"),
}


def __getattr__(name: str):
    # Lazy so that `import pagedserve` stays cheap (CLI --help, server start-up).
    if name in _LAZY:
        import importlib

        module, attribute = _LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
