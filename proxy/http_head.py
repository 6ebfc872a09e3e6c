"""The HTTP workers' protocol: uvicorn's httptools protocol with a bound on a request's head.

uvicorn (httptools) reads a request line and headers of any size, joining their pieces as
they come: a 100 MB header took 11.5 s of a worker's event loop and 400 MB 212 s, every
request of that worker waiting behind it, before the app (and its auth) saw the request (a
tester's run, 2026-12-05). Here a head (request line and headers) that has not ended within
``MAX_HEAD_BYTES`` is answered 431 at once and its connection closed, as nginx and Node do
(their bounds: 32 KiB and 16 KiB).
"""

from __future__ import annotations

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024
_END = b"\r\n\r\n"
_REFUSAL = orjson.dumps(
    {
        "error": {
            "type": "invalid_request_error",
            "message": f"the request line and headers are over {MAX_HEAD_BYTES // 1024} KiB",
            "param": None,
        }
    }
)


class BoundedHeadProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` refusing a head over ``MAX_HEAD_BYTES`` before it is parsed."""

    _in_head = True  # reading a head (a connection starts with one)
    _head_bytes = 0  # of the head read so far
    _tail = b""  # its last bytes: an end of head may straddle two reads

    def data_received(self, data: bytes) -> None:
        if self._in_head:
            room = MAX_HEAD_BYTES - self._head_bytes
            if len(data) > room and _END not in self._tail + data[:room]:
                self._refuse()
                return
            self._head_bytes += len(data)
            self._tail = (self._tail + data[-3:])[-3:]
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_head, self._head_bytes, self._tail = True, 0, b""  # the next request's
        super().on_message_complete()

    def _refuse(self) -> None:
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL)
        )
        self.transport.close()
