"""The HTTP workers' protocol: uvicorn's httptools protocol with a bound on a request's head.

uvicorn (httptools) reads a request line and headers of any size, joining their pieces as
they come: a 100 MB header took 11.5 s of a worker's event loop and 400 MB 212 s, every
request of that worker waiting behind it, before the app (and its auth) saw the request (a
tester's run, 2026-12-05). Here a head (request line and headers) that has not ended within
``MAX_HEAD_BYTES`` is answered 431 at once and its connection closed, as nginx and Node do
(their bounds: 32 KiB and 16 KiB).

Nor did uvicorn time a head: a connection that sends nothing, or a head a byte at a time,
was held for as long as its client liked (its keep-alive timer runs only between requests),
so enough of them would use up a worker's file descriptors. A head must now arrive whole
within ``HEAD_TIMEOUT_S`` of its connection or of its first byte, else a 408 closes the
connection (nginx's ``client_header_timeout``, 60 s; Node's ``headersTimeout``, 60 s).

A request its parser refuses (a negative or doubled ``Content-Length``, one beside
``Transfer-Encoding``, a malformed request line) gets its 400 in the API's error shape too
(uvicorn's is plain text).
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0
_END = b"\r\n\r\n"


def _answer(status: bytes, type: str, message: str) -> bytes:
    body = orjson.dumps({"error": {"type": type, "message": message, "param": None}})
    return (
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, len(body), body)
    )


_TOO_LARGE = _answer(
    b"431 Request Header Fields Too Large",
    "invalid_request_error",
    f"the request line and headers are over {MAX_HEAD_BYTES // 1024} KiB",
)
_MALFORMED = _answer(
    b"400 Bad Request",
    "invalid_request_error",
    "a malformed HTTP request: its request line or its framing (Content-Length, Transfer-Encoding)",
)
_TOO_SLOW = _answer(
    b"408 Request Timeout",
    "request_timeout",
    f"the request line and headers did not arrive within {HEAD_TIMEOUT_S:g} s",
)


class BoundedHeadProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` refusing a head over ``MAX_HEAD_BYTES`` before it is parsed,
    and one not whole within ``HEAD_TIMEOUT_S`` (one sweep a worker over its connections,
    not a timer a request: a request pays a clock reading)."""

    _in_head = True  # reading a head (a connection starts with one)
    _head_bytes = 0  # of the head read so far
    _tail = b""  # its last bytes: an end of head may straddle two reads
    _head_since: float | None = None  # the loop's time the head began (None: none begun)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_since = self.loop.time()
        state = self.server_state
        if not getattr(state, "head_sweep", False):  # the first connection of this worker
            state.head_sweep = True  # type: ignore[attr-defined]
            _sweep(self.loop, self.connections)

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            room = MAX_HEAD_BYTES - self._head_bytes
            if len(data) > room and _END not in self._tail + data[:room]:
                self._refuse(_TOO_LARGE)
                return
            self._head_bytes += len(data)
            self._tail = (self._tail + data[-3:])[-3:]
            if self._head_since is None:  # a keep-alive connection's next head
                self._head_since = self.loop.time()
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head, self._head_since = False, None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = True, 0, b""  # the next request's
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """What uvicorn answers a request its parser refuses (it has logged ``msg``)."""
        self._refuse(_MALFORMED)

    def _refuse(self, answer: bytes) -> None:
        self._head_since = None
        if not self.transport.is_closing():
            self.transport.write(answer)
            self.transport.close()


def _sweep(loop: asyncio.AbstractEventLoop, connections: set[Any]) -> None:
    """Answer 408 on each connection whose head began ``HEAD_TIMEOUT_S`` ago, then again in
    a tenth of it."""
    now = loop.time()
    for connection in list(connections):
        since = getattr(connection, "_head_since", None)
        if since is not None and now - since >= HEAD_TIMEOUT_S:
            connection._refuse(_TOO_SLOW)
    loop.call_later(HEAD_TIMEOUT_S / 10, _sweep, loop, connections)
