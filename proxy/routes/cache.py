"""Cache administration: ``DELETE /v1/cache/entities/{driver|vehicle}/{id}`` (admin only).

Scope ``admin`` (``proxy.auth``): with no keys file, ``Authorization: Bearer
<FLEETCACHE_ADMIN_TOKEN>``; without a configured token they answer 403 (disabled), with a
missing or wrong one 401.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import APIRouter

from proxy.body import JSONRoute
from proxy.deps import ServicesDep
from proxy.errors import API_ERRORS, APIError

log = logging.getLogger("fleetcache.proxy")
router = APIRouter(tags=["cache"], route_class=JSONRoute, responses=API_ERRORS)

EntityKind = Literal["driver", "vehicle"]


@router.delete("/v1/cache/entities/{kind}/{entity_id}")
async def forget_entity(kind: EntityKind, entity_id: str, services: ServicesDep) -> dict[str, Any]:
    """Drop the entity's cached vector from every tier; its next embed is a miss."""
    try:
        deleted = await services.forget_entity(kind, entity_id)
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
