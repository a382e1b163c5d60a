"""OpenAI's error envelope, and the exception handlers that produce it.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

Every error the server returns has this shape: invalid fields (pydantic's included) are
400 naming the field, never FastAPI's default 422.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad_request(exc: ValueError, fields: set[str]) -> APIError:
    """A 400 from a validation message; `param` is the field the message starts with.

    SamplingParams and the engine start their messages with the field's name
    ("temperature must be >= 0, got -1"), so the field can be recovered from the text.
    """
    message = str(exc)
    first = message.split(" ", 1)[0].rstrip(":,.")
    param = first if first in fields else None
    if first == "prompt_token_ids":
        param = "prompt"
    return APIError(400, message, param)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts = []
    param = None
    for error in exc.errors()[:3]:
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) if loc else "body"
        parts.append(f"{where}: {error.get('msg', 'invalid value')}")
    return "; ".join(parts) or "invalid request", param


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    return JSONResponse(error_body(400, message, param), status_code=400)


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)


async def _unhandled(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(500, f"internal error: {exc!r}"), status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unhandled)
