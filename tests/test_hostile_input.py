"""Hostile bodies end at the edge (API.md v1.1, "Limits and hostile input"; issue 12).

A string that is not valid Unicode (a lone surrogate, the JSON escape ``\\ud800``) in any field
of any endpoint is a 422 naming the field: it is never looked up, never reaches the engine and
never touches engine health. Bodies that are not JSON at all are one kind of error: 400
``invalid_json``, whatever the reason (syntax, invalid UTF-8, nesting too deep).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from cache.embedder import CachedEmbedder, InvalidTextError
from cache.stores import MemoryByteStore
from engines.fake import FakeEngine
from features.models import DriverRecord
from features.synthetic import generate_fleet
from proxy.body import invalid_string_path, parse_json
from tests.conftest import make_settings, open_client, wait_ready

BAD = "x\ud800"


def driver(**changes: Any) -> dict[str, Any]:
    record = generate_fleet(1, seed=3)[0].model_dump(mode="json")
    for dotted, value in changes.items():
        target = record
        *parents, last = dotted.split(".")
        for part in parents:
            target = target[part]
        target[last] = value
    return record


# (method, path, body, the param the 422 must name)
CASES = [
    ("POST", "/v1/embeddings", {"input": [BAD]}, "input[0]"),
    ("POST", "/v1/embeddings", {"input": ["ok", "fine", BAD]}, "input[2]"),
    ("POST", "/v1/embeddings", {"input": BAD}, "input"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "model": BAD}, "model"),
    ("POST", "/v1/features/embed", {"drivers": [driver(driver_id=BAD)]}, "drivers[0].driver_id"),
    (
        "POST",
        "/v1/features/embed",
        {"vehicles": [driver()["vehicle"] | {"vehicle_id": BAD}]},
        "vehicles[0].vehicle_id",
    ),
    (
        "POST",
        "/v1/features/embed",
        {"drivers": [driver(**{"profile.home_zone": BAD})]},
        "drivers[0].profile.home_zone",
    ),
    (
        "PUT",
        "/v1/fleet/drivers",
        {"drivers": [driver(), driver(**{"profile.certifications": ["hazmat", BAD]})]},
        "drivers[1].profile.certifications[1]",
    ),
    ("PATCH", "/v1/fleet/drivers/D000000", {"status": BAD}, "status"),
    (
        "POST",
        "/v1/dispatch/recommend",
        {"order_id": "O1", "pickup": {"lat": 31.2, "lng": 121.4}, "requirements": BAD},
        "requirements",
    ),
    (
        "POST",
        "/v1/dispatch/recommend",
        {"order_id": "O1", "pickup": {"lat": 31.2, "lng": 121.4}, "constraints": [BAD]},
        "constraints[0]",
    ),
    ("POST", "/v1/coverage", {"driver_ids": ["D1", BAD]}, "driver_ids[1]"),
    ("POST", "/v1/warmup", {"path": BAD}, "path"),
    ("POST", "/v1/embeddings", {"input": ["ok"], "extra": {BAD: 1}}, "extra"),
]


def send(client: TestClient, method: str, path: str, body: Any) -> Any:
    raw = json.dumps(body)  # ensure_ascii: the surrogate travels as the escape \ud800
    return client.request(method, path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize(("method", "path", "body", "param"), CASES)
def test_lone_surrogate_is_a_422_naming_the_field(
    client: TestClient,
    fake_engine: FakeEngine,
    method: str,
    path: str,
    body: Any,
    param: str,
) -> None:
    before = client.get("/v1/stats").json()
    items = fake_engine.items
    response = send(client, method, path, body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert fake_engine.items == items  # nothing reached the engine
    assert client.get("/readyz").status_code == 200  # engine health untouched
    after = client.get("/v1/stats")
    assert after.status_code == 200  # and nothing left behind that breaks the stats
    for key in ("hits", "misses", "coalesced"):
        assert after.json()["cache"][key] == before["cache"][key]


def test_a_bad_text_among_new_texts_fails_nobody_else(
    client: TestClient, fake_engine: FakeEngine
) -> None:
    """Defect 1 of issue 12: one such request used to fail the batch of every client."""
    items = fake_engine.items
    for i in range(20):
        assert send(client, "POST", "/v1/embeddings", {"input": [f"{BAD} {i}"]}).status_code == 422
        good = client.post("/v1/embeddings", json={"input": [f"a new text {i}"]})
        assert good.status_code == 200, good.text
    stats = client.get("/v1/stats").json()
    assert stats["inference"]["failed_batches"] == 0
    assert stats["inference"]["items"] == 20 == fake_engine.items - items


def test_coverage_with_a_bad_id_leaves_stats_serving(client: TestClient) -> None:
    """Defect 3 of issue 12: a 500 that made every later /v1/stats (and dashboard) a 500."""
    assert send(client, "POST", "/v1/coverage", {"driver_ids": [f"D{BAD}"]}).status_code == 422
    assert client.get("/v1/stats").status_code == 200
    assert client.post("/v1/coverage", json={"driver_ids": ["D1"]}).status_code == 200
    stats = client.get("/v1/stats")
    assert stats.status_code == 200
    assert stats.json()["coverage"]["roster"] == 1


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        (b'{"input": ["a"', "syntax"),
        (b'{"input": ["\xff\xfe"]}', "invalid UTF-8"),
        (b"[" * 5000 + b"]" * 5000, "nesting"),
        (b'{"input": ["a"]} trailing', "trailing data"),
    ],
)
def test_every_malformed_body_is_one_kind_of_error(
    client: TestClient, raw: bytes, what: str
) -> None:
    """Defect 9 of issue 12: invalid UTF-8 and deep JSON used to answer 400 http_error."""
    response = client.post(
        "/v1/embeddings", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, (what, response.text)
    assert response.json()["error"]["type"] == "invalid_json", what


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_sent_under_another_media_type_is_a_415_saying_which(
    client: TestClient, fake_engine: FakeEngine, content_type: str
) -> None:
    """``curl -d`` without ``-H 'Content-Type: application/json'`` sends a form: the answer
    says what to send instead of "Input should be a valid dictionary" with no field."""
    items = fake_engine.items
    response = client.post(
        "/v1/embeddings", content=b'{"input": ["a"]}', headers={"content-type": content_type}
    )
    assert response.status_code == 415, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "Content-Type: application/json" in error["message"]
    assert content_type in error["message"]
    assert fake_engine.items == items
    # nor is a body without any Content-Type read as JSON (FastAPI's strict content type: a
    # browser's form cannot pass for a JSON call)
    bare = client.post("/v1/embeddings", content=b'{"input": ["a"]}')
    assert bare.status_code == 415, bare.text
    assert "no Content-Type was sent" in bare.json()["error"]["message"]


@pytest.mark.parametrize("content_type", ["text/csv", "application/octet-stream", None])
def test_a_warmup_body_neither_json_nor_jsonl_is_a_415_naming_both(
    client: TestClient, content_type: str | None
) -> None:
    """A CSV or Parquet body was read as JSON: 400 invalid_json with the decoder's words."""
    headers = {} if content_type is None else {"content-type": content_type}
    response = client.post(
        "/v1/warmup", content=b"driver_id,status\nD1,available\n", headers=headers
    )
    assert response.status_code == 415, response.text
    message = response.json()["error"]["message"]
    assert "application/json" in message and "application/x-ndjson" in message
    assert client.get("/v1/warmup").json()["jobs"] == []  # no job started


