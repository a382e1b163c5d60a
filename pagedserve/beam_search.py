"""Beam search's public types, shaped like vLLM's (`from pagedserve import BeamSearchParams`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.outputs import Logprob


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search settings. Scores are sum(logprob) / generated_len ** length_penalty, and
    the search stops once `beam_width` hypotheses have finished (early stopping), as
    transformers' generate(num_beams=..., early_stopping=True) does."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= 10:
            raise ValueError(f"beam_width must be an integer in [1, 10], got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if self.temperature != 0.0:
            raise ValueError("temperature must be 0 for beam search (deterministic beams).")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # prompt + generated, as in vLLM
    logprobs: list[dict[int, Logprob]]  # one entry per generated token
    cum_logprob: float
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    score: float = 0.0  # cum_logprob / generated_len ** length_penalty


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first
