"""``POST /v1/dispatch/recommend``: the best available drivers near a pickup for an order."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from features.constraints import check_constraints
from features.models import Order
from features.text import order_text
from proxy.body import JSONRoute
from proxy.deps import CallerDep, ServicesDep
from proxy.errors import API_ERRORS

router = APIRouter(tags=["dispatch"], route_class=JSONRoute, responses=API_ERRORS)


@router.post("/v1/dispatch/recommend")
async def recommend(order: Order, services: ServicesDep, caller: CallerDep) -> dict[str, Any]:
    started = time.perf_counter()
    check_constraints(order.constraints)  # before anything is embedded
    text = order_text(order)
    result = await services.embed([text], caller.label, caller.lane)
    searched = time.perf_counter()
    answer = await services.index.recommend(order, result.vectors[0])
    services.latency.observe_stage("index", time.perf_counter() - searched)
    took = time.perf_counter() - started
    services.latency.observe("recommend", result.misses, took)
    body: dict[str, Any] = {
        "order_id": order.order_id,
        "candidates": [
            {
                "driver_id": c.driver_id,
                "vehicle_id": c.vehicle_id,
                "similarity": c.similarity,
                "distance_km": c.distance_km,
            }
            for c in answer.candidates
        ],
        "considered": answer.considered,
        "took_ms": took * 1000.0,
    }
    if order.explain:
        body["order_text"] = text
    return body
