"""The grammar backend interface: compile a constraint once, then one matcher per sequence.

    StructuredOutputsParams --backend.compile()--> CompiledGrammar   (cached, shared, immutable)
    CompiledGrammar --new_matcher()--> GrammarMatcher                 (one per sequence)

A matcher is advanced by each token the sequence keeps and fills its row of the step's
token bitmask: int32 words, bit j of word i allows token 32 * i + j. Matchers can roll
back, so a step whose tokens are later rejected (speculative decoding) can be undone.
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.sampling_params import StructuredOutputsParams


class GrammarError(ValueError):
    """The constraint is invalid or too large for the backend; the message says why."""


class GrammarMatcher(Protocol):
    def accept_token(self, token_id: int) -> bool:
        """Advances by one token; False if the grammar does not allow it (state unchanged)."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the tokens allowed next into row `row` of an int32 (rows, ceil(V/32)) tensor."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar is complete: only EOS is allowed from here."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""
        ...


class CompiledGrammar(Protocol):
    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compiles a constraint; raises GrammarError naming what is wrong. Thread-safe."""
        ...


def choice_grammar(choices: list[str]) -> str:
    """A Lark grammar (both backends read Lark) whose language is exactly `choices`."""
    import json

    return "start: " + " | ".join(json.dumps(c) for c in choices) + "\n"


def is_gbnf(grammar: str) -> bool:
    """GBNF / EBNF (llama.cpp, xgrammar) writes rules as `name ::= ...`; Lark as `name: ...`."""
    return "::=" in grammar
