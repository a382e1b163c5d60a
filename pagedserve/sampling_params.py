"""Sampling parameters, validated at construction (vLLM's field names and defaults)."""

from __future__ import annotations

import copy
import enum
import json
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pagedserve.beam_search import BeamSearchParams

_GREEDY_EPS = 1e-5
# The seeds torch.Generator.manual_seed accepts (a signed or an unsigned 64-bit value).
SEED_MIN = -(1 << 63)
SEED_MAX = (1 << 64) - 1


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a seeded request: seed + index, wrapped into the range."""
    value = seed + index
    return value - (1 << 64) if value > SEED_MAX else value


class RequestOutputKind(enum.IntEnum):
    """What each RequestOutput carries (vLLM's enum); `SamplingParams.output_kind` takes it or
    its string value."""

    CUMULATIVE = 0  # everything so far
    DELTA = 1  # only what is new since the last output (streaming)
    FINAL_ONLY = 2  # one output, when the request finishes


_OUTPUT_KINDS = {"cumulative": "cumulative", "delta": "delta", "final_only": "final_only",
                 RequestOutputKind.CUMULATIVE: "cumulative", RequestOutputKind.DELTA: "delta",
                 RequestOutputKind.FINAL_ONLY: "final_only"}
@dataclass(frozen=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's fields); exactly one kind is set.

    json: a JSON schema (dict or its text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: the output is one of these strings;
    grammar: a Lark grammar (llguidance's dialect) or a GBNF/EBNF grammar (`root ::= ...`).
    disable_any_whitespace: JSON without free whitespace (compact separators).
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar or "
                f"json_object, got {kinds or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    loaded = json.loads(self.json)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            else:
                loaded = self.json
            if not isinstance(loaded, dict | bool):
                raise ValueError("structured_outputs.json must be a JSON schema (an object)")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError("structured_outputs.regex must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple) or not self.choice
            or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError("structured_outputs.grammar must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """(kind, canonical spec text, compact JSON): what a compiled grammar is cached by."""
        value: Any = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        return self.kind, text, self.disable_any_whitespace


_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM <= 0.11 called it GuidedDecodingParams; scripts written for it keep working.
GuidedDecodingParams = StructuredOutputsParams
STRUCTURED_OUTPUTS_FIELDS = tuple(f.name for f in fields(StructuredOutputsParams))


@dataclass
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 means greedy. Invalid values raise ValueError naming the field.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # -1: the whole vocabulary
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    output_kind: str | RequestOutputKind = "cumulative"  # "delta" (streaming), "final_only"
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Words never generated: a word's last token is banned wherever the output ends with the
    # word's other tokens (vLLM's semantics, with and without a leading space).
    bad_words: list[str] | None = None
    # False: outputs carry token ids only, no text (stop strings need text, so they are refused).
    detokenize: bool = True
    # Keep only the last k prompt tokens (-1: as many as fit before max_model_len).
    truncate_prompt_tokens: int | None = None
    # Free-form data for extensions, carried with the request and never read by the engine.
    extra_args: dict[str, Any] | None = None
    # A grammar the output must follow (JSON schema, regex, choice, grammar).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM <= 0.11's name for the same field; folded into structured_outputs.
    guided_decoding: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.output_kind not in _OUTPUT_KINDS:
            raise ValueError(f"output_kind must be a RequestOutputKind or 'cumulative', 'delta', "
                             f"'final_only'; got {self.output_kind!r}.")
        self.output_kind = _OUTPUT_KINDS[self.output_kind]
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise ValueError("set structured_outputs or guided_decoding, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams")
        self._validate()
        self._validate_extras()

    def _validate(self) -> None:
        def bad(name: str, allowed: str, value: object) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "an integer >= 1", self.n)
        if self.best_of is not None and (not isinstance(self.best_of, int) or self.best_of < self.n):
            raise bad("best_of", f"an integer >= n ({self.n})", self.best_of)
        if not 0.0 <= self.temperature:
            raise bad("temperature", ">= 0", self.temperature)
        if self.num_samples > self.n and self.greedy:
            # Every greedy sample is the same sequence: there is nothing to rank. (n > 1 greedy
            # samples are allowed, as OpenAI allows them: n copies of the greedy answer.)
            raise ValueError(
                f"best_of must be n ({self.n}) with greedy sampling (temperature=0), got {self.best_of}; "
                f"set temperature > 0 or use beam search."
            )
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "-1, 0 (disabled) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]", self.frequency_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "in (0, 2]", self.repetition_penalty)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        # No fixed upper bound: the server's --max-logprobs caps a request, the vocabulary
        # caps every one (validate_vocab).
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < -1):
                raise bad(name, "an integer >= 0, or -1 for the whole vocabulary", count)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise bad("seed", f"an integer in [{SEED_MIN}, {SEED_MAX}]", self.seed)
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise bad("stop", "a non-empty string or a list of non-empty strings", self.stop)
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise bad("stop_token_ids", "a list of non-negative integers", self.stop_token_ids)
        if self.logit_bias is not None:
            for token_id, bias in self.logit_bias.items():
                if not isinstance(token_id, int) or not -100.0 <= float(bias) <= 100.0:
                    raise bad("logit_bias", "a map of token id to a bias in [-100, 100]", self.logit_bias)

    def _validate_extras(self) -> None:
        """The fields vLLM added beyond OpenAI's (allowed_token_ids, bad_words, ...)."""
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids!r}.")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list) or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.")
        if not self.detokenize and self._stop_list:
            raise ValueError("stop strings need detokenize=True (the text is what they match).")
        if self.truncate_prompt_tokens is not None and (
            isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {self.truncate_prompt_tokens!r}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}.")

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's `clone`): lists and dicts are not shared with the original."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """vLLM's constructor that treats None as "the default" for every field."""
        names = {f.name for f in fields(cls) if f.init}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"SamplingParams.from_optional got unknown fields: {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    @property
    def num_samples(self) -> int:
        """Sequences generated for the request: best_of if given, else n."""
        return self.best_of if self.best_of is not None else self.n

    def for_sample(self, index: int) -> SamplingParams:
        """Parameters of sample `index` of an n/best_of request: one sequence, seed + index.

        Only sample 0 computes prompt logprobs (it prefills for the group).
        With best_of > n the samples are ranked by cumulative logprob, so each sample
        computes logprobs (at least the chosen token's) even if none were asked for.
        """
        logprobs = self.logprobs
        if logprobs is None and self.num_samples > self.n:
            logprobs = 0
        seed = None if self.seed is None else sample_seed(self.seed, index)
        # Sample 0 prefills the prompt for the group; the others fork its blocks.
        prompt_logprobs = self.prompt_logprobs if index == 0 else None
        return replace(self, n=1, best_of=None, seed=seed, logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks the fields that refer to token ids or count tokens against the model's vocabulary."""
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(self, name)
            if count is not None and count > vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size ({vocab_size}), got {count}.")
        for token_id in self.allowed_token_ids or []:
            if token_id >= vocab_size:
                raise ValueError(f"allowed_token_ids contains {token_id}, outside the vocabulary (size {vocab_size}).")
        for token_id in self.stop_token_ids or []:
            if token_id >= vocab_size:
                raise ValueError(f"stop_token_ids contains {token_id}, outside the vocabulary (size {vocab_size}).")
        for token_id in (self.logit_bias or {}):
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias contains token id {token_id}, outside the vocabulary (size {vocab_size}).")


__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams"]
