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

_CALLER = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,31}$")


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
    label = (x_caller or "dispatch").strip().lower()
    if not _CALLER.match(label):
        raise APIError(
            422, "X-Caller must be 1-32 characters of a-z, 0-9, '_', '.', '-'", param="X-Caller"
        )
    return Caller(label, request.scope.get("state", {}).get("lane") or lane_for(label))


ServicesDep = Annotated[Services, Depends(get_services)]
CallerDep = Annotated[Caller, Depends(get_caller)]
