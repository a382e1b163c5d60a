"""Rendering a conversation through a chat template: the one input path of LLM.chat and the server.

Tools and the agent loop (assistant messages with tool_calls, role "tool" results) need a
template that knows them; a template that would silently drop them is refused with a
message pointing at --chat-template (pagedserve ships chat_templates/hermes_tools.jinja).
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources
from typing import Any

HERMES_TOOLS_TEMPLATE = "hermes_tools.jinja"


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def builtin_template_path(name: str = HERMES_TOOLS_TEMPLATE) -> str:
    return str(resources.files("pagedserve.chat_templates") / name)


@lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str]:
    """Top-level variables the template reads (`tools`, `messages`, ...)."""
    import jinja2
    from jinja2 import meta

    return frozenset(meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def _fix_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends arguments as a JSON string; templates (Qwen's, Hermes') want the object."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        function = dict(call.get("function", {}))
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # left as text; the template renders it as is
        fixed.append({**call, "function": function})
    return {**message, "tool_calls": fixed}


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    require_tools: bool = True,
) -> tuple[str, list[int]]:
    """(text, token ids) of the templated conversation; raises ChatTemplateError.

    require_tools=False (tool_choice "none"): tools are passed if the template reads them,
    and dropped without error otherwise.
    """
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ChatTemplateError(
            "this model's tokenizer has no chat template; start the server with --chat-template "
            "(or pass chat_template=)", "messages")
    if not isinstance(template, str):
        raise ChatTemplateError("the tokenizer has several named chat templates; pick one with --chat-template",
                                "messages")
    hint = f"start the server with --chat-template {builtin_template_path()} (or a template of your model's family)"
    knows_tools = "tools" in _variables(template)
    if tools and not knows_tools:
        if require_tools:
            raise ChatTemplateError(f"tools: the chat template cannot render tools; {hint}", "tools")
        tools = None
    if any(m.get("tool_calls") for m in messages) and "tool_calls" not in template:
        raise ChatTemplateError(f"messages: the chat template cannot render assistant tool_calls; {hint}", "messages")
    if any(m.get("role") == "tool" for m in messages) and "tool" not in template.replace("tools", ""):
        raise ChatTemplateError(f"messages: the chat template cannot render role 'tool' messages; {hint}", "messages")
    try:
        text = tokenizer.apply_chat_template(
            [_fix_tool_calls(m) for m in messages],
            chat_template=template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
        raise ChatTemplateError(f"messages: the chat template failed: {exc}", "messages") from None
    # The template already placed any BOS token; do not add a second one.
    return text, tokenizer.encode(text, add_special_tokens=False)
