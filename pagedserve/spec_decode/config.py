"""`speculative_config`: vLLM's names and JSON form, checked once at start-up."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How requests speculate.

    Args:
        method: "ngram" (prompt lookup) or "draft_model" (implied by `model`).
        model: the draft model's folder (same tokenizer as the target), for "draft_model".
        num_speculative_tokens: tokens proposed per request and step (k).
        prompt_lookup_max / prompt_lookup_min: n-gram sizes tried, longest first.
        disable_by_batch_size: no speculation in a step whose running batch has at least
            this many requests (verifying k tokens per request then costs more than it
            saves); None: never. Default 8: benchmarks/speculative.py found n-gram
            verification still paying at batch 4 on chat (+3%) and at 8 on copy-heavy text (+10%),
            and a loss at 8 on chat (-4%); see BENCHMARKS.md.
        min_acceptance_rate: a request whose recent acceptance rate (an exponential moving
            average of accepted / proposed per step) falls below this stops speculating
            for `backoff_steps` steps, doubling each time it fails again.
        backoff_steps: see min_acceptance_rate.
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = 8
    min_acceptance_rate: float = 0.25
    backoff_steps: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model: method 'draft_model' needs the draft model's path")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative_config.model is only used with method 'draft_model'")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config.prompt_lookup_min/prompt_lookup_max: need 1 <= min <= max, got "
                f"{self.prompt_lookup_min}/{self.prompt_lookup_max}"
            )
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"speculative_config.disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")
        if not 0.0 <= self.min_acceptance_rate <= 1.0:
            raise ValueError(f"speculative_config.min_acceptance_rate must be in [0, 1], got {self.min_acceptance_rate}")
        if self.backoff_steps < 1:
            raise ValueError(f"speculative_config.backoff_steps must be >= 1, got {self.backoff_steps}")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """Accepts the config itself, a dict or its JSON text (vLLM's `--speculative-config`).

        A `model` without a method means a draft model, as in vLLM; unknown keys are
        refused by name rather than ignored.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"speculative_config: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or its JSON text, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unsupported field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        value = dict(value)
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else "ngram"
        elif value["method"] in ("draft", "draft_model") and value.get("model"):
            value["method"] = "draft_model"
        return cls(**value)
