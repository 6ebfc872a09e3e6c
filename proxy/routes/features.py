"""``POST /v1/features/embed``: driver and vehicle records to embeddings, through the cache."""

from __future__ import annotations

import time

from fastapi import APIRouter, Response
from pydantic import BaseModel, ConfigDict, StrictBool

from cache.links import Entity
from features.models import DriverRecord, VehicleRecord
from features.text import driver_text, vehicle_text
from proxy.body import JSONRoute
from proxy.deps import CallerDep, ServicesDep
from proxy.errors import API_ERRORS, APIError, texts_of
from proxy.responses import FastJSONResponse

router = APIRouter(tags=["features"], route_class=JSONRoute, responses=API_ERRORS)


class FeaturesRequest(BaseModel):
    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={  # at least one record (the route refuses none: 422)
            "anyOf": [
                {"required": ["drivers"], "properties": {"drivers": {"minItems": 1}}},
                {"required": ["vehicles"], "properties": {"vehicles": {"minItems": 1}}},
            ]
        },
    )

    drivers: list[DriverRecord] = []
    vehicles: list[VehicleRecord] = []
    include_vectors: StrictBool = True


def check_record_count(n: int, limit: int, param: str) -> None:
    if n == 0:
        raise APIError(422, "send at least one record", param=param)
    if n > limit:
        raise APIError(413, f"at most {limit} records per request, got {n}", param=param)


@router.post("/v1/features/embed")
async def embed_features(
    body: FeaturesRequest, services: ServicesDep, caller: CallerDep
) -> Response:
    started = time.perf_counter()
    n = len(body.drivers) + len(body.vehicles)
    field = "vehicles" if body.vehicles and not body.drivers else "drivers"
    check_record_count(n, services.settings.max_records_per_request, field)
    entities = [Entity("driver", d.driver_id, driver_text(d)) for d in body.drivers]
    entities += [Entity("vehicle", v.vehicle_id, vehicle_text(v)) for v in body.vehicles]
    with texts_of(field):
        result = await services.embed_entities(entities, caller.label, caller.lane)
    results = []
    for (entity, entity_id, _), status, row in zip(
        entities, result.statuses, result.vectors, strict=True
    ):
        item = {"entity": entity, "id": entity_id, "cache": "miss" if status == "miss" else "hit"}
        if body.include_vectors:
            item["embedding"] = row
        results.append(item)
    services.latency.observe("features", result.misses, time.perf_counter() - started)
    payload = {"results": results, "hits": result.not_sent, "misses": result.misses}
    headers = {"X-Cache-Hits": str(result.not_sent), "X-Cache-Misses": str(result.misses)}
    return FastJSONResponse(payload, headers=headers)
