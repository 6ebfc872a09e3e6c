"""Calls between the processes of one server: pyzmq over ``ipc://``, msgpack frames (msgspec),
arrays as raw frames, never pickle.

One ``RpcServer`` per owner (the engine process, the fleet index owner): a ROUTER socket. Every
other process holds one ``RpcClient`` per owner: a DEALER whose routing id says who it is
(``worker-<pid>``), so the owner can also call it (a cache invalidation reaches every worker)::

    client -> server   [header, *blobs]       header = {"id": n, "op": "embed", ...}
    server -> client   [reply, *blobs]        reply  = {"id": n, ...} | {"id": n, "error": {..}}
    server -> client   [request, *blobs]      request = {"sid": n, "op": "invalidate", ...}
    client -> server   [reply]                reply   = {"sid": n, ...}

Vectors travel as one raw little-endian float32 frame, read back with ``np.frombuffer`` without
a copy. An error crosses as ``{"kind", "message"}`` and is raised again on the other side as
the same exception class (``ERRORS``): a worker answers a ``QueueFullError`` of the engine
with 429 as if the batcher were local.

Liveness: a client pings its server every ``ping_s``; no answer for ``down_after_s`` (or a
broken connection) marks the server down: pending calls fail at once with
``ServiceUnavailableError`` and new calls fail without waiting, until a ping is answered again
(the supervisor restarts the owner; ZeroMQ reconnects by itself, every 100 ms at most, and a
connection made is pinged at once: the workers see an owner come up within ~0.1 s of each
other). The ping's answer carries the owner's ``facts`` (health, identity), so ``/readyz``
never needs a round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import zmq
from zmq.utils.monitor import parse_monitor_message

from engines.base import (
    BatchError,
    DeadlineExceededError,
    EngineError,
    EngineUnavailableError,
    QueueFullError,
    TooLargeError,
)

log = logging.getLogger("fleetcache.ipc")

Blobs = Sequence[bytes | memoryview | zmq.Frame]
Reply = tuple[dict[str, Any], list[zmq.Frame]]
Handler = Callable[[dict[str, Any], list[zmq.Frame]], Awaitable[tuple[dict[str, Any], Blobs]]]
ClientHandler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder().decode


class ServiceUnavailableError(EngineUnavailableError):
    """The process that owns a service (``engine``, ``index``) is down or not answering
    (HTTP 503 ``<service>_unavailable``)."""

    def __init__(self, message: str, service: str = "engine") -> None:
        super().__init__(message)
        self.service = service


class RemoteError(RuntimeError):
    """A failure inside the other process that has no class of its own here (HTTP 500)."""


class NotFoundError(KeyError):
    """The owner does not know the key (an unknown driver)."""


# kind -> exception class, the same on both sides; the first class an error is an instance
# of names it (subclasses first).
ERRORS: dict[str, type[Exception]] = {
    "service_unavailable": ServiceUnavailableError,
    "too_large": TooLargeError,
    "queue_full": QueueFullError,
    "deadline_exceeded": DeadlineExceededError,
    "engine_unavailable": EngineUnavailableError,
    "batch_error": BatchError,  # failed by what it held: a worker's merged call splits
    "engine_error": EngineError,
    "not_found": NotFoundError,
    "invalid": ValueError,
}


def error_payload(exc: BaseException) -> dict[str, str]:
    for kind, cls in ERRORS.items():
        if isinstance(exc, cls):
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            if isinstance(exc, ServiceUnavailableError):
                return {"kind": kind, "message": str(message), "service": exc.service}
            return {"kind": kind, "message": str(message)}
    return {"kind": "internal", "message": f"{type(exc).__name__}: {exc}"}


def payload_error(error: dict[str, str]) -> Exception:
    """The exception an ``error_payload`` describes, of the same kind where known."""
    cls = ERRORS.get(error.get("kind", ""), RemoteError)
    message = error.get("message", "remote error")
    if cls is ServiceUnavailableError:
        return ServiceUnavailableError(message, error.get("service", "engine"))
    return cls(message)


def raise_payload(error: dict[str, str]) -> None:
    raise payload_error(error)


def rows_frame(rows: npt.NDArray[np.float32]) -> memoryview:
    """A (n, dim) float32 array as one frame (no copy when already contiguous)."""
    return memoryview(np.ascontiguousarray(rows, dtype="<f4").data).cast("B")


def frame_rows(frame: zmq.Frame | bytes, dim: int) -> npt.NDArray[np.float32]:
    """The rows of a ``rows_frame``, read-only and without a copy."""
    buffer = frame.buffer if isinstance(frame, zmq.Frame) else frame
    return np.frombuffer(buffer, dtype="<f4").reshape(-1, dim)


def address(run_dir: os.PathLike[str] | str, name: str) -> str:
    return f"ipc://{os.fspath(run_dir)}/{name}.sock"


class LoopSocket:
    """A ZeroMQ socket driven by the event loop itself, not through ``zmq.asyncio``: one
    reader on the socket's FD for its whole life, every message waiting received at a
    wake-up before anything awaits, and sends that never wait (no high-water mark: a message
    is queued, or the send fails at once). ``zmq.asyncio`` registers and drops the FD with
    the loop around each receive and takes a future and a loop turn per message.

    ZeroMQ's FD signals edges, not levels: after any send or receive the socket is asked
    again (``EVENTS``) whether a message waits, since that call may have consumed the
    signal of one that came in meanwhile.

    Either ``recv`` messages one by one, or ``listen``: each message handed to a callback in
    the very turn the FD signals (``recv``'s caller resumes a turn later, and a task it then
    starts per message one more: under 8 workers' load a turn of the engine process's loop
    lasts milliseconds)."""

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._ready: asyncio.Event | None = None  # the FD signalled (or may have)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._on_message: Callable[[list[zmq.Frame]], None] | None = None

    def _readable(self) -> bool:
        return bool(int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def send(self, frames: Blobs) -> None:
        """Queue ``frames`` as one message (``zmq.Again`` or another ``ZMQError`` at once
        when it cannot be)."""
        self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        if self._ready is not None and self._readable():
            self._ready.set()
        elif self._on_message is not None and self._loop is not None and self._readable():
            self._loop.call_soon(self._drain)  # not from here: the sender may be a callback

    def listen(self, on_message: Callable[[list[zmq.Frame]], None]) -> None:
        """From now until ``close``, each message to ``on_message``, on the loop, at once (a
        callback that raises loses its message only: it is logged)."""
        assert self._ready is None, "a socket is either listened to or received from"
        self._on_message = on_message
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.FD, self._drain)
        self._loop.call_soon(self._drain)  # any already waiting: their signal may be gone

    def _drain(self) -> None:
        while (on_message := self._on_message) is not None and not self.sock.closed:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                on_message(frames)
            except Exception:
                log.exception("a message was dropped: its handler failed")

    async def recv(self) -> list[zmq.Frame]:
        """The next message, at once when one waits."""
        assert self._on_message is None, "a socket is either listened to or received from"
        while True:
            try:
                return self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            if self._ready is None:
                self._ready = asyncio.Event()
                self._loop = asyncio.get_running_loop()
                self._loop.add_reader(self.sock.FD, self._ready.set)
            self._ready.clear()
            if not self._readable():
                await self._ready.wait()

    def unlisten(self) -> None:
        """No more messages taken from here on (the FD's reader off the loop)."""
        self._on_message = None
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.FD)

    def close(self) -> None:
        self.unlisten()
        self.sock.close(linger=0)


