"""JSON request bodies, parsed and checked at the edge before any route sees them.

Every route is a ``JSONRoute``: FastAPI reads a JSON body through ``request.json()``, which
here parses with orjson (strict, and about twice as fast as ``json``) and falls back to the
standard library only for what orjson refuses. Two kinds of bad input end here, in the error
shape of API.md, never inside the service::

    not JSON at all (syntax, invalid UTF-8, nesting deeper than 1,024)  400 invalid_json
    a string that is not valid Unicode (a lone surrogate, sent as the
    escape "\\ud800"), in a value or a key anywhere in the body          422, param = its path

A lone surrogate is valid JSON but no text: the tokenizer cannot encode it, and one such string
used to fail its whole engine batch and mark the engine unhealthy for every client (issue 12).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException


def media_type(content_type: str | bytes | None) -> str:
    """A Content-Type header's media type, lower case and without its parameters ("" for
    none): ``application/json`` of ``Application/JSON; charset=utf-8``."""
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    return (content_type or "").split(";")[0].strip().lower()


class BodyError(StarletteHTTPException):
    """A body refused before validation; FastAPI re-raises HTTP exceptions from ``json()``."""

    def __init__(
        self,
        status: int,
        type: str,
        message: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers)
        self.type = type
        self.message = message
        self.param = param


def invalid_string_path(value: Any) -> str | None:
    """The path (``drivers[3].vehicle.vehicle_id``) of the first string in ``value`` that is
    not valid Unicode, or None. Keys count as strings; a bad key is named by itself."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path or "body"
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                child_path = f"{path}.{key}" if path else str(key)
                if not _encodable(key):
                    return path or "body"
                stack.append((child, child_path))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _encodable(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_json(body: bytes) -> Any:
    """The body's JSON value, or ``BodyError`` (400 invalid_json, or 422 naming the string)."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        first_error = str(exc)
    # orjson refused it. The standard parser accepts more: lone surrogate escapes (refused
    # below, with their path), NaN and Infinity and integers too large for a double (the
    # models refuse them by field), UTF-16 and UTF-32 bodies. Too deep a nesting is a
    # RecursionError there. (orjson reads an integer past 64 bits as a float.)
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError included
        raise BodyError(400, "invalid_json", f"malformed JSON: {first_error}") from None
    path = invalid_string_path(value)
    if path is not None:
        raise BodyError(
            422,
            "invalid_request_error",
            f"{path}: not a valid Unicode string (a lone surrogate such as \\ud800)",
            param=path,
        )
    return value


class JSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class JSONRoute(APIRoute):
    """Routes whose JSON bodies go through ``parse_json``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route_handler(request: Request) -> Response:
            return await handler(JSONRequest(request.scope, request.receive))

        return route_handler
