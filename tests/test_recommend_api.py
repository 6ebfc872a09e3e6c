"""``recommend`` over HTTP equals a brute-force answer computed from the contract's rules."""

from __future__ import annotations

import random

import numpy as np
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from features.constraints import CONSTRAINTS, satisfies
from features.geo import haversine_km
from features.models import Cargo, DriverRecord, Order
from features.synthetic import generate_fleet
from features.text import driver_text, order_text


def brute_force(
    fleet: dict[str, DriverRecord], order: Order, engine: FakeEngine
) -> tuple[list[tuple[str, float, float]], int]:
    query = engine.embed([order_text(order)])[0]
    considered = 0
    scored = []
    for driver in fleet.values():
        distance = haversine_km(
            order.pickup.lat, order.pickup.lng, driver.position.lat, driver.position.lng
        )
        if driver.status != "available" or distance > order.radius_km:
            continue
        considered += 1
        if not satisfies(driver, order.constraints, order.cargo):
            continue
        similarity = float(np.dot(engine.embed([driver_text(driver)])[0], query))
        scored.append((driver.driver_id, similarity, distance))
    scored.sort(key=lambda s: (-s[1], s[2], s[0]))
    return scored[: order.k], considered


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_recommend_matches_brute_force(client: TestClient, seed: int) -> None:
    rng = random.Random(seed)
    engine = FakeEngine()  # same vectors as the app's fake engine
    drivers = generate_fleet(600, seed=seed)
    assert (
        client.put(
            "/v1/fleet/drivers", json={"drivers": [d.model_dump(mode="json") for d in drivers]}
        ).status_code
        == 200
    )
    fleet = {d.driver_id: d for d in drivers}

    # live updates: moves and status changes through PATCH, a few deletes
    for driver in rng.sample(drivers, 60):
        body = {
            "status": rng.choice(["available", "busy", "offline"]),
            "position": {
                "lat": driver.position.lat + rng.uniform(-0.05, 0.05),
                "lng": driver.position.lng + rng.uniform(-0.05, 0.05),
            },
        }
        stored = client.patch(f"/v1/fleet/drivers/{driver.driver_id}", json=body)
        assert stored.status_code == 200
        fleet[driver.driver_id] = DriverRecord.model_validate(stored.json())
    for driver in rng.sample(drivers, 20):
        if driver.driver_id in fleet:
            assert client.delete(f"/v1/fleet/drivers/{driver.driver_id}").status_code == 200
            del fleet[driver.driver_id]

    for _ in range(12):
        anchor = rng.choice(drivers).position
        cargo = rng.choice(
            [
                None,
                {
                    "weight_kg": rng.choice([0, 50, 300, 1500]),
                    "volume_m3": rng.choice([0, 1.0, 4.0]),
                    "height_m": rng.choice([0, 1.0, 1.8]),
                },
            ]
        )
        body = {
            "order_id": f"O{rng.randrange(10**6)}",
            "pickup": {
                "lat": anchor.lat + rng.uniform(-0.02, 0.02),
                "lng": anchor.lng + rng.uniform(-0.02, 0.02),
            },
            "cargo": cargo,
            "constraints": rng.sample(sorted(CONSTRAINTS), rng.choice([0, 0, 1, 2])),
            "requirements": rng.choice(["", "fragile", "fourth floor, no lift"]),
            "radius_km": rng.choice([2.0, 5.0, 10.0, 25.0]),
            "k": rng.choice([1, 5, 10, 50]),
            "explain": True,
        }
        response = client.post("/v1/dispatch/recommend", json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        order = Order.model_validate({**body, "cargo": Cargo(**cargo) if cargo else None})
        expected, considered = brute_force(fleet, order, engine)
        assert answer["order_text"] == order_text(order)
        assert answer["considered"] == considered
        assert [c["driver_id"] for c in answer["candidates"]] == [e[0] for e in expected]
        for got, (_, similarity, distance) in zip(answer["candidates"], expected, strict=True):
            assert got["similarity"] == pytest.approx(similarity, abs=1e-5)
            assert got["distance_km"] == pytest.approx(distance, abs=1e-6)
            assert got["vehicle_id"] == fleet[got["driver_id"]].vehicle.vehicle_id


def test_a_moved_driver_is_found_at_its_new_position(
    client: TestClient, fake_engine: FakeEngine
) -> None:
    driver = generate_fleet(1, seed=9)[0].model_copy(update={"status": "available"})
    client.put("/v1/fleet/drivers", json={"drivers": [driver.model_dump(mode="json")]})
    items = fake_engine.items
    order = {"order_id": "O9", "pickup": {"lat": -33.9, "lng": 18.4}, "radius_km": 1}
    assert client.post("/v1/dispatch/recommend", json=order).json()["candidates"] == []
    client.patch(
        f"/v1/fleet/drivers/{driver.driver_id}", json={"position": {"lat": -33.9, "lng": 18.401}}
    )
    assert fake_engine.items == items + 1  # only the order text was embedded, not the driver
    found = client.post("/v1/dispatch/recommend", json=order).json()
    assert [c["driver_id"] for c in found["candidates"]] == [driver.driver_id]
    assert found["considered"] == 1
    assert fake_engine.items == items + 1  # the same order text is now a hit
