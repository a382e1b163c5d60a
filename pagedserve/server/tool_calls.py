"""How a chat request uses its tools, and turning output text into OpenAI tool_calls.

    no tools / "none"      text is content; nothing parsed
    "auto"                 the --tool-call-parser reads calls out of the text (streamed as it comes)
    "required" / named     the output is constrained to the calls' JSON (tool_parsers/tool_choice.py);
                           streamed once complete: name first, then the arguments
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pagedserve.entrypoints.chat_utils import _variables
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.server.errors import APIError
from pagedserve.tool_parsers import DeltaToolCall, ToolCall, ToolParser, get_tool_parser
from pagedserve.tool_parsers.tool_choice import parse_constrained, tool_choice_constraint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolMode:
    choice: str  # "none" (also: no tools), "auto", "required" or "named"
    tool_choice: Any = None  # the request's tool_choice, as a plain value
    constraint: StructuredOutputsParams | None = None
    parser: type[ToolParser] | None = None
    tools: tuple[dict[str, Any], ...] = ()  # the request's tools (qwen3_coder types values by them)
    # parallel_tool_calls: false with "auto": only the first parsed call is returned (the
    # constrained choices allow one call in the grammar itself).
    parallel: bool = True

    @classmethod
    def for_request(cls, ctx: Any, body: Any) -> ToolMode:
        if not body.tools:
            return cls("none")
        tools = [t.model_dump() for t in body.tools]
        choice = body.tool_choice if body.tool_choice is not None else "auto"
        if choice == "none":
            return cls("none")
        if choice == "auto":
            if not ctx.enable_auto_tool_choice or ctx.tool_call_parser is None:
                raise APIError(400, 'tool_choice "auto" needs the server started with --enable-auto-tool-choice '
                               "and --tool-call-parser (e.g. hermes); or send tool_choice \"required\" or a named "
                               "function", "tool_choice")
            return cls("auto", "auto", parser=get_tool_parser(ctx.tool_call_parser), tools=tuple(tools),
                       parallel=body.parallel_tool_calls)
        plain = choice if isinstance(choice, str) else choice.model_dump()
        try:
            constraint = tool_choice_constraint(tools, plain, body.parallel_tool_calls)
        except ValueError as exc:
            raise APIError(400, str(exc), "tool_choice") from None
        return cls("required" if choice == "required" else "named", plain, constraint)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output."""
        if self.choice == "none":
            return text, []
        if self.parser is not None:
            found = self.new_parser().extract(text)
            return found.content, found.tool_calls if self.parallel else found.tool_calls[:1]
        calls = parse_constrained(text, self.tool_choice)
        return (None, calls) if calls else (text, [])

    def new_parser(self) -> ToolParser:
        assert self.parser is not None
        return self.parser(list(self.tools))

    def stream(self) -> ToolStream:
        return ToolStream(self)


class ToolStream:
    """One choice's streamed deltas: content and tool-call pieces."""

    def __init__(self, mode: ToolMode) -> None:
        self.mode = mode
        self.parser = mode.new_parser() if mode.parser is not None else None
        self.num_calls = 0
        self._text: list[str] = []

    def feed(self, delta_text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        if self.mode.choice == "none":
            return delta_text, []
        if self.parser is not None:
            out = self.parser.feed(delta_text)
            content, calls = out.content, list(out.tool_calls)
            if finished:
                tail = self.parser.finish()
                content += tail.content
                calls += tail.tool_calls
            if not self.mode.parallel:
                calls = [c for c in calls if c.index == 0]
            self.num_calls += sum(1 for c in calls if c.id is not None)
            return content or None, calls
        # Constrained calls: complete JSON only at the end.
        self._text.append(delta_text)
        if not finished:
            return None, []
        text = "".join(self._text)
        parsed = parse_constrained(text, self.mode.tool_choice)
        if not parsed:
            return text, []
        deltas: list[DeltaToolCall] = []
        for index, call in enumerate(parsed):
            deltas.append(DeltaToolCall(index, id=call.id, name=call.name, arguments=""))
            deltas.append(DeltaToolCall(index, arguments=call.arguments))
        self.num_calls = len(parsed)
        return None, deltas


# ---- templates that cannot render tools ----------------------------------------------------
#
# Many templates (SmolLM2's, base models') never read `tools`. vLLM passes the tools anyway
# and the template drops them; we do the same, logged once per template, and:
#   - "required" / named: the grammar still forces a schema-valid call;
#   - "auto": the tools and the --tool-call-parser's call format are described in a system
#     message (prepended to the conversation's own system message, if any), so the model
#     can call them and the parser can read the call;
#   - earlier turns' assistant tool_calls and role "tool" results are rendered as text
#     (<tool_call> / <tool_response> blocks), which any template can show.

_LOGGED_TEMPLATES: set[int] = set()
TOOLS_PREAMBLE = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")


def template_renders_tools(template: str) -> bool:
    return "tools" in _variables(template)


def adapt_to_template(template: str | None, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      tool_choice: Any, parser: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render: unchanged for a template that renders tools, else the
    fallback above (tools then None: the template would ignore them)."""
    if not tools or template is None or template_renders_tools(template):
        return messages, tools
    if hash(template) not in _LOGGED_TEMPLATES:
        _LOGGED_TEMPLATES.add(hash(template))
        logger.info("the chat template does not render tools: tool_choice \"auto\" describes them in a system "
                    "message, \"required\" and named choices force the call with a grammar (see "
                    "docs/vllm_compatibility.md)")
    plain = [_as_text(message) for message in messages]
    if tool_choice in (None, "auto") and parser is not None:
        plain = _with_tools_system(plain, tools, get_tool_parser(parser).format_hint)
    return plain, None


def _with_tools_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                       format_hint: str) -> list[dict[str, Any]]:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    text = f"{TOOLS_PREAMBLE}{listed}\n</tools>\n\n{format_hint}"
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{_text(first.get('content'))}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    if message.get("role") == "tool":
        return {"role": "user", "content": f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"}
    calls = message.get("tool_calls")
    if not calls:
        return message
    blocks = [json.dumps({"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])},
                         ensure_ascii=False) for c in calls]
    text = "\n".join(f"<tool_call>\n{block}\n</tool_call>" for block in blocks)
    content = _text(message.get("content"))
    rest = {k: v for k, v in message.items() if k != "tool_calls"}
    return {**rest, "content": f"{content}\n{text}" if content else text}


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""
