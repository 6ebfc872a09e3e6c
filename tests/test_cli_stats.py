"""``fleetcache stats [--watch --interval S --count N]`` against a live server."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from engines.fake import FakeEngine
from engines.fallback import Condition, FallbackEngine
from proxy.app import create_app
from proxy.cli import app as cli
from proxy.settings import Settings
from tests.conftest import LiveServer, make_settings, wait_ready


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    with LiveServer(create_app(settings, engine=FakeEngine())) as live:
        with httpx.Client(base_url=live.url) as http:
            wait_ready(http)  # type: ignore[arg-type]  (the same .get() as a TestClient)
        yield live


def misses_per_frame(output: str) -> list[int]:
    return [int(m) for m in re.findall(r"│ misses\s+│ (\d+)", output)]


def test_stats_prints_the_tables_once(server: LiveServer) -> None:
    httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a", "b"]})
    result = CliRunner().invoke(cli, ["stats", "--url", server.url], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert misses_per_frame(result.output) == [2]
    assert "hit_ratio" in result.output and "p99 ms" in result.output
    assert "healthy (serving primary)" in result.output
    assert "drift" not in result.output  # no check yet


def test_stats_show_a_degraded_engine_and_the_last_drift_check(tmp_path: Path) -> None:
    engine = FallbackEngine(FakeEngine())
    settings = make_settings(tmp_path, admin_token="cli-admin", drift_interval_s=0)
    with LiveServer(create_app(settings, engine=engine)) as live:
        with httpx.Client(base_url=live.url) as http:
            wait_ready(http)  # type: ignore[arg-type]
            for _ in range(2):
                http.post("/v1/embeddings", json={"input": ["a", "b"]})
            admin = {"Authorization": "Bearer cli-admin"}
            assert http.post("/v1/cache/drift", headers=admin).json()["sampled"] == 2
        engine.observe(Condition(slow="GPU 0 temperature 90 C >= 83 C"))
        result = CliRunner().invoke(cli, ["stats", "--url", live.url], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "degraded: GPU 0 temperature 90 C >= 83 C (serving primary)" in result.output
    assert "min cosine 1.000000, 0 of 2 below 0.999" in result.output


def test_stats_watch_redraws_with_fresh_numbers_until_count(server: LiveServer) -> None:
    stop = threading.Event()

    def traffic() -> None:  # new texts all along: every refresh sees more misses
        with httpx.Client(base_url=server.url) as http:
            i = 0
            while not stop.is_set():
                http.post("/v1/embeddings", json={"input": f"text {i}"})
                i += 1
                stop.wait(0.01)

    httpx.post(f"{server.url}/v1/embeddings", json={"input": "first"})
    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        args = ["stats", "--url", server.url, "--watch", "--interval", "0.3", "--count", "3"]
        result = CliRunner().invoke(cli, args, env={"COLUMNS": "200"})
    finally:
        stop.set()
        thread.join()
    assert result.exit_code == 0, result.output
    misses = misses_per_frame(result.output)
    assert len(misses) == 3  # three refreshes, then it stopped by itself
    assert misses == sorted(misses) and misses[-1] > misses[0] >= 1
    assert result.output.count("Ctrl-C to stop") == 3


def test_stats_watch_keeps_going_while_the_proxy_is_unreachable() -> None:
    url = "http://127.0.0.1:9"  # discard port: nothing answers
    args = ["stats", "--url", url, "--watch", "--interval", "0.1", "--count", "2"]
    result = CliRunner().invoke(cli, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert result.output.count(f"cannot read {url}/v1/stats") == 2
    once = CliRunner().invoke(cli, ["stats", "--url", url])
    assert once.exit_code == 1  # without --watch a failed read is an error
