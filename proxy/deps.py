"""Typed dependencies: routes receive services through these aliases (STYLE.md rule 2).

They are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in its thread pool,
a thread hop per request that cost about 40% of a cached request's server time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request

from proxy.errors import APIError
from proxy.public import public_reason
from proxy.services import Services, lane_for

_NOT_LABEL = re.compile(r"[^a-z0-9_.-]+")


def caller_label(header: str | None) -> str:
    """``X-Caller`` as its ``by_caller`` label (API.md sets no format: any value is one): lower
    case, each run of other characters than ``a-z 0-9 _ . -`` one ``_``, at most 32
    characters; ``dispatch`` when absent or blank, ``other`` when nothing of it is left."""
    header = (header or "").strip().lower()
    if not header:
        return "dispatch"
    return _NOT_LABEL.sub("_", header)[:32].strip("_") or "other"


def not_started_reason(request: Request) -> str:
    """Why there are no services yet: still starting, or the start-up error."""
    return public_reason(str(request.app.state.startup_error or "the service is starting"))


async def get_services(request: Request) -> Services:
    services: Services | None = request.app.state.services
    if services is None:
        raise APIError(503, not_started_reason(request), type="not_ready")
    return services


@dataclass(frozen=True, slots=True)
class Caller:
    """``label``: ``X-Caller`` (``by_caller`` in stats); ``lane``: the batcher lane. With API
    keys on, the key decides the lane (``proxy.auth.Guard``); without, ``X-Caller: warmup``
    does."""

    label: str
    lane: str


async def get_caller(request: Request, x_caller: Annotated[str | None, Header()] = None) -> Caller:
    label = caller_label(x_caller)
    return Caller(label, request.scope.get("state", {}).get("lane") or lane_for(label))


ServicesDep = Annotated[Services, Depends(get_services)]
CallerDep = Annotated[Caller, Depends(get_caller)]
