"""Limits on what one connection can make the server hold: body size, and log volume.

    client --body--> BodyLimit (413 past --max-request-body-bytes, before the rest is read)
                 --> the app

Connection count and keep-alive timeouts are uvicorn's (launch.make_server passes
--max-connections and --keep-alive-timeout on); uvicorn has no deadline for a request's
headers, so a connection that sends nothing, or half a request line and headers, was held
forever: `header_timeout_protocol` closes it after --header-timeout. Repeated identical log errors (one per
refused socket at the file-descriptor limit filled the log by ~159 MB in 40 s) are
collapsed by RepeatFilter.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

# The body limit when none is given: room for the longest prompt max_model_len allows,
# written as JSON's worst case (\uXXXX: 6 bytes a character), and never under this floor
# (a batch of token-id prompts or embedding inputs is larger than one text prompt).
MIN_BODY_BYTES = 32 << 20
JSON_BYTES_PER_CHAR = 6


def default_body_limit(char_limit: int) -> int:
    """Bytes a request body may have: `char_limit` is the input processor's longest text."""
    return max(MIN_BODY_BYTES, JSON_BYTES_PER_CHAR * char_limit)


class BodyTooLarge(Exception):
    """Raised from `receive` once a body passes the limit (BodyLimit answers the 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes (--max-request-body-bytes)")
        self.limit = limit


class BodyLimit:
    """Plain ASGI middleware: a declared Content-Length past the limit is a 413 before any
    byte is read; a chunked body is counted as it arrives and stops at the limit."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_413(send, self.max_bytes)
            return
        seen = 0
        exceeded = False
        replaced = False

        async def counting_receive() -> Any:
            nonlocal seen, exceeded
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    exceeded = True
                    raise BodyTooLarge(self.max_bytes)
            return message

        async def guarded_send(message: Any) -> None:
            # The framework may turn the exception into its own 400 ("error parsing the
            # body"): once the limit was passed, the client gets the 413 instead.
            nonlocal replaced
            if not exceeded:
                await send(message)
            elif not replaced:
                replaced = True
                await _send_413(send, self.max_bytes)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            if not replaced:
                await _send_413(send, self.max_bytes)


async def _send_413(send: Any, limit: int) -> None:
    body = json.dumps({"error": {"message": str(BodyTooLarge(limit)), "type": "invalid_request_error",
                                 "param": None, "code": "request_too_large"}}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class RepeatFilter(logging.Filter):
    """Lets the first of identical records (same logger, level, message) through, then one
    summary per `window_s` saying how many were dropped."""

    def __init__(self, window_s: float = 10.0) -> None:
        super().__init__()
        self.window_s = window_s
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, record.levelno, str(record.msg) + repr(record.exc_info[1] if record.exc_info else None))
        now = time.monotonic()
        with self._lock:
            entry = self._seen.get(key)
            if entry is None or now - entry[0] > self.window_s:
                dropped = int(entry[1]) if entry is not None else 0
                self._seen[key] = [now, 0]
                if len(self._seen) > 1024:  # bounded: forget the oldest windows
                    for old in sorted(self._seen, key=lambda k: self._seen[k][0])[:512]:
                        del self._seen[old]
                if dropped:
                    record.msg = f"{record.msg} (and {dropped} identical records in the last {self.window_s:g} s)"
                return True
            entry[1] += 1
            return False


def install_repeat_filter(window_s: float = 10.0) -> RepeatFilter:
    """On every handler of the root logger (ours and asyncio's records reach them) and of
    uvicorn's own loggers (which do not propagate), once."""
    repeat = RepeatFilter(window_s)
    for name in (None, "uvicorn", "uvicorn.error"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RepeatFilter) for f in handler.filters):
                handler.addFilter(repeat)
    return repeat


# A request's headers must arrive whole within this long of the connection opening (or of the
# previous response on a keep-alive connection).
DEFAULT_HEADER_TIMEOUT_S = 10.0


def header_timeout_protocol(timeout_s: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's headers.

    Armed when the connection opens and again after each response; disarmed once h11 has
    parsed a whole request head (the client's state leaves IDLE). A body may then take as
    long as the handler lets it (the body limit bounds its size).
    """
    import asyncio

    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderTimeoutH11Protocol