def test_a_json_body_that_is_not_an_object_names_the_body(client: TestClient) -> None:
    response = client.post("/v1/embeddings", json=["a"])
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "body"


def test_valid_non_ascii_text_is_served(client: TestClient) -> None:
    """Only invalid strings are refused: emoji (a surrogate pair escaped) and CJK pass."""
    body = json.dumps({"input": ["冷藏车 \ud83d\ude9a", "électrique"]})
    response = client.post(
        "/v1/embeddings", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["data"]) == 2


def test_parse_json_matches_the_standard_parser_on_what_it_accepts() -> None:
    assert parse_json(b'{"a": [1, 2.5, "x", null, true]}') == {"a": [1, 2.5, "x", None, True]}
    assert parse_json(b'{"n": NaN}')["n"] != parse_json(b'{"n": NaN}')["n"]  # NaN, for models
    assert parse_json(b"1" + b"0" * 400) == 10**400  # orjson refuses it; the models bound it
    assert invalid_string_path({"a": [{"b": "ok"}, {"c": BAD}]}) == "a[1].c"
    assert invalid_string_path({"a": "ok"}) is None


def test_the_cache_refuses_invalid_text_before_any_lookup() -> None:
    """Every way in (warm-up files, library callers), not only HTTP: nothing is computed."""
    engine = FakeEngine(dim=8)
    computed: list[str] = []

    async def compute(texts: Any, lane: str) -> Any:
        computed.extend(texts)
        return np.stack([engine.vector(t) for t in texts])

    cache = CachedEmbedder(compute, MemoryByteStore(2**20), namespace="t", dim=8)
    with pytest.raises(InvalidTextError) as info:
        asyncio.run(cache.aembed(["fine", BAD]))
    assert info.value.index == 1
    assert computed == []
    assert cache.stats()["misses"] == 0


