r"""A constraint that applies after a reasoning block (--reasoning-parser with llguidance).

    start: think ws body            (the prompt opened the block: DeepSeek-R1, Qwen3-Thinking)
    start: think? ws body           (the model may open it: Qwen3, generic <think>)
    think[lazy]: "<think>"? /(?s:.*)<\/think>/    free text up to the first end marker ("?": if opened)
    body: the request's constraint   (%json, a regex or a choice lexeme)

Lark with llguidance's extensions (`%json`, lazy rules); xgrammar cannot read it, so the
server wraps constraints only under llguidance. A Lark or GBNF grammar of the request's
own is not wrapped: it applies from the first token (its rule names could clash).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_outputs.schema import close_objects, json_options


def after_reasoning(spec: StructuredOutputsParams, start: str, end: str, opened: bool) -> StructuredOutputsParams:
    """`spec` preceded by a reasoning block between `start` and `end` markers."""
    body = _body(spec)
    if body is None:
        return spec
    # Opened by the prompt, the model may still write the start marker itself (older R1s do).
    marker = json.dumps(start) + ("?" if opened else "")
    think = f"think[lazy]: {marker} /(?s:.*){_regex_literal(re.escape(end))}/"
    head = "start: think ws body" if opened else "start: think? ws body"
    grammar = f"{head}\n{think}\nws: /[ \\t\\r\\n]*/\n{body}\n"
    return dataclasses.replace(spec, json=None, regex=None, choice=None, json_object=None, grammar=grammar)


def _body(spec: StructuredOutputsParams) -> str | None:
    kind = spec.kind
    if kind in ("json", "json_object"):
        schema: Any = close_objects(spec.json if kind == "json" else {"type": "object"})  # type: ignore[arg-type]
        if isinstance(schema, dict):
            schema = {**schema, "x-guidance": json_options(spec.disable_any_whitespace)}
        return f"body: %json {json.dumps(schema)}"
    if kind == "regex":
        return f"body: /{_regex_literal(spec.regex or '')}/"
    if kind == "choice":
        return "body: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in spec.choice or [])
    return None


def _regex_literal(regex: str) -> str:
    """`regex` inside Lark's /.../ (an unescaped slash would end the literal)."""
    out, i = [], 0
    while i < len(regex):
        char = regex[i]
        if char == "\\" and i + 1 < len(regex):
            out.append(regex[i: i + 2])
            i += 2
            continue
        out.append("\\/" if char == "/" else char)
        i += 1
    return "".join(out)
