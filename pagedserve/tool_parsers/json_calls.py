"""Reading one JSON call object, {"name": ..., "arguments" | "parameters": {...}}, as it grows.

The arguments are passed on as the model wrote them (the exact text of the value), so the
streamed pieces concatenate to exactly the non-streamed `arguments`.
"""

from __future__ import annotations

import json
import re

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
DECODER = json.JSONDecoder()


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that could start `marker` (kept for the next delta)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def partial_arguments(text: str, start: int) -> tuple[str, int | None]:
    """(arguments text so far, end offset once the value is complete) for a JSON value at `start`.

    Incomplete: closing braces and whitespace at the end are held back (they may close the
    value and its object, or only the object), so the text so far is a prefix of the value."""
    try:
        _, end = DECODER.raw_decode(text, start)
    except ValueError:
        return text[start:].rstrip("} \n\t\r"), None
    return text[start:end], end


def partial_call(text: str, start: int) -> tuple[str | None, str, int | None]:
    """(name, arguments so far, end of the call object or None) for an object at `text[start]`.

    The name is reported only when it comes before the arguments, or once the object is
    complete (a name inside the arguments must not be taken for the call's)."""
    try:
        obj, end = DECODER.raw_decode(text, start)
    except ValueError:
        obj, end = None, None
    args = _ARGS.search(text, start)
    if obj is not None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None, "", end
        if args is not None and args.start() < end:  # type: ignore[operator]
            raw, _ = partial_arguments(text, args.end())
        else:
            raw = json.dumps(obj.get("arguments", obj.get("parameters", {})), ensure_ascii=False)
        return obj["name"], raw, end
    name = _NAME.search(text, start)
    if name is None or (args is not None and args.start() < name.start()):
        return None, "", None
    if args is None:
        return json.loads(f'"{name.group(1)}"'), "", None
    raw, _ = partial_arguments(text, args.end())
    return json.loads(f'"{name.group(1)}"'), raw, None