class RpcServer:
    """A ROUTER serving ``handlers`` by op name; each request runs in a task of its own,
    started as its message arrives (``LoopSocket.listen``)."""

    def __init__(self, bind: str, handlers: dict[str, Handler]) -> None:
        self.address = bind
        self.handlers = handlers
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone peer raises
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        path = bind.removeprefix("ipc://")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left by an owner that died
        sock.bind(bind)
        self._sock = LoopSocket(sock)
        self._tasks: set[asyncio.Task[None]] = set()
        self._sids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.peers: dict[bytes, float] = {}  # routing id -> when it last spoke

    async def serve(self) -> None:
        """Receive until cancelled."""
        self._sock.listen(self._received)
        try:
            await asyncio.get_running_loop().create_future()
        finally:
            self._sock.unlisten()
            for task in list(self._tasks):
                task.cancel()

    def _received(self, frames: list[zmq.Frame]) -> None:
        peer, message, blobs = frames[0].bytes, _decode(frames[1].bytes), frames[2:]
        self.peers[peer] = time.monotonic()
        sid = message.get("sid")
        if sid is not None:  # a client answering our call
            future = self._calls.pop(sid, None)
            if future is not None and not future.done():
                future.set_result(message)
            return
        task = asyncio.create_task(self._handle(peer, message, blobs))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, peer: bytes, message: dict[str, Any], blobs: list[zmq.Frame]) -> None:
        out: Blobs = ()
        try:
            handler = self.handlers[message["op"]]
            reply, out = await handler(message, blobs)
        except Exception as exc:
            if not isinstance(exc, ERRORS_KNOWN):
                log.exception("%s failed", message.get("op"))
            reply = {"error": error_payload(exc)}
        reply["id"] = message.get("id")
        try:
            self._sock.send([peer, _encode(reply), *out])
        except zmq.ZMQError as exc:  # the caller went away meanwhile
            log.debug("reply to %r lost: %s", peer, exc)

    async def call_peers(
        self, op: str, prefix: bytes, timeout_s: float, **args: Any
    ) -> dict[bytes, dict[str, Any] | None]:
        """Call every peer whose routing id starts with ``prefix`` (seen in the last
        ``timeout_s`` x 4) and wait for each answer; None for a peer that did not answer."""
        now = time.monotonic()
        peers = [p for p, seen in self.peers.items() if p.startswith(prefix)]
        peers = [p for p in peers if now - self.peers[p] < max(4 * timeout_s, 5.0)]
        futures: dict[bytes, asyncio.Future[dict[str, Any]]] = {}
        loop = asyncio.get_running_loop()
        for peer in peers:
            sid = next(self._sids)
            future = self._calls[sid] = loop.create_future()
            try:
                self._sock.send([peer, _encode({"sid": sid, "op": op, **args})])
            except zmq.ZMQError:
                self._calls.pop(sid, None)
                self.peers.pop(peer, None)
                continue
            futures[peer] = future
        if futures:
            await asyncio.wait(futures.values(), timeout=timeout_s)
        out: dict[bytes, dict[str, Any] | None] = {}
        for peer, future in futures.items():
            out[peer] = future.result() if future.done() else None
            future.cancel()
        return out

    def close(self) -> None:
        self._sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.address.removeprefix("ipc://"))


