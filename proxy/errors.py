"""Every error leaves the service in OpenAI's shape, never as a stack trace (API.md)::

    {"error": {"type": "...", "message": "...", "param": "..." | null}}

Exceptions translated here, one handler per family::

    APIError                        raised by our routes: status, type, message, param
    RequestValidationError          pydantic/FastAPI: 422 (400 for malformed JSON), param = field;
                                    415 for a body sent as another media type (a form)
    StarletteHTTPException          unknown path 404, wrong method 405, ...
     +-- proxy.body.BodyError       a body refused at the edge: 400 invalid_json, or 422 for a
                                    string that is not valid Unicode (param = its path), 413
                                    over its size limit, 408 not arrived in time
    features UnknownConstraintError 422, param "constraints", lists the known ones
    engines TooLargeError           413 (more new texts than the queue can ever hold)
    engines QueueFullError          429 (retry later)
    engines DeadlineExceededError   503 "deadline_exceeded" (queued past its deadline; retry)
    proxy.ipc ServiceUnavailableError  503 "<service>_unavailable" + Retry-After: the engine
                                    process or the fleet index owner is down (or restarting),
                                    or the warm-up job starter took a job and fell silent
    engines EngineUnavailableError  503 "engine_unavailable" + Retry-After: nothing can serve
                                    a miss now (primary unhealthy, no fallback)
    engines EngineError             503 "engine_error" (a batch failed; hits are still served)
    cache InvalidTextError          422 (a text that is not valid Unicode; the edge refuses
                                    such bodies first, this guards every other way in)
    Exception                       500 "internal_error", logged with its traceback
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Route

from cache.embedder import InvalidTextError
from engines.base import (
    DeadlineExceededError,
    EngineError,
    EngineUnavailableError,
    QueueFullError,
    TooLargeError,
)
from features.constraints import UnknownConstraintError
from proxy.body import BodyError, media_type
from proxy.ipc import ServiceUnavailableError
from proxy.public import public_reason

log = logging.getLogger("fleetcache.proxy")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")


def error_response(
    status: int, message: str, *, type: str, param: str | None = None, headers: Any = None
) -> JSONResponse:
    body = {"error": {"type": type, "message": message, "param": param}}
    return JSONResponse(body, status_code=status, headers=headers)


def field_path(loc: Sequence[int | str]) -> str:
    """``("body", "drivers", 3, "vehicle", "type")`` -> ``drivers[3].vehicle.type``."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith(("function-", "tagged-union")):  # pydantic union branch labels
            out += f".{part}" if out else part
    return out


def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        return error_response(400, f"malformed JSON: {first.get('msg')}", type="invalid_json")
    loc = tuple(first.get("loc", ()))
    if loc == ("body",):  # the body is no JSON object
        media = media_type(request.headers.get("content-type"))
        if media != "application/json" and not media.endswith("+json"):
            got = f"got '{media}'" if media else "no Content-Type was sent"
            return error_response(
                415,
                f"send the body as JSON with 'Content-Type: application/json' ({got})",
                type="invalid_request_error",
            )
    param = field_path(loc) or ("body" if loc == ("body",) else None)
    message = "; ".join(
        f"{field_path(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors[:5]
    )
    if len(errors) > 5:
        message += f"; and {len(errors) - 5} more"
    return error_response(422, message, type="invalid_request_error", param=param)


def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return error_response(
        exc.status, exc.message, type=exc.type, param=exc.param, headers=exc.headers
    )


def app_routes(app: FastAPI) -> list[Route]:
    """Every route of the app, those of included routers too (our routers have no prefix, so
    a route's own path is its full path)."""
    found: list[Route] = []
    routes = list(app.router.routes)
    while routes:
        route = routes.pop(0)
        included = getattr(route, "original_router", None)  # FastAPI's included routers
        if included is not None:
            routes.extend(included.routes)
        elif isinstance(route, Route):
            found.append(route)
    return found


def allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette's own 405 names only the first
    route it tried), as the schema documents them (HEAD, implied by GET, left out)."""
    methods: set[str] = set()
    for route in app_routes(request.app):
        if route.path_regex.match(request.url.path):
            methods |= set(route.methods or ()) - {"HEAD"}
    return ", ".join(sorted(methods))


def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if isinstance(exc, BodyError):
        return error_response(
            exc.status_code, exc.message, type=exc.type, param=exc.param, headers=exc.headers
        )
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    headers = exc.headers
    if exc.status_code == 405:
        headers = {**(headers or {}), "Allow": allowed_methods(request)}
    return error_response(exc.status_code, str(exc.detail), type=kind, headers=headers)


def _constraint(request: Request, exc: Exception) -> JSONResponse:
    return error_response(422, str(exc), type="invalid_request_error", param="constraints")


def _too_large(request: Request, exc: Exception) -> JSONResponse:
    return error_response(413, str(exc), type="invalid_request_error", param="input")


@contextlib.contextmanager
def texts_of(param: str) -> Iterator[None]:
    """Around a route's embedding of records: more new texts than the queue can ever hold
    is a 413 naming ``param``, the request's field that holds them (``input`` otherwise)."""
    try:
        yield
    except TooLargeError as exc:
        raise APIError(413, str(exc), param=param) from exc


def _queue_full(request: Request, exc: Exception) -> JSONResponse:
    services = request.app.state.services
    if services is not None:  # /v1/stats queue.rejected, the alert on queue rejections
        services.board.add("requests.queue_full")
    return error_response(
        429,
        f"inference queue is full: {exc}",
        type="rate_limit_error",
        headers={"Retry-After": "1"},
    )


def _deadline(request: Request, exc: Exception) -> JSONResponse:
    return error_response(
        503,
        f"inference queue too slow for this request's deadline: {exc}",
        type="deadline_exceeded",
        headers={"Retry-After": "1"},
    )


def _unavailable(request: Request, exc: Exception) -> JSONResponse:
    service = exc.service if isinstance(exc, ServiceUnavailableError) else "engine"
    return error_response(
        503,
        f"{service} unavailable, retry shortly: {public_reason(str(exc))}",
        type=f"{service}_unavailable",
        headers={"Retry-After": "1"},
    )


def _engine(request: Request, exc: Exception) -> JSONResponse:
    message = f"inference engine unavailable: {public_reason(str(exc))}"
    return error_response(503, message, type="engine_error")


def _invalid_text(request: Request, exc: Exception) -> JSONResponse:
    return error_response(422, str(exc), type="invalid_request_error")


def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal error; see the server log", type="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(UnknownConstraintError, _constraint)
    app.add_exception_handler(TooLargeError, _too_large)
    app.add_exception_handler(QueueFullError, _queue_full)
    app.add_exception_handler(DeadlineExceededError, _deadline)
    app.add_exception_handler(EngineUnavailableError, _unavailable)
    app.add_exception_handler(EngineError, _engine)
    app.add_exception_handler(InvalidTextError, _invalid_text)
    app.add_exception_handler(Exception, _unhandled)


# -- the contract, as /openapi.json states it ---------------------------------------------


class ErrorDetail(BaseModel):
    type: str
    message: str
    param: str | None


class ErrorBody(BaseModel):
    """Every error answer (API.md): ``{"error": {"type", "message", "param"}}``."""

    error: ErrorDetail


_ERROR_MEANING = {
    400: "Malformed JSON (invalid_json).",
    408: "The body did not arrive within FLEETCACHE_BODY_TIMEOUT_S (request_timeout).",
    401: "No or unknown key (authentication_error).",
    403: "The key lacks the scope, or the route is disabled (permission_error).",
    404: "Unknown resource (not_found).",
    413: "Over a request limit (body, texts, records, queue).",
    415: "A body sent without 'Content-Type: application/json'.",
    422: "Invalid input; param names the field.",
    429: "This worker or the inference queue is full; retry after Retry-After.",
    503: "Not ready, or the engine or the fleet index is unavailable; retry after Retry-After.",
}


def documented_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a router: each status with the error body's schema."""
    return {
        status: {"model": ErrorBody, "description": _ERROR_MEANING[status]} for status in statuses
    }


API_ERRORS = documented_errors(400, 401, 403, 404, 408, 413, 415, 422, 429, 503)
