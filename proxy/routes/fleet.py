"""The fleet index: ``PUT /v1/fleet/drivers``, ``GET|PATCH|DELETE /v1/fleet/drivers/{id}``
and ``PATCH /v1/fleet/positions``.

Only ``PUT`` embeds (through the cache); the ``PATCH`` routes move drivers or change their
status in the index without any inference. A bulk position older than the driver's stored one
is ignored and counted ``stale``: telemetry arrives out of order, and across replicas. A single
``PATCH`` with such a position is ignored whole (its status too), as a bulk row is: it answers
the stored record, with ``X-Fleet-Stale: 1`` (0 when applied).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, Field

from features.models import (
    DriverRecord,
    Identifier,
    Latitude,
    Longitude,
    Position,
    Status,
    Timestamp,
)
from indexes.changes import Positions
from indexes.columns import timestamp_us
from proxy.body import JSONRoute
from proxy.deps import CallerDep, ServicesDep
from proxy.errors import API_ERRORS, APIError, texts_of
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


class PositionUpdate(BaseModel):
    model_config = ConfigDict(extra="ignore")
    driver_id: Identifier
    lat: Latitude
    lng: Longitude
    ts: Timestamp
    status: Status | None = None


class PositionsRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    positions: list[PositionUpdate] = Field(min_length=1)


def unknown_driver(driver_id: str) -> APIError:
    return APIError(404, f"unknown driver {driver_id!r}", param="driver_id", type="not_found")


def record_json(record: DriverRecord) -> dict[str, Any]:
    return record.model_dump(mode="json")


@router.put("/v1/fleet/drivers")
async def upsert_drivers(body: UpsertRequest, services: ServicesDep, caller: CallerDep) -> Response:
    started = time.perf_counter()
    check_record_count(len(body.drivers), services.settings.max_records_per_request, "drivers")
    with texts_of("drivers"):
        upserted, result = await services.upsert_drivers(
            body.drivers, caller.label, lane=caller.lane
        )
    services.latency.observe("fleet_upsert", result.misses, time.perf_counter() - started)
    headers = {"X-Cache-Hits": str(result.not_sent), "X-Cache-Misses": str(result.misses)}
    return FastJSONResponse({"upserted": upserted, "embedded": result.misses}, headers=headers)


@router.get("/v1/fleet/drivers/{driver_id:path}")
async def get_driver(driver_id: Identifier, services: ServicesDep) -> dict[str, Any]:
    record = await services.index.get_driver(driver_id)
    if record is None:
        raise unknown_driver(driver_id)
    return record_json(record)


@router.patch("/v1/fleet/drivers/{driver_id:path}")
async def patch_driver(driver_id: Identifier, body: DriverPatch, services: ServicesDep) -> Response:
    if body.position is None and body.status is None:
        raise APIError(422, "send position, status or both", param="position")
    try:
        record = await services.update_driver(driver_id, position=body.position, status=body.status)
    except KeyError:
        raise unknown_driver(driver_id) from None
    sent = None if body.position is None else body.position.ts
    stale = sent is not None and timestamp_us(record.position.ts) > timestamp_us(sent)
    return FastJSONResponse(record_json(record), headers={"X-Fleet-Stale": str(int(stale))})


@router.delete("/v1/fleet/drivers/{driver_id:path}")
async def delete_driver(driver_id: Identifier, services: ServicesDep) -> dict[str, Any]:
    if not await services.delete_driver(driver_id):
        raise unknown_driver(driver_id)
    return {"deleted": driver_id}


@router.patch("/v1/fleet/positions")
async def patch_positions(body: PositionsRequest, services: ServicesDep) -> dict[str, Any]:
    rows = body.positions
    check_record_count(len(rows), services.settings.max_records_per_request, "positions")
    n = len(rows)
    statuses = [r.status for r in rows]
    batch = Positions(
        ids=[r.driver_id for r in rows],
        lats=np.fromiter((r.lat for r in rows), dtype=np.float64, count=n),
        lngs=np.fromiter((r.lng for r in rows), dtype=np.float64, count=n),
        ts_us=np.fromiter((timestamp_us(r.ts) for r in rows), dtype=np.int64, count=n),
        statuses=None if all(s is None for s in statuses) else statuses,
    )
    return (await services.index.move(batch))._asdict()
