"""``PATCH /v1/fleet/positions`` (API.md v1.1 "Fleet positions in bulk"): many drivers moved
in one request, out-of-order times ignored as ``stale``, unknown drivers listed, bad rows a 422
naming the field with nothing changed, every applied batch durable across a restart; and the
same stale rule on the single ``PATCH /v1/fleet/drivers/{id}``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from features.synthetic import generate_fleet
from tests.conftest import make_settings, open_client, wait_ready

T0 = "2026-12-01T08:00:00+00:00"
T1 = "2026-12-01T08:00:10+00:00"
T2 = "2026-12-01T08:00:20+00:00"


def load(client: TestClient, n: int = 20) -> list[str]:
    drivers = generate_fleet(n, seed=5)
    body = {"drivers": [d.model_dump(mode="json") for d in drivers]}
    assert client.put("/v1/fleet/drivers", json=body).status_code == 200
    return [d.driver_id for d in drivers]


def move(driver_id: str, lat: float, lng: float, ts: str, **extra: Any) -> dict[str, Any]:
    return {"driver_id": driver_id, "lat": lat, "lng": lng, "ts": ts, **extra}


def position(client: TestClient, driver_id: str) -> tuple[float, float, str | None]:
    record = client.get(f"/v1/fleet/drivers/{driver_id}").json()
    return record["position"]["lat"], record["position"]["lng"], record["position"].get("ts")


def test_a_batch_moves_drivers_and_counts_stale_and_unknown(client: TestClient) -> None:
    a, b, c = load(client)[:3]
    first = [move(a, 52.1, 13.1, T1), move(b, 52.2, 13.2, T1)]
    answer = client.patch("/v1/fleet/positions", json={"positions": first})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"updated": 2, "stale": 0, "unknown": []}
    assert position(client, a) == (52.1, 13.1, "2026-12-01T08:00:10Z")

    late = [
        move(a, 50.0, 10.0, T0),  # older than a's stored time: ignored
        move(b, 52.25, 13.25, T1),  # the same time: applied
        move(c, 52.3, 13.3, T2, status="busy"),
        move("D-nobody", 1.0, 1.0, T2),
    ]
    answer = client.patch("/v1/fleet/positions", json={"positions": late})
    assert answer.json() == {"updated": 2, "stale": 1, "unknown": ["D-nobody"]}
    assert position(client, a)[:2] == (52.1, 13.1)
    assert position(client, b)[:2] == (52.25, 13.25)
    assert client.get(f"/v1/fleet/drivers/{c}").json()["status"] == "busy"


def test_a_single_patch_older_than_the_stored_position_is_ignored_whole(
    client: TestClient,
) -> None:
    """The bulk route's rule on the single route: a late position (and the status sent with
    it) changes nothing, the answer is the stored record, and says so in ``X-Fleet-Stale``."""
    a = load(client)[0]
    url = f"/v1/fleet/drivers/{a}"
    newer = client.patch(url, json={"position": {"lat": 52.1, "lng": 13.1, "ts": T1}})
    assert newer.status_code == 200 and newer.headers["X-Fleet-Stale"] == "0"
    assert position(client, a) == (52.1, 13.1, "2026-12-01T08:00:10Z")

    late = {"position": {"lat": 50.0, "lng": 10.0, "ts": T0}, "status": "offline"}
    answer = client.patch(url, json=late)
    assert answer.status_code == 200 and answer.headers["X-Fleet-Stale"] == "1"
    stored = client.get(url).json()
    assert answer.json() == stored
    assert stored["status"] != "offline"
    assert position(client, a) == (52.1, 13.1, "2026-12-01T08:00:10Z")

    same = client.patch(url, json={"position": {"lat": 52.2, "lng": 13.2, "ts": T1}})
    assert same.headers["X-Fleet-Stale"] == "0"  # the same time applies
    untimed = client.patch(url, json={"position": {"lat": 52.3, "lng": 13.3}})
    assert untimed.headers["X-Fleet-Stale"] == "0"  # a position without a time applies
    assert position(client, a) == (52.3, 13.3, None)


def test_a_moved_driver_is_recommended_at_its_new_place(client: TestClient) -> None:
    ids = load(client, 50)
    far = {"lat": -33.9, "lng": 18.4}  # no demo driver near
    rows = [move(ids[7], far["lat"], far["lng"], T1, status="available")]
    assert client.patch("/v1/fleet/positions", json={"positions": rows}).status_code == 200
    order = {"order_id": "o1", "pickup": far, "radius_km": 1.0, "k": 5}
    answer = client.post("/v1/dispatch/recommend", json=order).json()
    assert [c["driver_id"] for c in answer["candidates"]] == [ids[7]]


def test_bad_rows_are_a_422_naming_the_field_and_change_nothing(client: TestClient) -> None:
    a = load(client)[0]
    before = position(client, a)
    cases = [
        ([move(a, 52.0, 13.0, T1), move(a, 91.0, 13.0, T1)], "positions[1].lat"),
        ([move(a, 52.0, 13.0, "yesterday")], "positions[0].ts"),
        ([{"driver_id": a, "lat": 52.0, "lng": 13.0}], "positions[0].ts"),
        ([move(a, 52.0, 13.0, T1, status="asleep")], "positions[0].status"),
        ([move("D\u0000x", 52.0, 13.0, T1)], "positions[0].driver_id"),
    ]
    for rows, param in cases:
        answer = client.patch("/v1/fleet/positions", json={"positions": rows})
        assert answer.status_code == 422, (rows, answer.text)
        assert answer.json()["error"]["param"] == param
    empty = client.patch("/v1/fleet/positions", json={"positions": []})
    assert empty.status_code == 422
    assert position(client, a) == before


def test_more_rows_than_the_limit_is_a_413(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, max_records_per_request=3)
    with open_client(settings) as client:
        wait_ready(client)
        rows = [move(f"D{i:06d}", 1.0, 1.0, T1) for i in range(4)]
        answer = client.patch("/v1/fleet/positions", json={"positions": rows})
        assert answer.status_code == 413
        assert answer.json()["error"]["param"] == "positions"


def test_applied_batches_survive_a_restart(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    with open_client(settings) as client:
        wait_ready(client)
        a, b = load(client)[:2]
        rows = [move(a, 40.1, -3.1, T2), move(b, 40.2, -3.2, T1)]
        assert client.patch("/v1/fleet/positions", json={"positions": rows}).status_code == 200
    with open_client(settings) as client:  # the snapshot taken on the way out holds them
        wait_ready(client)
        assert position(client, a) == (40.1, -3.1, "2026-12-01T08:00:20Z")
        stale = [move(a, 0.0, 0.0, T1)]  # the stored time came back too
        answer = client.patch("/v1/fleet/positions", json={"positions": stale})
        assert answer.json() == {"updated": 0, "stale": 1, "unknown": []}
