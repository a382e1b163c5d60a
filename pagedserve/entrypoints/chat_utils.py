"""Rendering a conversation through a chat template: the one input path of LLM.chat and the server.

Tools and the agent loop (assistant messages with tool_calls, role "tool" results) need a
template that knows them; a template that would silently drop them is refused with a
message pointing at --chat-template (pagedserve ships chat_templates/hermes_tools.jinja).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources
from typing import Any

HERMES_TOOLS_TEMPLATE = "hermes_tools.jinja"
CONTENT_FORMATS = ("auto", "string", "openai")
# Names the renderer itself passes to the template; chat_template_kwargs may not override them.
_RESERVED_KWARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                              "chat_template", "tokenize", "return_dict", "tokenizer"})
# A template that loops over a message's content expects OpenAI's list of parts.
_LOOPS_OVER_CONTENT = re.compile(r"\{%-?\s*for\s+\w+\s+in\s+[\w.]*(?:\[['\"]content['\"]\]|\.content(?!\w))")


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


def content_format(template: str, requested: str = "auto") -> str:
    """"string" or "openai": how message content reaches the template. `auto` (vLLM's
    default) picks "openai" for a template that iterates over a message's content parts."""
    if requested not in CONTENT_FORMATS:
        raise ChatTemplateError(
            f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got {requested!r}",
            "chat_template_content_format")
    if requested != "auto":
        return requested
    return "openai" if _LOOPS_OVER_CONTENT.search(template) else "string"


def _content(message: dict[str, Any], index: int, fmt: str) -> dict[str, Any]:
    """The message with its content in the template's format: a string, or a list of text parts."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        parts = None if content is None else [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                part = {"type": "text", "text": part}
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(
                    f"messages[{index}].content: only text parts are supported, got {kind!r}", "messages")
            parts.append({"type": "text", "text": part["text"]})
    else:
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of parts", "messages")
    if fmt == "openai":
        return {**message, "content": parts if parts is not None else []}
    return {**message, "content": "\n".join(p["text"] for p in parts) if parts is not None else ""}


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
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template_content_format: str = "auto",
    require_tools: bool = True,
) -> tuple[str, list[int]]:
    """(text, token ids) of the templated conversation; raises ChatTemplateError.

    continue_final_message: the last message is left open, so the model continues it (a
    prefilled assistant turn); it excludes add_generation_prompt, as in vLLM.
    chat_template_kwargs: extra variables for the template (e.g. `enable_thinking`).
    chat_template_content_format: "string" joins a message's text parts; "openai" passes
    the parts as a list; "auto" looks at the template.
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
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError(
            "continue_final_message and add_generation_prompt cannot both be true: set add_generation_prompt "
            "to false to continue the last message", "continue_final_message")
    extra = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & set(extra))
    if reserved:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(reserved)} (a request field does)",
                                "chat_template_kwargs")
    # Named by its place in the package, not its path: an error must not tell a client
    # where the server is installed.
    hint = (f"start the server with --chat-template set to pagedserve's chat_templates/{HERMES_TOOLS_TEMPLATE} "
            "(or a template of your model's family)")
    knows_tools = "tools" in _variables(template)
    if tools and not knows_tools:
        if require_tools:
            raise ChatTemplateError(f"tools: the chat template cannot render tools; {hint}", "tools")
        tools = None
    if any(m.get("tool_calls") for m in messages) and "tool_calls" not in template:
        raise ChatTemplateError(f"messages: the chat template cannot render assistant tool_calls; {hint}", "messages")
    if any(m.get("role") == "tool" for m in messages) and "tool" not in template.replace("tools", ""):
        raise ChatTemplateError(f"messages: the chat template cannot render role 'tool' messages; {hint}", "messages")
    fmt = content_format(template, chat_template_content_format)
    conversation = [_fix_tool_calls(_content(m, i, fmt)) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **extra,
        )
    except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
        raise ChatTemplateError(f"messages: the chat template failed: {exc}", "messages") from None
    # The template already placed any BOS token; do not add a second one.
    return text, tokenizer.encode(text, add_special_tokens=False)
