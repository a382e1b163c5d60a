"""Qwen3-Coder XML tool calls (vLLM's qwen3_coder): content, then calls as

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are text; each is typed by the tool's schema for the JSON arguments (string stays
text; integer, number, boolean, object, array are read as JSON, then as a Python literal,
else kept as text). A parameter is streamed once its </parameter> arrives; the arguments'
closing brace with </function>. Text after the first call is not content (the format puts
reasoning before the calls only).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagedserve.tool_parsers.incremental import IncrementalToolParser, ParsedCalls
from pagedserve.tool_parsers.json_calls import held_back

TOOL_CALL, FUNCTION = "<tool_call>", "<function="
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
_END = "</function>"


class Qwen3CoderToolParser(IncrementalToolParser):
    name = "qwen3_coder"
    format_hint = ("To call a function, reply in this format:\n<tool_call>\n<function=example_function_name>\n"
                   "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>")

    def parse(self, text: str, final: bool) -> ParsedCalls:
        starts = [i for i in (text.find(TOOL_CALL), text.find(FUNCTION)) if i >= 0]
        if not starts:
            keep = 0 if final else max(held_back(text, TOOL_CALL), held_back(text, FUNCTION))
            return text[: len(text) - keep], []
        content = text[: min(starts)]
        calls: list[tuple[str, str]] = []
        for match in _FUNCTION.finditer(text, min(starts)):
            end = text.find(_END, match.end())
            body = text[match.end(): end if end >= 0 else len(text)]
            name = match.group(1).strip()
            arguments = self._arguments(name, body)
            if end < 0:
                if final:
                    return text, []
                calls.append((name, arguments))
                break
            calls.append((name, arguments + "}"))
        if final and not calls:
            return text, []
        return content, calls

    def _arguments(self, function: str, body: str) -> str:
        """The arguments' JSON text without its closing brace: "{" and each complete parameter."""
        types = _parameter_types(self.tools, function)
        parts = [f"{json.dumps(name.strip())}: {json.dumps(_value(value, types.get(name.strip())), ensure_ascii=False)}"
                 for name, value in _PARAMETER.findall(body)]
        return "{" + ", ".join(parts)


def _parameter_types(tools: list[dict[str, Any]], function: str) -> dict[str, Any]:
    for tool in tools:
        spec = tool.get("function", tool)
        if spec.get("name") == function:
            properties = (spec.get("parameters") or {}).get("properties") or {}
            return {name: schema.get("type") for name, schema in properties.items() if isinstance(schema, dict)}
    return {}


def _value(text: str, kind: Any) -> Any:
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return text
    if kind is None and not text.strip():
        return text
    for read in (json.loads, ast.literal_eval):
        try:
            value = read(text.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if kind == "boolean" and isinstance(value, str):
            break
        try:
            json.dumps(value)
        except TypeError:
            continue
        return value
    if kind == "boolean":
        lowered = text.strip().lower()
        if lowered in ("true", "false"):
            return lowered == "true"
    return text
