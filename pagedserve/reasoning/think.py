"""The generic parser: reasoning is a <think>…</think> block at the start of the output (or
one the prompt opened); an output that does not start with one is all content."""

from __future__ import annotations

from pagedserve.reasoning.base import ReasoningParser


class ThinkReasoningParser(ReasoningParser):
    name = "think"
