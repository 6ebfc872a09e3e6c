"""Two ``fleetcache serve`` processes on one Redis: what one embeds is a hit on the other."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port
from tests.redis_server import RedisServer, start_or_skip

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
