"""Tool-call parsers by name (--tool-call-parser), and tool_choice's output constraints."""

from __future__ import annotations

from pagedserve.tool_parsers.base import (
    DeltaToolCall,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    ToolParser,
)
from pagedserve.tool_parsers.hermes import HermesToolParser
from pagedserve.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.tool_parsers.mistral import MistralToolParser
from pagedserve.tool_parsers.pythonic import PythonicToolParser
from pagedserve.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser,
                                       PythonicToolParser, Qwen3CoderToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]


__all__ = ["TOOL_PARSERS", "DeltaToolCall", "ExtractedToolCalls", "StreamDelta", "ToolCall", "ToolParser",
           "get_tool_parser"]
