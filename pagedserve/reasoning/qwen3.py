"""Qwen3: <think>…</think> at the start of the output when thinking is on (the default);
`chat_template_kwargs.enable_thinking: false` makes the template close an empty block in
the prompt, and the whole output is content. Qwen3-Thinking-2507's template opens the
block in the prompt: the output then starts in the reasoning (see ReasoningParser)."""

from __future__ import annotations

from typing import Any

from pagedserve.reasoning.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def thinking_enabled(self, chat_template_kwargs: dict[str, Any]) -> bool:
        return chat_template_kwargs.get("enable_thinking", True) is not False
