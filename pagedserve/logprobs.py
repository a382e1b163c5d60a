"""Logprob records, where vLLM keeps them (`vllm.logprobs`)."""

from __future__ import annotations

from pagedserve.outputs import Logprob, SampleLogprobs

# One entry per prompt token; the first is None (nothing predicts the first token).
PromptLogprobs = list[dict[int, Logprob] | None]

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
