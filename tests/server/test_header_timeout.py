"""Issue 33.7: a connection whose request head never arrives whole is closed.

uvicorn has no deadline for a request's line and headers: a client that connects and sends
nothing, or half a head, held its connection (and a file descriptor) forever. A real uvicorn
server on 127.0.0.1 with pagedserve's protocol (`limits.header_timeout_protocol`), driven by a
raw socket, and the same server with uvicorn's plain h11 protocol as the control.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from pagedserve.server.launch import make_server
from pagedserve.server.limits import header_timeout_protocol

TIMEOUT_S = 0.5


async def _app(scope, receive, send):  # the smallest ASGI app: 200 "ok"
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def _server(http) -> Iterator[int]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app, log_level="warning", http=http, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _closed_within(conn: socket.socket, seconds: float) -> bool:
    """Whether the server closes `conn` within `seconds` (reads past any response first)."""
    conn.settimeout(seconds)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if conn.recv(4096) == b"":
                return True
    except TimeoutError:
        return False
    return False


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with _server(header_timeout_protocol(TIMEOUT_S)) as p:
        yield p


@pytest.mark.parametrize("sent", [b"", b"GET / HTTP/1.1\r\nHost: x\r\n", b"GE"],
                         ids=["nothing", "half-a-head", "half-a-line"])
def test_a_head_that_never_arrives_whole_is_closed(port, sent):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(sent)
        start = time.monotonic()
        assert _closed_within(conn, 5)
        assert TIMEOUT_S * 0.8 <= time.monotonic() - start < 3


def test_a_whole_request_is_served_and_the_next_head_gets_its_own_deadline(port):
    with socket.create_connection(("127.0.0.1", port)) as conn:
        time.sleep(TIMEOUT_S * 0.5)  # within the first deadline
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        conn.settimeout(5)
        assert conn.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT_S * 0.8)  # the first deadline has passed: disarmed by the request
        conn.sendall(b"GET / HTTP/1.1\r\n")  # half of the next head: a new deadline
        assert _closed_within(conn, 5)


def test_uvicorns_own_protocol_holds_a_half_sent_head():
    """The control: without the protocol the connection is still open after 4 timeouts."""
    with _server("h11") as plain, socket.create_connection(("127.0.0.1", plain)) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        assert not _closed_within(conn, TIMEOUT_S * 4)


def test_the_server_uses_it():
    server = make_server(_app, engine=None, host="127.0.0.1", port=0, log_level="warning",
                         grace_s=1.0, header_timeout_s=3.0)
    from uvicorn.protocols.http.h11_impl import H11Protocol

    assert isinstance(server.config.http, type) and issubclass(server.config.http, H11Protocol)
    assert server.config.http is not H11Protocol
