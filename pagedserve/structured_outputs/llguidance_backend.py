"""llguidance (Microsoft's Rust Earley parser over token tries): the default backend.

Grammars compile lazily (the lexer builds states as the masks need them), so compiling
is ~1 ms where xgrammar precomputes per-state token masks (see benchmarks/structured.py).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_outputs.backend import GrammarError, is_gbnf
from pagedserve.structured_outputs.schema import close_objects, json_options

# Resource limits: a schema past these is a 400 at compile time, not a slow step later.
_LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, step_max_items=50_000)


def choice_lexeme(choices: list[str]) -> str:
    """A Lark grammar whose language is exactly `choices`, as one terminal (upper-case name).

    As a rule (`start: "a" | "b" | ...`) every choice is an Earley item of the first row,
    and past llguidance's 2,000 items a row the parser errs on the first token (3,000
    choices answered "item"); as a terminal the choices are one lexeme, matched by the
    lexer's lazily built automaton, so the parser row holds one item however many there are.
    """
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices) + "\n"


class LLGuidanceMatcher:
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.validate_tokens([token_id]) != 1:
            return False
        return self._matcher.consume_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    def error(self) -> str:
        return self._matcher.get_error()


class LLGuidanceGrammar:
    def __init__(self, initial: llguidance.LLMatcher) -> None:
        # A matcher in its initial state, never advanced: each sequence gets a copy, which
        # shares the compiled grammar and the lexer states built so far.
        self._initial = initial

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._initial.deep_copy())


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        # Masks are as wide as the model's logits; ids past the tokenizer's are never allowed.
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceGrammar:
        grammar = self._grammar_text(params)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise GrammarError(f"invalid {params.kind}: {matcher.get_error()}")
        return LLGuidanceGrammar(matcher)

    @staticmethod
    def _grammar_text(params: StructuredOutputsParams) -> str:
        kind = params.kind
        try:
            if kind in ("json", "json_object"):
                schema = params.json if kind == "json" else {"type": "object"}
                # Undeclared keys are refused unless the schema allows them (schema.py).
                return llguidance.LLMatcher.grammar_from_json_schema(
                    close_objects(schema), defaults=json_options(params.disable_any_whitespace))  # type: ignore[arg-type]
            if kind == "regex":
                return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
            if kind == "choice":
                return llguidance.LLMatcher.grammar_from_lark(choice_lexeme(list(params.choice or [])))
            grammar = params.grammar or ""
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(grammar) if is_gbnf(grammar) else grammar)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {kind}: {exc}") from None
