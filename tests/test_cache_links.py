"""Entity -> key links and ``DELETE /v1/cache/entities/{driver|vehicle}/{id}`` (admin)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from features.models import DriverRecord
from features.synthetic import generate_fleet
from features.text import driver_text, vehicle_text
from tests.conftest import make_settings, open_client, wait_ready
from tests.redis_server import (  # noqa: F401  (pytest fixtures)
    RedisServer,
    redis_server_fixture,
    redis_session_fixture,
)

TOKEN = "s3cret-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def admin_client(tmp_path: Path, engine: FakeEngine) -> Iterator[TestClient]:
    with open_client(make_settings(tmp_path / "data", admin_token=TOKEN), engine) as client:
        wait_ready(client)
        yield client


def driver_json(driver: DriverRecord, **profile: Any) -> dict[str, Any]:
    data = driver.model_dump(mode="json")
    data["profile"].update(profile)
    return data


def embed(client: TestClient, drivers: list[dict[str, Any]], vehicles: Any = ()) -> Any:
    body = {"drivers": drivers, "vehicles": list(vehicles), "include_vectors": False}
    response = client.post("/v1/features/embed", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def text_misses(client: TestClient, text: str) -> int:
    """Whether ``text`` is still cached: /v1/embeddings says if it had to compute it."""
    response = client.post("/v1/embeddings", json={"input": text})
    return int(response.headers["X-Cache-Misses"])


def test_delete_drops_the_vector_and_the_next_embed_computes_it_again(
    admin_client: TestClient, engine: FakeEngine
) -> None:
    d1, d2 = (driver_json(d) for d in generate_fleet(2, seed=11))
    assert embed(admin_client, [d1, d2])["misses"] == 2
    assert embed(admin_client, [d1, d2])["hits"] == 2

    response = admin_client.delete(f"/v1/cache/entities/driver/{d1['driver_id']}", headers=ADMIN)
    assert response.status_code == 200, response.text
    assert response.json() == {"entity": "driver", "id": d1["driver_id"], "deleted": 1}

    items = engine.items
    again = embed(admin_client, [d1, d2])
    assert [r["cache"] for r in again["results"]] == ["miss", "hit"]
    assert engine.items == items + 1  # the engine ran again, for d1 only

    # A link without a vector behind it (gone already): 200 with nothing deleted.
    assert (
        admin_client.delete(f"/v1/cache/entities/driver/{d2['driver_id']}", headers=ADMIN).json()[
            "deleted"
        ]
        == 1
    )
    second = admin_client.delete(f"/v1/cache/entities/driver/{d2['driver_id']}", headers=ADMIN)
    assert second.status_code == 404  # the link went with the vector


def test_a_delete_a_worker_did_not_confirm_is_a_503_and_its_retry_finishes_it(
    admin_client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API.md: invalidations reach every worker's memory tier before the 200. A worker that
    did not confirm its drop in time (the engine process asks each) makes it a 503 with
    Retry-After; the entity stays linked, so the retry drops it everywhere and answers 200."""
    (record,) = (driver_json(d) for d in generate_fleet(1, seed=12))
    embed(admin_client, [record])
    engine = admin_client.app.state.services.engine  # type: ignore[attr-defined]
    confirmed = engine.invalidate

    async def one_silent(keys: Any) -> dict[str, Any]:
        return {"workers": 2, "silent": ["worker-1"]}

    monkeypatch.setattr(engine, "invalidate", one_silent)
    path = f"/v1/cache/entities/driver/{record['driver_id']}"
    refused = admin_client.delete(path, headers=ADMIN)
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "workers_unavailable" and "1 of 2 workers" in error["message"]
    monkeypatch.setattr(engine, "invalidate", confirmed)
    retried = admin_client.delete(path, headers=ADMIN)
    assert retried.status_code == 200, retried.text
    assert admin_client.delete(path, headers=ADMIN).status_code == 404  # now unlinked
    assert embed(admin_client, [record])["misses"] == 1


def test_an_id_with_a_slash_is_forgotten_through_its_percent_encoded_path(
    admin_client: TestClient,
) -> None:
    (driver,) = generate_fleet(1, seed=13)
    record = driver_json(driver) | {"driver_id": "depot/7"}
    assert embed(admin_client, [record])["misses"] == 1
    path = f"/v1/cache/entities/driver/{quote('depot/7', safe='')}"
    response = admin_client.delete(path, headers=ADMIN)
    assert response.json() == {"entity": "driver", "id": "depot/7", "deleted": 1}
    assert text_misses(admin_client, driver_text(driver)) == 1


def test_vehicles_are_linked_too(admin_client: TestClient) -> None:
    (driver,) = generate_fleet(1, seed=12)
    vehicle = driver.vehicle.model_dump(mode="json")
    assert embed(admin_client, [], [vehicle])["misses"] == 1
    path = f"/v1/cache/entities/vehicle/{driver.vehicle.vehicle_id}"
    assert admin_client.delete(path, headers=ADMIN).json()["deleted"] == 1
    assert text_misses(admin_client, vehicle_text(driver.vehicle)) == 1
    # The same id as a driver was never embedded.
    missing = admin_client.delete(
        f"/v1/cache/entities/driver/{driver.vehicle.vehicle_id}", headers=ADMIN
    )
    assert missing.status_code == 404


