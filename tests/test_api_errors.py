"""Bad input never gives a 5xx, always names the problem, and writes nothing (API.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from features.synthetic import generate_fleet
from tests.conftest import make_settings, open_client, wait_ready
from tests.test_api import assert_error

DRIVER = generate_fleet(1, seed=11)[0].model_dump(mode="json")
ORDER = {"order_id": "O1", "pickup": {"lat": 31.23, "lng": 121.47}}


def without(record: dict[str, Any], *path: str) -> dict[str, Any]:
    copy = {**record}
    node = copy
    for key in path[:-1]:
        node[key] = {**node[key]}
        node = node[key]
    del node[path[-1]]
    return copy


CASES: list[tuple[str, str, Any, int, str | None]] = [
    # method, path, json body, status, param
    ("POST", "/v1/embeddings", {"input": []}, 422, "input"),
    ("POST", "/v1/embeddings", {"input": ""}, 422, "input"),
    ("POST", "/v1/embeddings", {"input": ["ok", ""]}, 422, "input"),
    ("POST", "/v1/embeddings", {"input": ["t"] * 9}, 413, "input"),
    ("POST", "/v1/embeddings", {"input": [101, 2023, 102]}, 422, "input"),
    ("POST", "/v1/embeddings", {"input": [[101, 2023]]}, 422, "input"),
    ("POST", "/v1/embeddings", {"input": 5}, 422, "input"),
    ("POST", "/v1/embeddings", {"model": "x"}, 422, "input"),
    ("POST", "/v1/embeddings", {"input": "x", "encoding_format": "hex"}, 422, "encoding_format"),
    ("POST", "/v1/embeddings", {"input": "x", "dimensions": 17}, 422, "dimensions"),
    ("POST", "/v1/embeddings", [1, 2], 422, None),
    ("POST", "/v1/features/embed", {}, 422, "drivers"),
    (
        "POST",
        "/v1/features/embed",
        {"drivers": [without(DRIVER, "vehicle")]},
        422,
        "drivers[0].vehicle",
    ),
    (
        "POST",
        "/v1/features/embed",
        {"drivers": [DRIVER, without(DRIVER, "vehicle", "type")]},
        422,
        "drivers[1].vehicle.type",
    ),
    ("POST", "/v1/features/embed", {"drivers": [DRIVER] * 6}, 413, "drivers"),
    (
        "POST",
        "/v1/features/embed",
        {"vehicles": [{**DRIVER["vehicle"], "capacity_kg": -1}]},
        422,
        "vehicles[0].capacity_kg",
    ),
    (
        "PUT",
        "/v1/fleet/drivers",
        {"drivers": [{**DRIVER, "status": "asleep"}]},
        422,
        "drivers[0].status",
    ),
    ("PUT", "/v1/fleet/drivers", {"drivers": [DRIVER] * 6}, 413, "drivers"),
    ("PUT", "/v1/fleet/drivers", {"drivers": "D1"}, 422, "drivers"),
    ("PATCH", "/v1/fleet/drivers/nobody", {"status": "busy"}, 404, "driver_id"),
    ("PATCH", "/v1/fleet/drivers/nobody", {"status": "sleeping"}, 422, "status"),
    ("DELETE", "/v1/fleet/drivers/nobody", None, 404, "driver_id"),
    ("GET", "/v1/fleet/drivers/nobody", None, 404, "driver_id"),
    ("POST", "/v1/dispatch/recommend", {**ORDER, "constraints": ["teleport"]}, 422, "constraints"),
    (
        "POST",
        "/v1/dispatch/recommend",
        {**ORDER, "pickup": {"lat": 91, "lng": 0}},
        422,
        "pickup.lat",
    ),
    (
        "POST",
        "/v1/dispatch/recommend",
        {**ORDER, "pickup": {"lat": 0, "lng": -180.5}},
        422,
        "pickup.lng",
    ),
    ("POST", "/v1/dispatch/recommend", {**ORDER, "radius_km": 0}, 422, "radius_km"),
    ("POST", "/v1/dispatch/recommend", {**ORDER, "radius_km": 101}, 422, "radius_km"),
    ("POST", "/v1/dispatch/recommend", {**ORDER, "k": 0}, 422, "k"),
    ("POST", "/v1/dispatch/recommend", {**ORDER, "k": 201}, 422, "k"),
    ("POST", "/v1/dispatch/recommend", {"pickup": ORDER["pickup"]}, 422, "order_id"),
    ("POST", "/v1/dispatch/recommend", {"order_id": "O1"}, 422, "pickup"),
    ("GET", "/v1/nothing-here", None, 404, None),
    ("DELETE", "/v1/stats", None, 405, None),
]


@pytest.fixture(scope="module")
def strict_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = make_settings(
        Path(tmp_path_factory.mktemp("errors")) / "data",
        max_texts_per_request=8,
        max_records_per_request=5,
    )
    with open_client(settings, FakeEngine()) as client:
        wait_ready(client)
        yield client


@pytest.mark.parametrize(("method", "path", "body", "status", "param"), CASES)
def test_bad_input_is_a_named_4xx(
    strict_client: TestClient, method: str, path: str, body: Any, status: int, param: str | None
) -> None:
    response = strict_client.request(method, path, json=body)
    assert_error(response, status, param)


def test_malformed_json_is_a_400(strict_client: TestClient) -> None:
    response = strict_client.post(
        "/v1/embeddings", content=b'{"input": ["a",', headers={"Content-Type": "application/json"}
    )
    error = assert_error(response, 400)
    assert "JSON" in error["message"]


def test_unknown_constraint_lists_the_known_ones(strict_client: TestClient) -> None:
    response = strict_client.post(
        "/v1/dispatch/recommend", json={**ORDER, "constraints": ["electric_only", "teleport"]}
    )
    message = assert_error(response, 422, "constraints")["message"]
    assert "teleport" in message
    for known in ("electric_only", "refrigerated", "tail_lift", "hazmat_certified"):
        assert known in message


def test_any_caller_header_is_a_label(client: TestClient) -> None:
    """API.md sets no format for ``X-Caller``: a label such as ``Dispatch-Scheduler/2.1``
    used to get a 422 on every call; it is kept as a bounded, safe label instead."""
    for header, label in [
        ("Dispatch-Scheduler/2.1", "dispatch-scheduler_2.1"),
        ("Bad Caller!", "bad_caller"),
        ("x" * 40, "x" * 32),
        ("!!!", "other"),
        (" ", "dispatch"),
    ]:
        response = client.post("/v1/embeddings", json={"input": "x"}, headers={"X-Caller": header})
        assert response.status_code == 200, response.text
        assert label in client.get("/v1/stats").json()["by_caller"], header


def test_nothing_was_written_by_bad_requests(strict_client: TestClient) -> None:
    for method, path, body, *_ in CASES:
        strict_client.request(method, path, json=body)
    stats = strict_client.get("/v1/stats").json()
    assert stats["cache"]["hits"] == stats["cache"]["misses"] == stats["cache"]["coalesced"] == 0
    assert stats["inference"]["items"] == 0
    assert strict_client.get(f"/v1/fleet/drivers/{DRIVER['driver_id']}").status_code == 404


def test_the_openapi_schema_says_what_the_service_does(client: TestClient) -> None:
    """Defect 10 of issue 12: client generators and contract fuzzers read this schema."""
    spec = client.get("/openapi.json").json()
    text = json.dumps(spec)
    assert "HTTPValidationError" not in text and '"detail"' not in text  # FastAPI's 422 shape
    embeddings = spec["paths"]["/v1/embeddings"]["post"]
    for status in ("400", "401", "403", "413", "422", "429", "503"):
        schema = embeddings["responses"][status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorBody"}
    assert set(spec["components"]["schemas"]["ErrorDetail"]["required"]) == {
        "type",
        "message",
        "param",
    }
    body = spec["components"]["schemas"]["EmbeddingsRequest"]["properties"]["input"]
    assert {alt["type"] for alt in body["anyOf"]} == {"string", "array"}
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    warmup = spec["paths"]["/v1/warmup"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/x-ndjson"} <= set(warmup)
    upsert = spec["components"]["schemas"]["UpsertRequest"]["properties"]["drivers"]
    assert upsert["minItems"] == 1
    patch = spec["components"]["schemas"]["DriverPatch"]
    assert {tuple(alt["required"]) for alt in patch["anyOf"]} == {("position",), ("status",)}


def test_a_wrong_method_lists_every_allowed_one(client: TestClient) -> None:
    response = client.post("/v1/fleet/drivers/D1")
    assert response.status_code == 405
    assert response.headers["Allow"] == "DELETE, GET, PATCH"
    assert response.json()["error"]["type"] == "method_not_allowed"
