"""DeepSeek-R1 (and its distills): the output starts inside the reasoning, whether or not
the model writes <think> itself (R1's later templates put it in the prompt), and an
output with no </think> is all reasoning (vLLM's deepseek_r1 parser reads it so)."""

from __future__ import annotations

from pagedserve.reasoning.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_opened = True
