"""Faults under load, against a real ``fleetcache serve`` tree (the issue's fault list):

- Redis SIGKILLed and restarted while clients send repeats and new texts: no request fails;
- one batch raising on what it holds: only the request that held it fails, the engine stays
  healthy and every other client is served;
- the LMDB map full: still serving, the store shown degraded with the reason;
- a data dir that cannot be written: ``fleetcache serve`` stops at once with a clear message
  (no traceback, no processes restarting forever).

- ``fleetcache warmup --url`` while the server tree is killed with -9 and restarted: no row
  lost. (kill -9 of a direct warm-up: test_warmup.py; of every acknowledged fleet change:
  test_fleet_durability.py.)
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from features.readers import write_records
from features.synthetic import generate_fleet
from tests.redis_server import RedisServer
from tests.serve_process import FleetcacheServer, crash


class Load:
    """``clients`` threads, each its own connection, sending until stopped: a repeat of a
    known text, then a new one, in turn. Every answer's status is counted; a failure's body
    is kept."""

    def __init__(self, url: str, clients: int = 4, texts: list[str] | None = None) -> None:
        self.url = url
        self.clients = clients
        self.statuses: Counter[int] = Counter()
        self.failures: list[str] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)
        ]

    def _client(self, n: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            i = 0
            while not self.stop.is_set():
                text = f"client {n} repeat {i % 20}" if i % 2 else f"client {n} new {i}"
                response = http.post("/v1/embeddings", json={"input": [text, f"shared {i % 5}"]})
                with self._lock:
                    self.statuses[response.status_code] += 1
                    if response.status_code != 200:
                        self.failures.append(f"{response.status_code} {response.text[:200]}")
                i += 1

    @contextmanager
    def running(self) -> Iterator[Load]:
        for thread in self._threads:
            thread.start()
        try:
            yield self
        finally:
            self.stop.set()
            for thread in self._threads:
                thread.join(timeout=60)

    def wait_for(self, requests: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        start = self.total()
        while self.total() < start + requests:
            assert time.monotonic() < deadline, f"load stalled at {self.total()} requests"
            time.sleep(0.05)

    def total(self) -> int:
        with self._lock:
            return sum(self.statuses.values())


def test_redis_killed_and_restarted_under_load_fails_no_request(tmp_path: Path) -> None:
    redis = RedisServer(tmp_path / "redis").start()
    server = FleetcacheServer(
        tmp_path / "served", workers=2, store="redis", redis_url=redis.url
    ).start()
    try:
        with Load(server.url).running() as load:
            load.wait_for(200)
            redis.stop()  # SIGKILL
            load.wait_for(200)
            degraded = server.stats()["cache"]["tiers"]["store"]
            redis.start()  # the same port, empty
            load.wait_for(200)
            deadline = time.monotonic() + 30
            while server.stats()["cache"]["tiers"]["store"]["degraded"]:
                assert time.monotonic() < deadline, "the store never recovered"
                load.wait_for(20)
        assert degraded["degraded"] is True and degraded["errors"] >= 1
        assert load.failures == [] and load.total() >= 600
    finally:
        assert server.stop() == 0
        redis.stop()


def test_a_batch_failing_on_what_it_holds_fails_only_its_request(tmp_path: Path) -> None:
    server = FleetcacheServer(tmp_path, workers=2, fake_fail_on="POISON").start()
    try:
        with Load(server.url).running() as load, httpx.Client(base_url=server.url) as http:
            poisoned = []
            for i in range(10):
                load.wait_for(30)
                response = http.post("/v1/embeddings", json={"input": [f"POISON {i}"]})
                poisoned.append((response.status_code, response.json()["error"]["type"]))
                assert http.get("/readyz").status_code == 200  # the engine was never tripped
            load.wait_for(30)
        assert poisoned == [(503, "engine_error")] * 10
        assert load.failures == []
        stats = server.stats()
        assert stats["ready"] is True
        assert stats["inference"]["failed_batches"] >= 10
        assert stats["cache"]["misses"] == stats["inference"]["items"]
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_full_lmdb_map_keeps_serving(tmp_path: Path, writer: str) -> None:
    """2 MB of map fills within seconds: the engine process's write-backs fail (in its own
    thread, or in its writer child), requests do not, and /v1/stats says so with the reason."""
    server = FleetcacheServer(
        tmp_path, workers=2, lmdb_map_size_gb=0.002, lmdb_writer=writer
    ).start()
    try:
        with Load(server.url).running() as load:
            deadline = time.monotonic() + 60
            while not server.stats()["cache"]["tiers"]["store"]["errors"]:
                assert time.monotonic() < deadline, "the map never filled"
                load.wait_for(50)
            load.wait_for(300)
            store = server.stats()["cache"]["tiers"]["store"]
        assert load.failures == []
        assert "MDB_MAP_FULL" in store["last_error"]
        assert server.stats()["ready"] is True
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    "data_dir",
    [
        "/sys/kernel",  # exists, nobody may write it (root neither: a read-only mount)
        "/sys/kernel/fleetcache-data",  # cannot be created
    ],
)
def test_a_data_dir_that_cannot_be_written_stops_the_start_with_a_clear_error(
    tmp_path: Path, data_dir: str
) -> None:
    server = FleetcacheServer(tmp_path)
    server.env["FLEETCACHE_DATA_DIR"] = data_dir
    result = subprocess.run(  # a server that tried to start would outlive the timeout
        [sys.executable, "-m", "proxy.cli", "serve", "--port", str(server.port)],
        cwd=tmp_path,
        env={**server.env, "COLUMNS": "300"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert f"FLEETCACHE_DATA_DIR: {data_dir} is not writable" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.timeout(400)
def test_warmup_through_a_server_killed_with_9_loses_no_row(tmp_path: Path) -> None:
    """Issue 12's defect 2 as it was found: ``fleetcache warmup FILE --url`` while the whole
    server tree is SIGKILLed and started again on the same port and data dir. The client waits
    the restart out (connection errors are retried) and finishes; every row is in the index."""
    rows = 6_000
    fleet = tmp_path / "fleet.jsonl"
    write_records(generate_fleet(rows, seed=21), fleet)
    server = FleetcacheServer(tmp_path / "served", workers=2).start()
    command = [sys.executable, "-m", "proxy.cli", "warmup", str(fleet), "--url", server.url]
    client = subprocess.Popen(
        [*command, "--chunk-size", "200"],
        cwd=tmp_path,
        env={**server.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while (indexed := server.stats()["fleet"]["drivers"]) < 1_000:
            assert time.monotonic() < deadline and client.poll() is None, "warm-up stalled"
            time.sleep(0.05)
        assert indexed < rows, "the warm-up ended before the crash"
        assert server.process is not None
        crash(server.process.pid)
        server.process.wait(10)
        server.process = None
        time.sleep(1.0)  # the client meets a dead port for a while
        again = FleetcacheServer(tmp_path / "served", workers=2)
        again.port, again.url = server.port, server.url
        again.start()
        output, _ = client.communicate(timeout=300)
        assert client.returncode == 0, output
        assert f"{rows} rows" in output
        stats = again.stats()
        assert stats["fleet"]["drivers"] == rows
        with httpx.Client(base_url=again.url) as http:
            for n in range(0, rows, 250):
                assert http.get(f"/v1/fleet/drivers/D{n:06d}").status_code == 200
        assert again.stop() == 0
    finally:
        if client.poll() is None:
            client.kill()
