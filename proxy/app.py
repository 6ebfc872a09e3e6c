"""The app factory. Nothing heavy happens at import or in ``create_app``.

The lifespan builds the services in a background task so that ``/healthz`` answers at once
and ``/readyz`` says 503 until the engine is loaded and warmed and the fleet index is loaded
(with the demo fleet, when one is configured). Two ways to run:

- ``create_app(settings)`` (``engine`` may be injected: tests): everything in this process.
- ``create_app(settings, cluster=...)``: one HTTP worker of ``fleetcache serve``; the engine
  and the fleet index live in their own processes (``proxy.processes``).

Every request but the probes passes the worker's admission (``Admission``): at most
``max_inflight_requests`` at once, above that an immediate 429 with ``Retry-After``; then
its key (``proxy.auth.Guard``: 401/403 before the route runs or the body is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engines.base import Engine
from proxy.auth import Guard, KeyRing, route_rows
from proxy.body import BodyError, media_type
from proxy.drift import background_checks
from proxy.errors import install_error_handlers
from proxy.jobs import ProcessJobs
from proxy.processes import frozen_heap, load_demo_fleet
from proxy.routes import cache, dispatch, embeddings, features, fleet, ops, warmup
from proxy.routes.warmup import JSONL_TYPES
from proxy.services import Cluster, Services, open_local_services, open_worker_services
from proxy.settings import Settings
from proxy.warmup import WarmupJobs

log = logging.getLogger("fleetcache.proxy")
PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


def _error_body(type: str, message: str) -> bytes:
    return orjson.dumps({"error": {"type": type, "message": message, "param": None}})


class Admission:
    """Pure ASGI, in front of everything:

    - at most ``limit`` requests of this worker at once (hits too): an immediate 429 with
      ``Retry-After`` above it, instead of a queue that turns into seconds of p99;
    - bodies over ``settings.max_body_mb`` (warm-up uploads: ``max_upload_mb``) are a 413,
      before a byte is read when the request says its length, else as soon as the count
      passes the limit (``BodyError`` from ``receive``: the route never sees the rest);
    - a body must arrive whole within ``settings.body_timeout_s`` of the request (a warm-up
      upload, which may be large and slow: with no pause that long; checked a tenth of it
      apart), else a 408 that closes the connection: a client sending part of a body, or a
      byte now and then, held its admission for as long as it liked, and a few such clients
      left every other at 429;
    - after every request the worker's counters are published to its board."""

    def __init__(self, app: ASGIApp, limit: int, fastapi: FastAPI) -> None:
        self.app = app
        self.limit = limit
        self.fastapi = fastapi
        self.active = 0
        self._busy = _error_body(
            "rate_limit_error", f"this worker holds {limit} requests already; retry shortly"
        )
        # the tasks waiting for a piece of a body -> its deadline (loop time); one sweep a
        # tenth of FLEETCACHE_BODY_TIMEOUT_S cancels the late ones, rather than a timer
        # scheduled and cancelled on every receive of every hit (asyncio.timeout_at)
        self._reading: dict[asyncio.Task[Any], float] = {}
        self._late: set[asyncio.Task[Any]] = set()
        self._swept: asyncio.AbstractEventLoop | None = None  # the loop the sweep runs on

    def _body_limit(self, scope: Scope) -> tuple[int, str, bool]:
        """The body's limit in bytes, its setting, and whether it is an upload."""
        settings = self.fastapi.state.settings
        if scope["method"] == "POST" and scope["path"] == "/v1/warmup":
            media = next((v for k, v in scope["headers"] if k == b"content-type"), None)
            if media_type(media) in JSONL_TYPES:
                return int(settings.max_upload_mb * 2**20), "FLEETCACHE_MAX_UPLOAD_MB", True
        return int(settings.max_body_mb * 2**20), "FLEETCACHE_MAX_BODY_MB", False

    @staticmethod
    async def _answer(send: Send, status: int, body: bytes, *headers: tuple[bytes, bytes]) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _limited(self, scope: Scope, receive: Receive) -> Receive | bytes:
        """``receive`` counting the body against its limit and timing it, or the 413 to
        answer at once."""
        limit, setting, upload = self._body_limit(scope)
        message = f"the request body is over {limit / 2**20:g} MB ({setting})"
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return _error_body("invalid_request_error", message)
        timeout_s = self.fastapi.state.settings.body_timeout_s
        loop = asyncio.get_running_loop()
        if self._swept is not loop:
            self._swept = loop
            self._sweep(loop, timeout_s)
        deadline = loop.time() + timeout_s
        seen, whole = 0, False

        async def counted() -> Message:
            nonlocal seen, whole, deadline
            if whole:  # after the body: the disconnect, whenever it comes
                return await receive()
            task = asyncio.current_task()
            assert task is not None
            self._reading[task] = deadline
            try:
                incoming = await receive()
            except asyncio.CancelledError:
                if task not in self._late:
                    raise
                self._late.discard(task)
                task.uncancel()
                raise BodyError(
                    408,
                    "request_timeout",
                    f"the request body did not arrive within {timeout_s:g} s"
                    f"{' of its last piece' if upload else ''} (FLEETCACHE_BODY_TIMEOUT_S)",
                    headers={"Connection": "close"},
                ) from None
            finally:
                self._reading.pop(task, None)
            if incoming["type"] == "http.request":
                seen += len(incoming.get("body", b""))
                if seen > limit:
                    raise BodyError(413, "invalid_request_error", message)
                whole = not incoming.get("more_body", False)
                if upload:
                    deadline = loop.time() + timeout_s
            return incoming

        return counted

    def _sweep(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        if self._swept is not loop:  # the app is served by another loop now
            return
        now = loop.time()
        for task, deadline in list(self._reading.items()):
            if now >= deadline and task not in self._late:
                self._late.add(task)
                task.cancel()
        loop.call_later(timeout_s / 10, self._sweep, loop, timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "HEAD":
            # answered as its GET (a load balancer's check of /healthz, a HEAD of /v1/stats);
            # the server sends no body, reading HEAD in its own scope
            scope = {**scope, "method": "GET"}
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        services: Services | None = self.fastapi.state.services
        if self.active >= self.limit:
            if services is not None:
                services.board.add("requests.rejected")
            await self._answer(send, 429, self._busy, (b"retry-after", b"1"))
            return
        limited = self._limited(scope, receive)
        if isinstance(limited, bytes):
            await self._answer(send, 413, limited, (b"connection", b"close"))
            return
        self.active += 1
        try:
            await self.app(scope, limited, send)
        finally:
            self.active -= 1
            if services is not None:
                services.board.add("requests")
                services.publish()


async def run_services(
    app: FastAPI,
    settings: Settings,
    engine: Engine | None,
    cluster: Cluster | None,
    stop: asyncio.Event,
    opened_event: asyncio.Event,
    freeze_gc: bool = False,
) -> None:
    def drop(keys: Sequence[str]) -> None:
        services = app.state.services
        if services is not None:
            services.drop_keys(keys)

    opened = (
        open_local_services(settings, engine)
        if cluster is None
        else open_worker_services(settings, cluster, on_drop=drop)
    )
    try:
        async with opened as services:
            app.state.services = services
            if cluster is not None and cluster.serve_after_ready_s:
                await services.wait_answering(cluster.serve_after_ready_s)
            opened_event.set()
            try:
                if cluster is None and not services.index.ready:
                    await load_demo_fleet(services, settings)
                with frozen_heap() if freeze_gc else contextlib.nullcontext():
                    async with background_checks(services, settings.drift_interval_s):
                        await stop.wait()
            finally:  # no request may reach services that are being closed
                app.state.services = None
    except Exception as exc:
        log.exception("start-up failed")
        app.state.startup_error = f"start-up failed: {type(exc).__name__}: {exc}"
    finally:
        opened_event.set()


def create_app(
    settings: Settings,
    engine: Engine | None = None,
    *,
    freeze_gc: bool = False,
    cluster: Cluster | None = None,
) -> FastAPI:
    """Build the app; ``engine`` injects a ready-made engine (tests use ``FakeEngine``);
    ``cluster`` makes it a worker of ``fleetcache serve``; ``freeze_gc`` freezes the heap once
    started (``frozen_heap``; the CLI's server does)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.services = None
        app.state.startup_error = None
        app.state.jobs = WarmupJobs() if cluster is None else ProcessJobs(settings, cluster.run_dir)
        stop, opened = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(
            run_services(app, settings, engine, cluster, stop, opened, freeze_gc)
        )
        if cluster is not None and cluster.serve_after_ready_s:
            # uvicorn binds its socket after this (proxy.processes); told to stop meanwhile,
            # the worker gives up its wait for the engine and the index
            while not opened.is_set() and not cluster.stopping():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(opened.wait(), 0.1)
            if not opened.is_set():
                task.cancel()
        try:
            yield
        finally:
            await app.state.jobs.aclose()
            stop.set()
            await asyncio.wait([task])

    app = FastAPI(
        title="fleetcache",
        version="0.1.0",
        summary="Embedding cache proxy in front of the inference GPU for fleet dispatch",
        lifespan=lifespan,
    )
    app.state.settings = settings  # read by routes that must answer before services exist
    app.state.services = None
    install_error_handlers(app)
    for module in (embeddings, features, fleet, dispatch, warmup, cache, ops):
        app.include_router(module.router)
    route_rows(app)  # every route has its row of scopes, or no app
    app.add_middleware(
        Guard,
        fastapi=app,
        ring=open_key_ring(settings),
        admin_token=settings.admin_token,
        metrics_public=settings.metrics_public,
    )
    app.add_middleware(Admission, limit=settings.max_inflight_requests, fastapi=app)
    return app


def open_key_ring(settings: Settings) -> KeyRing | None:
    """The keys of ``FLEETCACHE_API_KEYS_FILE`` (a bad file raises ``KeysFileError``), or
    None: the service is open but for its admin routes, and the log says so."""
    if settings.api_keys_file is None:
        closed = "/v1/cache/..." if settings.metrics_public else "/v1/cache/... and /metrics"
        log.warning("auth off: no FLEETCACHE_API_KEYS_FILE, every route but %s is open", closed)
        return None
    ring = KeyRing(settings.api_keys_file, settings.admin_token)
    log.info("auth on: %d API keys from %s", len(ring), settings.api_keys_file)
    return ring
