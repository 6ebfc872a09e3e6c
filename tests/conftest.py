"""Shared fixtures: settings on a temp data dir, an app on the fake engine, a live server."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from proxy.app import create_app
from proxy.settings import Settings


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build their own Settings; a developer's FLEETCACHE_* variables must not leak in."""
    for name in list(os.environ):
        if name.startswith("FLEETCACHE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def make_settings(data_dir: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "engine": "fake",
        "store": "lmdb",
        "data_dir": data_dir,
        "max_delay_ms": 1.0,
        "memory_cache_mb": 16,
        "lmdb_map_size_gb": 0.25,
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path / "data")


def wait_ready(client: TestClient, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.get("/readyz")
        if response.status_code == 200:
            return
        if "start-up failed" in response.text:
            raise AssertionError(response.text)
        time.sleep(0.02)
    raise AssertionError(f"not ready after {timeout} s: {response.text}")


def open_client(settings: Settings, engine: Any = None) -> TestClient:
    return TestClient(create_app(settings, engine=engine or FakeEngine()))


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(settings: Settings, fake_engine: FakeEngine) -> Iterator[TestClient]:
    with open_client(settings, fake_engine) as c:
        wait_ready(c)
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LiveServer:
    """A real uvicorn server on a loopback port, in a thread, for concurrency tests."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AssertionError("live server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under ``make test`` (PYTEST_ONLY_GPU_SKIPS=1) a skip is a failure unless the test is
    marked ``gpu``: a missing redis-server or browser must not pass as a green run."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if (
        report.skipped
        and os.environ.get("PYTEST_ONLY_GPU_SKIPS") == "1"
        and item.get_closest_marker("gpu") is None
        and not hasattr(report, "wasxfail")
    ):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"skipped, but only GPU tests may skip under make test: {reason}"
