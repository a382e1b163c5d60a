"""tool_choice "required" / a named function: the output is constrained to the call's JSON.

    "required":            [{"name": "<one of the tools>", "parameters": {...}}, ...]   (>= 1 call)
    {"function": {name}}:  the named function's arguments object itself

as vLLM does, so the calls always parse, whatever the model. Compact JSON (no free
whitespace): the arguments are re-serialized anyway, and a weak model cannot wander off
into blank space.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_outputs.schema import close_objects
from pagedserve.tool_parsers.base import ToolCall

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameter schema; a `"strict": true` tool's objects all closed (OpenAI's
    strict mode; the grammar closes objects that say nothing anyway: structured_outputs/schema.py)."""
    parameters = tool["function"].get("parameters") or _ANY_OBJECT
    if tool["function"].get("strict"):
        return close_objects(parameters, strict=True)  # type: ignore[return-value]
    return parameters


def required_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    calls = [
        {"type": "object",
         "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": _parameters(t)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in tools
    ]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def tool_choice_constraint(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], parallel: bool = True
) -> StructuredOutputsParams | None:
    """The constraint for this tool_choice (None for "auto" / "none"); ValueError naming the field."""
    if tool_choice == "required":
        return StructuredOutputsParams(json=required_schema(tools, parallel), disable_any_whitespace=True)
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        match = [t for t in tools if t["function"]["name"] == name]
        if not match:
            raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
        return StructuredOutputsParams(json=_parameters(match[0]), disable_any_whitespace=True)
    return None


def parse_constrained(text: str, tool_choice: str | dict[str, Any]) -> list[ToolCall]:
    """The calls in a constrained output; [] if it is incomplete (e.g. cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if isinstance(tool_choice, dict):
        return [ToolCall(name=tool_choice["function"]["name"], arguments=json.dumps(value, ensure_ascii=False))]
    return [ToolCall(name=c["name"], arguments=json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
