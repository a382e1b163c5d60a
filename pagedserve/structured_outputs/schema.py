"""JSON schemas as the grammar reads them: objects closed unless they say otherwise.

llguidance admits keys a schema never declared when `additionalProperties` is absent
(JSON Schema's own default); a weak model then pads a forced tool call with invented keys
(`{"city": "Paris", "location": "Paris", "": 1}`). vLLM's default backend forbids them, and
its llguidance path does the same (`disable_additional_properties`): every object schema
that declares properties and says nothing about extra keys gets
`additionalProperties: false`. An explicit `additionalProperties` (true or a schema) is
kept; `{"type": "object"}` with no properties stays open (json_object, a free-form tool).
xgrammar's strict mode already reads schemas this way.
"""

from __future__ import annotations

import copy
import json
from typing import Any


def close_objects(schema: str | dict[str, Any] | bool, strict: bool = False) -> dict[str, Any] | bool:
    """A copy of `schema` whose objects with declared properties forbid undeclared keys.

    strict (a tool's `"strict": true`, OpenAI's strict mode, where every object must say
    `additionalProperties: false`): such objects are closed even where they say otherwise."""
    value = json.loads(schema) if isinstance(schema, str) else copy.deepcopy(schema)
    _close(value, strict)
    return value  # type: ignore[no-any-return]


def _close(node: Any, strict: bool) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item, strict)
        return
    if not isinstance(node, dict):
        return
    for key, child in node.items():
        # Enum and const values and examples are data, not schemas.
        if key not in ("enum", "const", "default", "examples"):
            _close(child, strict)
    declares = "properties" in node or "patternProperties" in node
    if declares and (strict or "additionalProperties" not in node):
        node["additionalProperties"] = False


def json_options(compact: bool) -> dict[str, Any]:
    """llguidance's JSON layout options, as the plain json kind gets them."""
    if compact:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": True, "item_separator": ", ", "key_separator": ": "}
