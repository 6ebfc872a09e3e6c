"""The workers' HTTP protocol (``proxy.http_head``): a request's head is bounded in size and in
time, whatever the app behind it; the rest of HTTP is uvicorn's."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from proxy import http_head
from tests.conftest import free_port


async def echo_app(scope: Any, receive: Any, send: Any) -> None:
    """Answers every request with its body's length, once the body is read whole."""
    if scope["type"] != "http":
        return
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(http_head, "HEAD_TIMEOUT_S", 0.5)
    port = free_port()
    config = uvicorn.Config(
        echo_app, host="127.0.0.1", port=port, log_level="warning",
        http=http_head.BoundedHeadProtocol, lifespan="off",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(30)


def answer_of(client: socket.socket, within_s: float = 5.0) -> bytes:
    client.settimeout(within_s)
    with contextlib.suppress(OSError):
        return client.recv(65536)
    return b""


def test_a_connection_that_sends_no_head_is_a_408_and_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as client:
        started = time.monotonic()
        answer = answer_of(client)
        assert 0.4 < time.monotonic() - started < 3
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert b'"type":"request_timeout"' in answer
        assert answer_of(client) == b""  # closed


def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_its_timeout(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as client:
        started, answer = time.monotonic(), b""
        head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 1000
        for byte in head:  # a byte every 20 ms: 20 s for the whole head
            with contextlib.suppress(OSError):
                client.sendall(bytes([byte]))
            client.settimeout(0.02)
            with contextlib.suppress(TimeoutError, OSError):
                answer = client.recv(65536)
            if answer or time.monotonic() - started > 5:
                break
        assert answer.startswith(b"HTTP/1.1 408"), answer
        assert time.monotonic() - started < 3


def test_a_keep_alive_connection_serves_request_after_request(port: int) -> None:
    """The timer starts again with each head; a slow body is not the head's business (the
    app's admission times bodies)."""
    with socket.create_connection(("127.0.0.1", port)) as client:
        for _ in range(3):
            client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert answer_of(client).startswith(b"HTTP/1.1 200")
            time.sleep(0.3)  # idle between requests, each under the timeout
        client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\na")
        time.sleep(0.8)  # the body's second byte comes after the head's timeout
        client.sendall(b"b")
        answer = answer_of(client)
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"2"), answer


def test_a_head_over_the_bound_is_a_431(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as client:
        with contextlib.suppress(OSError):
            client.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"y" * (http_head.MAX_HEAD_BYTES + 1))
        assert answer_of(client).startswith(b"HTTP/1.1 431")
    with socket.create_connection(("127.0.0.1", port)) as client:  # just under it: served
        pad = b"y" * (http_head.MAX_HEAD_BYTES - 200)
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + pad + b"\r\n\r\n")
        assert answer_of(client).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: -1\r\n",
        b"Content-Length: 2\r\nContent-Length: 3\r\n",
        b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n",
    ],
)
def test_a_request_the_parser_refuses_is_a_400_in_the_error_shape(
    port: int, framing: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n" + framing + b"\r\nab")
        head, _, body = answer_of(client).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