ERRORS_KNOWN = tuple(ERRORS.values())


class RpcClient:
    """A DEALER to one server (see the module docstring)."""

    def __init__(
        self,
        connect: str,
        *,
        role: str,
        on_request: ClientHandler | None = None,
        ping_s: float = 0.2,
        down_after_s: float = 5.0,
        service: str | None = None,
    ) -> None:
        """``service``: what the server serves, as errors name it (default: its socket's
        name; every engine of a device list is ``engine``)."""
        self.address = connect
        self._service = service or connect.rsplit("/", 1)[-1].removesuffix(".sock")
        self.identity = f"{role}-{os.getpid()}".encode()
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a server that is down
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 100)  # a server that (re)binds is seen soon
        sock.connect(connect)
        self._sock = LoopSocket(sock)
        self._on_request = on_request
        self._ping_s = ping_s
        self._down_after_s = down_after_s
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._answered = -1.0  # when the server last answered (monotonic)
        self.up = False
        self.facts: dict[str, Any] = {}  # the last ping's answer
        self.ups = 0  # times the server came (back) up: a restart shows as one more
        self._changed = asyncio.Event()
        self._connected = asyncio.Event()  # a connection was made: ping now (``_watch``)

    async def start(self) -> RpcClient:
        self._sock.listen(self._received)
        self._tasks = [
            asyncio.create_task(self._ping(), name=f"rpc-ping {self.address}"),
            asyncio.create_task(self._watch(), name=f"rpc-watch {self.address}"),
        ]
        return self

    async def wait_up(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.up:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()
        return True

    async def close(self) -> None:
        self._sock.unlisten()  # no answer or request handled from here on
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_pending(ServiceUnavailableError("client closed", self.service))
        self._sock.close()

    async def call(
        self, op: str, blobs: Blobs = (), *, timeout_s: float | None = None, **args: Any
    ) -> Reply:
        """The server's answer to ``op`` (its own errors raised again here)."""
        if not self.up and op != "ping":
            raise ServiceUnavailableError(f"{self._name} is not answering", self.service)
        return await self._call(op, blobs, timeout_s, args)

    @property
    def service(self) -> str:
        """What the server serves (``engine``, ``index``)."""
        return self._service

    @property
    def _name(self) -> str:
        return f"the {self.address.rsplit('/', 1)[-1].removesuffix('.sock')} process"

    async def _call(
        self, op: str, blobs: Blobs, timeout_s: float | None, args: dict[str, Any]
    ) -> Reply:
        call_id = next(self._ids)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            header = _encode({"id": call_id, "op": op, **args})
            try:
                self._sock.send([header, *blobs])
            except zmq.Again:
                raise ServiceUnavailableError(
                    f"{self._name} is not connected", self.service
                ) from None
            if timeout_s is None:
                reply, frames = await future
            else:
                async with asyncio.timeout(timeout_s):
                    reply, frames = await future
        finally:
            self._pending.pop(call_id, None)
        error = reply.get("error")
        if error is not None:
            raise_payload(error)
        return reply, frames

    def _received(self, frames: list[zmq.Frame]) -> None:
        message = _decode(frames[0].bytes)
        self._answered = time.monotonic()
        if "sid" in message:
            task = asyncio.create_task(self._answer(message))
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)
            return
        future = self._pending.get(message.get("id", -1))
        if future is not None and not future.done():
            future.set_result((message, frames[1:]))

    async def _answer(self, message: dict[str, Any]) -> None:
        try:
            if self._on_request is None:
                raise RemoteError(f"this process serves no {message.get('op')!r}")
            reply = await self._on_request(message)
        except Exception as exc:
            reply = {"error": error_payload(exc)}
        reply["sid"] = message["sid"]
        with contextlib.suppress(zmq.ZMQError):
            self._sock.send([_encode(reply)])

    async def _ping(self) -> None:
        while True:
            started = time.monotonic()
            self._connected.clear()  # a connection made from here on ends the wait below
            try:
                reply, _ = await self._call("ping", (), self._down_after_s, {})
            except (TimeoutError, ServiceUnavailableError, RemoteError, zmq.ZMQError):
                if self.up and time.monotonic() - self._answered > self._down_after_s:
                    self._set_up(False)
                    self._fail_pending(
                        ServiceUnavailableError(f"{self._name} stopped answering", self.service)
                    )
                elif not self.up:
                    self._fail_pending(
                        ServiceUnavailableError(f"{self._name} is not answering", self.service)
                    )
            else:
                self.facts = reply
                if not self.up:
                    self._set_up(True)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._ping_s - (time.monotonic() - started)):
                    await self._connected.wait()

    def _set_up(self, up: bool) -> None:
        self.up = up
        self.ups += up
        log.log(
            logging.INFO if up else logging.WARNING,
            "%s %s",
            self._name,
            "answering" if up else "down",
        )
        self._changed.set()

    def _fail_pending(self, error: Exception) -> None:
        for future in list(self._pending.values()):
            if not future.done():
                future.set_exception(error)

    async def _watch(self) -> None:
        """A dropped connection (the owner died) marks the server down at once, without
        waiting for pings to time out; a connection made (the owner bound its socket, once
        started: an engine only once its model is loaded) is pinged at once, so that every
        worker sees a server come up within a reconnect interval of each other."""
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        monitor = LoopSocket(self._sock.sock.get_monitor_socket(events))
        try:
            while True:
                event = parse_monitor_message([f.bytes for f in await monitor.recv()])
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._connected.set()
                elif event["event"] == zmq.EVENT_DISCONNECTED and self.up:
                    self._set_up(False)
                    self._fail_pending(
                        ServiceUnavailableError(f"{self._name} went away", self.service)
                    )
        finally:
            self._sock.sock.disable_monitor()
            monitor.close()