def test_an_entity_whose_features_change_has_its_previous_vector_dropped(
    admin_client: TestClient,
) -> None:
    (driver,) = generate_fleet(1, seed=13)
    before = driver_json(driver, service_score=3.1)
    after = driver_json(driver, service_score=4.9)
    old_text = driver_text(DriverRecord.model_validate(before))
    assert old_text != driver_text(DriverRecord.model_validate(after))

    put = admin_client.put("/v1/fleet/drivers", json={"drivers": [before]})
    assert put.json()["embedded"] == 1
    assert embed(admin_client, [after])["misses"] == 1  # new features: a new vector
    assert text_misses(admin_client, old_text) == 1  # the old one is gone from every tier
    # ... and DELETE now drops the new one.
    response = admin_client.delete(f"/v1/cache/entities/driver/{driver.driver_id}", headers=ADMIN)
    assert response.json()["deleted"] == 1
    assert embed(admin_client, [after])["misses"] == 1


def test_a_driver_put_twice_in_one_request_is_upserted_once_as_its_last_record(
    admin_client: TestClient, engine: FakeEngine
) -> None:
    """The index keeps a driver's last record; the record before it was embedded too (a GPU
    call) and its vector stayed cached with no driver linked to it, never dropped."""
    (driver,) = generate_fleet(1, seed=17)
    first, last = driver_json(driver, service_score=2.2), driver_json(driver, service_score=4.4)
    first_text = driver_text(DriverRecord.model_validate(first))
    items = engine.items
    put = admin_client.put("/v1/fleet/drivers", json={"drivers": [first, last]})
    assert put.status_code == 200, put.text
    assert put.json() == {"upserted": 1, "embedded": 1}
    assert put.headers["X-Cache-Misses"] == "1" and engine.items == items + 1
    stored = admin_client.get(f"/v1/fleet/drivers/{driver.driver_id}").json()
    assert stored["profile"]["service_score"] == 4.4
    assert text_misses(admin_client, first_text) == 1  # never computed, never cached


def test_unknown_entity_is_404_and_bad_kind_is_422(admin_client: TestClient) -> None:
    response = admin_client.delete("/v1/cache/entities/driver/NOPE", headers=ADMIN)
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found"
    assert "NOPE" in response.json()["error"]["message"]

    response = admin_client.delete("/v1/cache/entities/order/O1", headers=ADMIN)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["param"] == "kind"
    assert "driver" in error["message"] and "vehicle" in error["message"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},  # no scheme
        {"Authorization": f"Basic {TOKEN}"},
    ],
    ids=["missing", "wrong-token", "no-scheme", "basic"],
)
def test_wrong_or_missing_token_is_401(admin_client: TestClient, headers: dict[str, str]) -> None:
    (driver,) = generate_fleet(1, seed=14)
    embed(admin_client, [driver.model_dump(mode="json")])
    path = f"/v1/cache/entities/driver/{driver.driver_id}"
    response = admin_client.delete(path, headers=headers)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "authentication_error" and "Bearer" in error["message"]
    assert embed(admin_client, [driver.model_dump(mode="json")])["hits"] == 1  # untouched
    # Authentication comes before validation: a bad kind without a token is a 401 too.
    assert admin_client.delete("/v1/cache/entities/order/x", headers=headers).status_code == 401


def test_admin_routes_are_403_until_a_token_is_configured(client: TestClient) -> None:
    response = client.delete("/v1/cache/entities/driver/D1", headers=ADMIN)
    assert response.status_code == 403
    error = response.json()["error"]
    assert error["type"] == "permission_error"
    assert "FLEETCACHE_ADMIN_TOKEN" in error["message"]


@pytest.mark.redis
def test_replicas_sharing_redis_share_links(tmp_path: Path, redis_server: RedisServer) -> None:
    """What one replica embedded, another can drop; and it is gone from Redis for all."""
    (driver,) = generate_fleet(1, seed=15)
    record = driver.model_dump(mode="json")
    settings = [
        make_settings(tmp_path / name, store="redis", redis_url=redis_server.url, admin_token=TOKEN)
        for name in ("one", "two", "three")
    ]
    with open_client(settings[0]) as one, open_client(settings[1]) as two:
        wait_ready(one)
        wait_ready(two)
        assert embed(one, [record])["misses"] == 1
        response = two.delete(f"/v1/cache/entities/driver/{driver.driver_id}", headers=ADMIN)
        assert response.json() == {"entity": "driver", "id": driver.driver_id, "deleted": 1}
        assert embed(two, [record])["misses"] == 1
    engine = FakeEngine()
    with open_client(settings[2], engine) as three:  # a fresh replica: Redis has it again
        wait_ready(three)
        items = engine.items  # after the engine's own warm-up
        assert embed(three, [record])["hits"] == 1
        assert engine.items == items
