"""Cache administration (admin only): ``DELETE /v1/cache/entities/{driver|vehicle}/{id}``
and ``POST /v1/cache/drift`` (``proxy.drift``).

Scope ``admin`` (``proxy.auth``): with no keys file, ``Authorization: Bearer
<FLEETCACHE_ADMIN_TOKEN>``; without a configured token they answer 403 (disabled), with a
missing or wrong one 401.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from features.models import Identifier
from proxy.body import JSONRoute
from proxy.deps import ServicesDep
from proxy.drift import DEFAULT_SAMPLE, MAX_SAMPLE, check_drift
from proxy.errors import API_ERRORS, APIError
from proxy.ipc import ServiceUnavailableError

log = logging.getLogger("fleetcache.proxy")
router = APIRouter(tags=["cache"], route_class=JSONRoute, responses=API_ERRORS)

EntityKind = Literal["driver", "vehicle"]


@router.delete("/v1/cache/entities/{kind}/{entity_id:path}")
async def forget_entity(
    kind: EntityKind, entity_id: Identifier, services: ServicesDep
) -> dict[str, Any]:
    """Drop the entity's cached vector from every tier; its next embed is a miss."""
    try:
        deleted = await services.forget_entity(kind, entity_id)
    except ServiceUnavailableError:  # 503 <service>_unavailable + Retry-After: retry it
        raise
    except Exception as exc:
        log.warning("forgetting %s %r failed: %r", kind, entity_id, exc)
        raise APIError(
            503, "the cache store is unavailable; retry shortly", type="store_error"
        ) from exc
    if deleted is None:
        raise APIError(
            404, f"no cached vector is linked to {kind} {entity_id!r}", param="id", type="not_found"
        )
    return {"entity": kind, "id": entity_id, "deleted": deleted}


class DriftRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sample: int = Field(
        DEFAULT_SAMPLE, ge=1, le=MAX_SAMPLE, description="recent cache hits to re-embed"
    )


class DriftResult(BaseModel):
    """API.md v1.1, "Drift check"; both cosines are null when nothing could be sampled."""

    sampled: int
    min_cosine: float | None
    mean_cosine: float | None
    below_threshold: int
    threshold: float


@router.post("/v1/cache/drift", response_model=DriftResult)
async def drift(services: ServicesDep, body: DriftRequest | None = None) -> dict[str, Any]:
    """Re-embed a random sample of recent cache hits (every worker's) on the warm-up lane and
    compare each with its cached vector."""
    return await check_drift(services, (body or DriftRequest()).sample)
