"""What the server does with a request field its models do not declare (issue #37.1).

Agent clients and SDKs send fields that describe the request (`metadata`, `store`, `user`,
...) or that belong to a newer API version; refusing them broke those clients where vLLM
(which logs and ignores them) works. The rule, checked once per request after pydantic:

  - REFUSED: a field of the OpenAI or vLLM API that would change the output and that this
    server does not implement: a 400 naming it, always (ignoring it would silently serve
    something other than what was asked). Some are harmless at one value (`echo: false`,
    `modalities: ["text"]`): that value is accepted.
  - HARMLESS: a field that only describes the request, or asks for something harmless to
    skip: accepted silently, even under --strict-request-fields.
  - anything else: accepted and logged (INFO) once per field name; --strict-request-fields
    makes it a 400 naming it, as every unknown field used to be.

An explicit JSON null is an absent field (protocol.StrictRequest drops it before
validation), so a refused field sent as null is never seen here.

Nested fields are named by their path without list indices ("messages.reasoning_content").
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from pagedserve.server.errors import APIError
from pagedserve.server.protocol import StrictRequest

logger = logging.getLogger(__name__)

_NOT_IMPLEMENTED = "is not implemented by this server"
_ONLY_COMPLETIONS = "is served on /v1/completions and /v1/chat/completions only"

# field path -> (why it is refused, values at which it is harmless and accepted)
REFUSED: dict[str, tuple[str, tuple[Any, ...]]] = {
    # OpenAI
    "suffix": (f"insertion after a suffix {_NOT_IMPLEMENTED}", ()),
    "audio": (f"audio output {_NOT_IMPLEMENTED}", ()),
    "modalities": ("output modalities other than text are not implemented", (["text"],)),
    "web_search_options": (f"web search {_NOT_IMPLEMENTED}", ()),
    "functions": (f"the deprecated functions API {_NOT_IMPLEMENTED}; send tools", ()),
    "function_call": (f"the deprecated functions API {_NOT_IMPLEMENTED}; send tool_choice", ()),
    "verbosity": (f"verbosity {_NOT_IMPLEMENTED}", ()),
    # vLLM's sampling and prompt extras, served on /v1/completions and /v1/chat/completions
    # (declared there, so never seen here); any other route that receives them refuses them.
    "use_beam_search": (f"beam search {_ONLY_COMPLETIONS}", (False,)),
    "length_penalty": (f"length_penalty (beam search) {_ONLY_COMPLETIONS}", (1.0, 1)),
    "early_stopping": (f"early_stopping (beam search) {_ONLY_COMPLETIONS}", ()),
    "bad_words": (f"bad_words {_ONLY_COMPLETIONS}", ([],)),
    "allowed_token_ids": (f"allowed_token_ids {_ONLY_COMPLETIONS}", ()),
    "truncate_prompt_tokens": (f"truncate_prompt_tokens {_ONLY_COMPLETIONS} and /v1/embeddings", ()),
    "prompt_logprobs": (f"prompt_logprobs {_ONLY_COMPLETIONS}", ()),
    "cache_salt": (f"cache_salt {_ONLY_COMPLETIONS}", ()),
    "logits_processors": (f"per-request logits processors {_NOT_IMPLEMENTED}", ()),
    "spaces_between_special_tokens": (f"spaces_between_special_tokens=false {_NOT_IMPLEMENTED}", (True,)),
    "add_special_tokens": (f"add_special_tokens {_NOT_IMPLEMENTED} on generation routes", ()),
    "echo": (f"echo {_NOT_IMPLEMENTED} on chat", (False,)),
    "chat_template": (f"a per-request chat template {_NOT_IMPLEMENTED} (start with --chat-template)", ()),
    "documents": (f"documents for the chat template {_NOT_IMPLEMENTED}", ()),
    "guided_whitespace_pattern": (f"guided_whitespace_pattern {_NOT_IMPLEMENTED}", ()),
    "structural_tag": (f"structural_tag {_NOT_IMPLEMENTED}", ()),
    "vllm_xargs": (f"vllm_xargs {_NOT_IMPLEMENTED}", ()),
    "kv_transfer_params": (f"disaggregated prefill (kv_transfer_params) {_NOT_IMPLEMENTED}", ()),
    # A route's input in the other route's field (/tokenize is one of the two shapes;
    # chat-shaped /v1/embeddings input is not implemented).
    "messages": ("this route takes prompt / input, not messages", ()),
    "prompt": ("this route takes messages, not prompt", ()),
}

# Every undeclared option inside these objects: an output constraint the server cannot
# honour in full would let through text the client's parser then fails on.
REFUSED_UNDER = ("structured_outputs.", "response_format.")

HARMLESS = frozenset({
    # describe the request, or ask the provider for something that does not change the text
    "metadata", "store", "user", "service_tier", "safety_identifier", "prompt_cache_key",
    "request_id", "parallel_tool_calls",
    # Predicted Outputs only speed generation up; the output is the same without them.
    "prediction",
    # agent loops replay the assistant's reasoning and refusals; templates that want them read content
    "messages.reasoning_content", "messages.reasoning", "messages.refusal", "messages.annotations",
    "tools.function.strict", "stream_options.include_obfuscation",
})


class RequestFields:
    """The rule above for one server; logs each unknown field name once per server."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self._logged: set[str] = set()

    def check(self, body: BaseModel) -> None:
        """Raises APIError(400) naming the first refused field of `body` (or unknown one, if strict)."""
        for shown, key, value in _unknown_fields(body, ""):
            param = shown.split(".", 1)[0]
            refused = REFUSED.get(key)
            if refused is None and key.startswith(REFUSED_UNDER):
                refused = (f"an option of the output constraint that {_NOT_IMPLEMENTED}", ())
            if refused is not None:
                reason, harmless = refused
                if any(value == ok and type(value) is type(ok) for ok in harmless):
                    continue
                raise APIError(400, f"{shown}: this field is not supported by this server ({reason})", param)
            if key in HARMLESS:
                continue
            if self.strict:
                raise APIError(400, f"{shown}: this field is not supported by this server "
                               "(unknown fields are refused: --strict-request-fields)", param)
            if key not in self._logged:
                self._logged.add(key)
                logger.info("request field %r is not known to this server: ignored (logged once per field name; "
                            "--strict-request-fields refuses unknown fields)", key)


def _unknown_fields(model: BaseModel, prefix: str) -> Iterator[tuple[str, str, Any]]:
    """(path with list indices, path without them, value) of each undeclared field, depth first."""
    if isinstance(model, StrictRequest):
        for name, value in model.unknown_fields.items():
            yield _join(prefix, name), _key(_join(prefix, name)), value
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, BaseModel):
                path = _join(prefix, name if index is None else f"{name}.{index}")
                yield from _unknown_fields(item, path)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _key(path: str) -> str:
    return ".".join(part for part in path.split(".") if not part.isdigit())
