"""xgrammar (vLLM's default): precompiles per-state token masks; an optional backend here."""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_outputs.backend import GrammarError, choice_grammar, is_gbnf


class XGrammarMatcher:
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)


class XGrammarGrammar:
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self._compiled = compiled

    def new_matcher(self) -> XGrammarMatcher:
        # Rollback depth: enough for any speculative window.
        return XGrammarMatcher(xgr.GrammarMatcher(self._compiled, max_rollback_tokens=64))


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_id)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, params: StructuredOutputsParams) -> XGrammarGrammar:
        kind = params.kind
        compact = params.disable_any_whitespace
        try:
            if kind == "json":
                schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
                compiled = self._compiler.compile_json_schema(schema, any_whitespace=not compact,
                                                              separators=(",", ":") if compact else None)
            elif kind == "json_object":
                compiled = self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=not compact)
            elif kind == "regex":
                compiled = self._compiler.compile_regex(params.regex or "")
            elif kind == "choice":
                compiled = self._compiler.compile_lark(choice_grammar(list(params.choice or [])))
            else:
                grammar = params.grammar or ""
                compiled = (self._compiler.compile_grammar(grammar) if is_gbnf(grammar)
                            else self._compiler.compile_lark(grammar))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise GrammarError(f"invalid {kind}: {exc}") from None
        return XGrammarGrammar(compiled)
