"""The fleet index: ``PUT /v1/fleet/drivers`` and ``GET|PATCH|DELETE /v1/fleet/drivers/{id}``.

Only ``PUT`` embeds (through the cache); ``PATCH`` moves a driver or changes its status in the
index without any inference.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from features.models import DriverRecord, Position, Status
from proxy.body import JSONRoute
from proxy.deps import CallerDep, ServicesDep
from proxy.errors import API_ERRORS, APIError
from proxy.responses import FastJSONResponse
from proxy.routes.features import check_record_count

router = APIRouter(tags=["fleet"], route_class=JSONRoute, responses=API_ERRORS)


class UpsertRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    drivers: list[DriverRecord] = Field(min_length=1)


class DriverPatch(BaseModel):
    """Position, status or both; a null is the same as leaving the field out."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "anyOf": [
                {"required": ["position"], "properties": {"position": {"type": "object"}}},
                {"required": ["status"], "properties": {"status": {"type": "string"}}},
            ]
        },
    )
    position: Position | None = None
    status: Status | None = None


def unknown_driver(driver_id: str) -> APIError:
    return APIError(404, f"unknown driver {driver_id!r}", param="driver_id", type="not_found")


def record_json(record: DriverRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


@router.put("/v1/fleet/drivers")
async def upsert_drivers(body: UpsertRequest, services: ServicesDep, caller: CallerDep) -> Response:
    started = time.perf_counter()
    check_record_count(len(body.drivers), services.settings.max_records_per_request, "drivers")
    upserted, result = await services.upsert_drivers(body.drivers, caller.label, lane=caller.lane)
    services.latency.observe("fleet_upsert", result.misses, time.perf_counter() - started)
    headers = {"X-Cache-Hits": str(result.not_sent), "X-Cache-Misses": str(result.misses)}
    return FastJSONResponse({"upserted": upserted, "embedded": result.misses}, headers=headers)


@router.get("/v1/fleet/drivers/{driver_id}")
async def get_driver(driver_id: str, services: ServicesDep) -> dict[str, Any]:
    record = await services.index.get_driver(driver_id)
    if record is None:
        raise unknown_driver(driver_id)
    return record_json(record)


@router.patch("/v1/fleet/drivers/{driver_id}")
async def patch_driver(driver_id: str, body: DriverPatch, services: ServicesDep) -> dict[str, Any]:
    if body.position is None and body.status is None:
        raise APIError(422, "send position, status or both", param="position")
    try:
        record = await services.update_driver(driver_id, position=body.position, status=body.status)
    except KeyError:
        raise unknown_driver(driver_id) from None
    return record_json(record)


@router.delete("/v1/fleet/drivers/{driver_id}")
async def delete_driver(driver_id: str, services: ServicesDep) -> dict[str, Any]:
    if not await services.delete_driver(driver_id):
        raise unknown_driver(driver_id)
    return {"deleted": driver_id}