# -- limits (API.md v1.1, "Limits and hostile input") ---------------------------------------


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"driver_id": "D\x001"}, "drivers[0].driver_id"),
        ({"vehicle.vehicle_id": "V\x00"}, "drivers[0].vehicle.vehicle_id"),
        ({"vehicle.capacity_kg": 1e308}, "drivers[0].vehicle.capacity_kg"),
        ({"vehicle.cargo_height_m": 300}, "drivers[0].vehicle.cargo_height_m"),
        ({"profile.completed_orders": 10**400}, "drivers[0].profile.completed_orders"),
        ({"profile.certifications": ["x"] * 65}, "drivers[0].profile.certifications"),
    ],
)
def test_values_no_real_record_has_are_refused(
    client: TestClient, fake_engine: FakeEngine, change: dict[str, Any], param: str
) -> None:
    """Defect 8 of issue 12: a NUL in an id, a 308-digit capacity, 10**400 orders."""
    items = fake_engine.items
    record = driver(**{k: v for k, v in change.items() if k != "driver_id"})
    if "driver_id" in change:
        record["driver_id"] = change["driver_id"]
    response = send(client, "PUT", "/v1/fleet/drivers", {"drivers": [record]})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == param
    assert fake_engine.items == items
    assert client.get("/v1/stats").json()["fleet"]["drivers"] == 0


def test_coverage_holds_its_ids_to_the_rule_of_every_other_id(client: TestClient) -> None:
    """A NUL in an id is a 422 everywhere else; coverage echoed it back in ``not_covered``."""
    response = send(client, "POST", "/v1/coverage", {"driver_ids": ["D1", "a\x00b"]})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "driver_ids[1]"


@pytest.mark.parametrize("explain", ["yes", 1, "true"])
def test_recommend_flags_take_booleans_only(client: TestClient, explain: Any) -> None:
    order = {"order_id": "O1", "pickup": {"lat": 31.2, "lng": 121.4}, "explain": explain}
    response = client.post("/v1/dispatch/recommend", json=order)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "explain"


# UTC instants a datetime cannot hold, though their local dates are in its range
OUT_OF_RANGE = ["9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00"]


@pytest.mark.parametrize("ts", OUT_OF_RANGE)
def test_a_time_outside_the_utc_years_is_a_422_and_the_index_still_starts(
    tmp_path: Path, ts: str
) -> None:
    """Such a time was accepted by every fleet write (a PATCH answered 500 with the driver
    half-moved); the snapshot then held it, and the fleet index refused to load: no fleet
    and no dispatch after the next restart. Now each write path names the field."""
    settings = make_settings(tmp_path / "data")
    record = driver(driver_id="D1")
    with open_client(settings) as client:
        wait_ready(client)
        assert client.put("/v1/fleet/drivers", json={"drivers": [record]}).status_code == 200
        writes = [
            ("PUT", "/v1/fleet/drivers", {"drivers": [driver(**{"position.ts": ts})]}),
            ("PATCH", "/v1/fleet/drivers/D1", {"position": {"lat": 1, "lng": 2, "ts": ts}}),
            (
                "PATCH",
                "/v1/fleet/positions",
                {"positions": [{"driver_id": "D1", "lat": 1, "lng": 2, "ts": ts}]},
            ),
            (
                "POST",
                "/v1/dispatch/recommend",
                {"order_id": "O1", "pickup": {"lat": 1, "lng": 2}, "pickup_time": ts},
            ),
        ]
        params = ["drivers[0].position.ts", "position.ts", "positions[0].ts", "pickup_time"]
        for (method, path, body), param in zip(writes, params, strict=True):
            answer = client.request(method, path, json=body)
            assert answer.status_code == 422, (path, answer.text)
            assert answer.json()["error"]["param"] == param
        assert client.get("/v1/fleet/drivers/D1").json() == record  # untouched
    with open_client(settings) as again:  # from the snapshot the first one saved
        wait_ready(again)
        assert again.get("/v1/fleet/drivers/D1").json() == record


def test_an_id_with_a_c1_control_character_is_a_422() -> None:
    """U+009B is a terminal's CSI: ids carry no control characters, C1 ones included."""
    for bad in ("x\u0085y", "x\u009b31m"):
        with pytest.raises(ValueError, match="driver_id"):
            DriverRecord.model_validate(driver(driver_id=bad))


