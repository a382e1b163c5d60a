"""Reasoning parsers by name (--reasoning-parser): reasoning text out of the content."""

from __future__ import annotations

from pagedserve.reasoning.base import ReasoningCounter, ReasoningDelta, ReasoningParser
from pagedserve.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagedserve.reasoning.qwen3 import Qwen3ReasoningParser
from pagedserve.reasoning.think import ThinkReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ThinkReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]


__all__ = ["REASONING_PARSERS", "ReasoningCounter", "ReasoningDelta", "ReasoningParser", "get_reasoning_parser"]
