"""Operators: ``/v1/stats``, ``/healthz``, ``/readyz``, ``/metrics`` and ``/dashboard``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.body import JSONRoute
from proxy.dashboard import dashboard_html
from proxy.deps import ServicesDep, not_started_reason
from proxy.errors import API_ERRORS, error_response
from proxy.metrics import build_registry
from proxy.public import public_reason
from proxy.stats import build_stats

router = APIRouter(tags=["operators"], route_class=JSONRoute, responses=API_ERRORS)


@router.get("/v1/stats")
async def stats(services: ServicesDep) -> dict[str, Any]:
    return build_stats(services)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> Response:
    services = request.app.state.services
    if services is None:
        return error_response(503, not_started_reason(request), type="not_ready")
    ready, reason = services.ready
    if not ready:
        return error_response(503, public_reason(reason), type="not_ready")
    return Response('{"status":"ready"}', media_type="application/json")


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}},
)
async def metrics(services: ServicesDep) -> Response:
    return Response(generate_latest(build_registry(services)), media_type=CONTENT_TYPE_LATEST)


@router.get("/dashboard", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """Served while starting too: the page itself shows "not ready" until /v1/stats answers."""
    return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})
