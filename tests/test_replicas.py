"""Replicas of ``fleetcache serve`` on one Redis: what one embeds is a hit on the other, and
with ``FLEETCACHE_FLEET_LOG_URL`` they share the fleet (API.md v1.1 "Durability",
``proxy.fleet_log``): a change through one is in every other's answers, a Redis restart loses
nothing, a new replica with an empty data dir starts with the whole fleet."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis import Redis

from features.synthetic import generate_fleet
from proxy.fleet_log import STREAM
from tests.conftest import free_port
from tests.redis_server import RedisServer, start_or_skip
from tests.serve_process import FleetcacheServer

pytestmark = pytest.mark.redis
REPO = Path(__file__).resolve().parents[1]


def serve(redis_url: str, data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "FLEETCACHE_ENGINE": "fake",
        "FLEETCACHE_STORE": "redis",
        "FLEETCACHE_REDIS_URL": redis_url,
        "FLEETCACHE_DATA_DIR": str(data_dir),
        "PYTHONPATH": str(REPO),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--log-level", "warning"],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, f"http://127.0.0.1:{port}"


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready")


def test_a_text_embedded_through_one_replica_is_a_hit_on_the_other(tmp_path: Path) -> None:
    redis: RedisServer = start_or_skip(tmp_path / "redis")
    url = f"redis://127.0.0.1:{redis.port}/0"
    replicas = [serve(url, tmp_path / f"replica{i}") for i in (1, 2)]
    try:
        for _, base in replicas:
            wait_ready(base)
        (_, one), (_, two) = replicas
        texts = ["shared across replicas", "refrigerated truck, tail lift"]
        first = httpx.post(f"{one}/v1/embeddings", json={"input": texts})
        second = httpx.post(f"{two}/v1/embeddings", json={"input": texts})
        assert first.headers["X-Cache-Misses"] == "2"
        assert second.headers["X-Cache-Hits"] == "2" and second.headers["X-Cache-Misses"] == "0"
        assert first.json()["data"] == second.json()["data"]
        stats = httpx.get(f"{two}/v1/stats").json()
        assert stats["inference"]["items"] == 0
        assert stats["cache"]["tiers"]["store"]["kind"] == "redis"
        assert stats["cache"]["tiers"]["store"]["hits"] == 2
    finally:
        for process, _ in replicas:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
        redis.stop()


def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> float:
    """Seconds until ``check()`` holds (AssertionError after ``timeout_s``)."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, "not within the time allowed"
        time.sleep(0.01)
    return time.monotonic() - started


def record(url: str, driver_id: str) -> Any:
    answer = httpx.get(f"{url}/v1/fleet/drivers/{driver_id}", timeout=5)
    return answer.json() if answer.status_code == 200 else answer.status_code


def near(url: str, place: dict[str, float]) -> list[str]:
    order = {"order_id": "o", "pickup": place, "radius_km": 2.0, "k": 10}
    answer = httpx.post(f"{url}/v1/dispatch/recommend", json=order, timeout=5)
    assert answer.status_code == 200, answer.text
    return sorted(c["driver_id"] for c in answer.json()["candidates"])