def test_a_text_over_the_character_limit_is_a_413_naming_it(tmp_path: Path) -> None:
    with open_client(make_settings(tmp_path / "data", max_text_chars=100)) as client:
        wait_ready(client)
        response = client.post("/v1/embeddings", json={"input": ["short", "x" * 101]})
        assert response.status_code == 413
        assert response.json()["error"]["param"] == "input[1]"
        assert client.get("/v1/stats").json()["cache"]["misses"] == 0


def test_a_body_over_the_limit_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Defect 5 of issue 12 (a 50 MB string stalled the loop for 5.5 s): 413 from the length
    header alone, and for a body without one as soon as its bytes pass the limit."""
    settings = make_settings(tmp_path / "data", max_body_mb=0.01, max_upload_mb=0.02)
    with open_client(settings) as client:
        wait_ready(client)
        big = json.dumps({"input": ["x" * 20_000]})
        declared = client.post(
            "/v1/embeddings", content=big, headers={"content-type": "application/json"}
        )
        assert declared.status_code == 413
        assert "FLEETCACHE_MAX_BODY_MB" in declared.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no Content-Length: sent chunked
            yield big.encode()

        streamed = client.post(
            "/v1/embeddings", content=chunks(), headers={"content-type": "application/json"}
        )
        assert streamed.status_code == 413
        upload = client.post(
            "/v1/warmup",
            content=iter([b'{"driver_id": "D1"}\n' * 2000]),
            headers={"content-type": "application/x-ndjson"},
        )
        assert upload.status_code == 413
        assert "FLEETCACHE_MAX_UPLOAD_MB" in upload.json()["error"]["message"]
        assert not list((settings.data_dir / "warmup").glob("upload-*"))  # nothing left behind
        # a warm-up started by a JSON body is no upload: the body's own limit holds
        named = client.post("/v1/warmup", json={"path": "fleet.jsonl", "pad": "y" * 15_000})
        assert named.status_code == 413, named.text
        assert "FLEETCACHE_MAX_BODY_MB" in named.json()["error"]["message"]
        assert client.get("/v1/stats").status_code == 200


def test_more_new_texts_than_the_queue_holds_is_a_413_not_a_429(tmp_path: Path) -> None:
    """Defect 4 of issue 12: such a request used to get 429 + Retry-After forever."""
    settings = make_settings(tmp_path / "data", max_queue=32, max_texts_per_request=32)
    with open_client(settings) as client:
        wait_ready(client)
        texts = [f"t{i}" for i in range(33)]
        response = client.post(
            "/v1/features/embed",
            json={
                "vehicles": [
                    {**driver()["vehicle"], "vehicle_id": f"V{i}", "capacity_kg": 100 * i + 10}
                    for i in range(33)
                ]
            },
        )
        assert response.status_code == 413, response.status_code  # 33 distinct new texts
        assert "Retry-After" not in response.headers
        assert response.json()["error"]["param"] == "vehicles"  # the field holding them
        drivers = [driver(driver_id=f"D{i}", **{"profile.home_zone": f"z{i}"}) for i in range(33)]
        put = client.put("/v1/fleet/drivers", json={"drivers": drivers})
        assert (put.status_code, put.json()["error"]["param"]) == (413, "drivers")
        assert client.get("/v1/stats").json()["fleet"]["drivers"] == 0  # none indexed
        assert client.post("/v1/embeddings", json={"input": texts[:32]}).status_code == 200


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"max_queue": 32}, "FLEETCACHE_MAX_TEXTS_PER_REQUEST"),
        ({"max_queue": 100, "max_texts_per_request": 50, "demo_drivers": 10}, "DEMO"),
        ({"store": "memory", "memory_cache_mb": 0}, "FLEETCACHE_MEMORY_CACHE_MB=0"),
    ],
)
def test_settings_under_which_requests_could_never_be_queued_are_refused(
    tmp_path: Path, overrides: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        make_settings(tmp_path / "data", **overrides)


def test_a_warmup_naming_a_file_of_unknown_format_is_a_422(
    client: TestClient, settings: Any
) -> None:
    """Defect 7 of issue 12: such a job reported `running`, rows 0, forever."""
    (settings.data_dir / "fleet.xml").write_text("<drivers/>")
    response = client.post("/v1/warmup", json={"path": "fleet.xml"})
    assert response.status_code == 422
    assert response.json()["error"]["param"] == "path"
    outside = client.post("/v1/warmup", json={"path": "../../etc/passwd"})
    assert outside.status_code == 422
    assert str(settings.data_dir.resolve()) not in outside.text  # no server paths in answers
