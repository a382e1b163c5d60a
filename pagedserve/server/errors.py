"""OpenAI's error envelope, and the exception handlers that produce it.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

Every error the server returns has this shape: invalid fields (pydantic's included) are
400 naming the field, never FastAPI's default 422; a field the server does not implement
is a 400 naming it too (request_fields.py). Each 4xx is logged at INFO with its message and
field, so an operator sees why a client fails (the access log says only the status).
"""

from __future__ import annotations

import logging
import pathlib
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.lora.request import AdapterNotRegisteredError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error that reaches the client as OpenAI's envelope with this status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": _printable(message), "type": kind, "param": param and _printable(param), "code": code}}


def _printable(text: str) -> str:
    # A message may quote the client's input; a lone surrogate in it must not break the
    # UTF-8 encoding of the answer (which would reset the connection instead).
    return _without_server_paths(text).encode("utf-8", "backslashreplace").decode("utf-8")


# Where the server is installed: no error message names these (a library's message may
# quote a file of ours; the client learns nothing from it but the layout of the host).
_SERVER_DIRS = tuple(sorted({str(pathlib.Path(__file__).resolve().parents[2]), sys.prefix, sys.base_prefix},
                            key=len, reverse=True))


def _without_server_paths(text: str) -> str:
    for directory in _SERVER_DIRS:
        if len(directory) > 1 and directory in text:
            text = text.replace(directory, "<server>")
    return text


def known_failure(exc: BaseException) -> APIError | None:
    """The client's answer for an engine-side failure that is not a server bug: the engine
    stopped (shutdown: 503) or the request's adapter was unloaded (404 naming it)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc))
    if isinstance(exc, AdapterNotRegisteredError):
        return APIError(404, str(exc), "model", "model_not_found")
    return None


def bad_request(exc: ValueError, fields: set[str]) -> APIError:
    """A 400 from a validation message; `param` is the field the message starts with.

    SamplingParams and the engine start their messages with the field's name
    ("temperature must be >= 0, got -1"), so the field can be recovered from the text.
    """
    message = str(exc)
    named = getattr(exc, "param", None)  # InputError, ChatTemplateError: the field is known
    if named is not None:
        return APIError(400, message, named, getattr(exc, "code", None))
    first = message.split(" ", 1)[0].rstrip(":,.")
    param = first if first in fields else None
    if first == "prompt_token_ids":
        param = "prompt"
    return APIError(400, message, param)


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    # pydantic's location, less "body" and the names it gives union members
    # ("TokenizeChatRequest", "list[int]", "function-after[...]"): the field names remain.
    return [str(x) for x in loc if x != "body" and not (isinstance(x, str) and (x[:1].isupper() or "[" in x))]


def _closest_member(errors: list[Any]) -> list[Any]:
    """For a body that is a union of models (/tokenize), the errors of the member it came
    closest to matching (fewest errors), so that the message is about that shape."""
    members: dict[str, list[Any]] = {}
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if len(loc) > 1 and loc[0] == "body" and isinstance(loc[1], str) and loc[1][:1].isupper():
            members.setdefault(loc[1], []).append(error)
    if len(members) < 2:
        return errors
    return min(members.values(), key=len)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = _closest_member(list(exc.errors()))
    parts = []
    param = None
    for error in errors[:3]:
        loc = _field_path(tuple(error.get("loc", ())))
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) if loc else "body"
        parts.append(f"{where}: {error.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request", param


def log_client_error(request: Request, body: dict[str, Any], status: int) -> None:
    """One INFO line per 4xx answer: route, status, field and message (as the client reads them)."""
    if 400 <= status < 500:
        error = body["error"]
        logger.info("%s %s -> %d (param=%s): %s", request.method, request.url.path, status, error["param"],
                    error["message"])


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = dict(exc.headers or {})
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    log_client_error(request, exc.body(), exc.status)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers or None)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    body = error_body(400, message, param)
    log_client_error(request, body, 400)
    return JSONResponse(body, status_code=400)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    body = error_body(exc.status_code, str(exc.detail))
    log_client_error(request, body, exc.status_code)
    # Keeps starlette's headers (the Allow list of a 405).
    return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _known_failure(request: Request, exc: Exception) -> JSONResponse:
    # Handled here rather than by the catch-all: starlette re-raises what reaches that one,
    # and the server would log an ASGI traceback for an ordinary shutdown or unload.
    error = known_failure(exc)
    assert error is not None
    log_client_error(request, error.body(), error.status)
    return JSONResponse(error.body(), status_code=error.status)


async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(500, f"internal error: {exc!r}"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineDeadError, _known_failure)
    app.add_exception_handler(AdapterNotRegisteredError, _known_failure)
    app.add_exception_handler(Exception, _unhandled)