@pytest.mark.timeout(300)
def test_replicas_on_one_fleet_log_share_the_fleet(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis", durable=True).start()
    replicas: list[FleetcacheServer] = []

    def replica(name: str) -> FleetcacheServer:
        server = FleetcacheServer(tmp_path / name, workers=1, fleet_log_url=redis.url)
        replicas.append(server.start())
        return server

    try:
        one, two = replica("one"), replica("two")
        fleet = [d.model_dump(mode="json") for d in generate_fleet(40, seed=3)]
        put = httpx.put(f"{one.url}/v1/fleet/drivers", json={"drivers": fleet}, timeout=30)
        assert put.status_code == 200, put.text
        assert eventually(lambda: record(two.url, fleet[-1]["driver_id"]) != 404) < 1.0
        assert record(two.url, fleet[0]["driver_id"]) == record(one.url, fleet[0]["driver_id"])

        # positions through two, recommended through one; a delete through one, gone on two
        ocean = {"lat": -47.5, "lng": -120.25}
        ids = [fleet[i]["driver_id"] for i in (1, 2)]
        rows = [
            {**ocean, "driver_id": i, "ts": "2026-12-01T08:00:00Z", "status": "available"}
            for i in ids
        ]
        moved = httpx.patch(f"{two.url}/v1/fleet/positions", json={"positions": rows})
        assert moved.json() == {"updated": 2, "stale": 0, "unknown": []}
        assert eventually(lambda: near(one.url, ocean) == sorted(ids)) < 1.0
        stale = [{**rows[0], "lat": 10.0, "ts": "2026-12-01T07:59:00Z"}]
        answer = httpx.patch(f"{one.url}/v1/fleet/positions", json={"positions": stale})
        assert answer.json() == {"updated": 0, "stale": 1, "unknown": []}
        gone = fleet[3]["driver_id"]
        assert httpx.delete(f"{one.url}/v1/fleet/drivers/{gone}").status_code == 200
        assert eventually(lambda: record(two.url, gone) == 404) < 1.0

        # the log's Redis killed: fleet writes answer 503 + Retry-After, reads go on
        redis.stop()
        patch = {"status": "busy"}
        refused = httpx.patch(f"{one.url}/v1/fleet/drivers/{ids[0]}", json=patch, timeout=30)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "fleet_log_unavailable"
        assert refused.headers["Retry-After"]
        assert near(two.url, ocean) == sorted(ids)
        # ... and back from its append-only file: nothing lost, changes flow again
        redis.start()

        def patched() -> bool:
            url = f"{one.url}/v1/fleet/drivers/{ids[0]}"
            return httpx.patch(url, json=patch, timeout=30).status_code == 200

        eventually(patched, timeout_s=15)
        assert eventually(lambda: near(two.url, ocean) == [ids[1]], timeout_s=5) < 5

        # a new replica on an empty data dir starts from the log: the same fleet
        three = replica("three")
        for driver in fleet:
            assert record(three.url, driver["driver_id"]) == record(one.url, driver["driver_id"])
        seqs = {r.stats()["fleet"]["seq"] for r in replicas}
        assert len(seqs) == 1 and seqs.pop() > 0
    finally:
        for server in replicas:
            server.stop()
        redis.stop()


@pytest.mark.timeout(300)
def test_a_new_replica_starts_from_the_published_snapshot_once_the_log_is_trimmed(
    tmp_path: Path,
) -> None:
    redis_server = RedisServer(tmp_path / "redis", durable=True).start()
    redis = Redis.from_url(redis_server.url)
    often = {"snapshot_interval_s": 0.3, "fleet_snapshot_publish_s": 0.5}
    one = FleetcacheServer(tmp_path / "one", workers=1, fleet_log_url=redis_server.url, **often)
    two = FleetcacheServer(tmp_path / "two", workers=1, fleet_log_url=redis_server.url)
    try:
        one.start()
        fleet = [d.model_dump(mode="json") for d in generate_fleet(30, seed=4)]
        for start in range(0, 30, 10):  # three changes, published and trimmed as they come
            body = {"drivers": fleet[start : start + 10]}
            assert httpx.put(f"{one.url}/v1/fleet/drivers", json=body).status_code == 200
            time.sleep(1.0)

        def trimmed() -> bool:
            first = redis.xinfo_stream(STREAM).get("first-entry")
            return redis.exists(f"{STREAM}:snapshot") == 1 and (first is None or first[0] != b"1-0")

        eventually(trimmed, timeout_s=20)
        two.start()  # change 1 is gone from the stream: only the snapshot has it
        assert two.stats()["fleet"]["log_following"] is True
        for driver in fleet:
            assert record(two.url, driver["driver_id"]) == record(one.url, driver["driver_id"])
        # and it follows the stream from there: a change through it reaches the other
        row = {
            "driver_id": fleet[0]["driver_id"],
            "lat": 1.5,
            "lng": 2.5,
            "ts": "2027-01-01T00:00:00Z",
        }
        answer = httpx.patch(f"{two.url}/v1/fleet/positions", json={"positions": [row]})
        assert answer.json()["updated"] == 1
        eventually(lambda: record(one.url, row["driver_id"])["position"]["lat"] == 1.5)
        assert one.stats()["fleet"]["seq"] == two.stats()["fleet"]["seq"]
    finally:
        one.stop()
        two.stop()
        redis.close()
        redis_server.stop()
