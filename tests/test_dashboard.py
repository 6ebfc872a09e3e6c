"""``/dashboard`` in headless Chromium against a live server with traffic: the numbers shown
equal ``/v1/stats``; the test saves a screenshot, into docs/dashboard.png (the one the README
shows) when ``UPDATE_DASHBOARD_SCREENSHOT=1``, otherwise into its temp dir.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package; skipped
cleanly without them.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from proxy.app import create_app
from proxy.auth import add_key
from tests.conftest import LiveServer, make_settings

SCREENSHOT = Path(__file__).resolve().parents[1] / "docs" / "dashboard.png"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
CHROME_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
    "--window-size=1400,1000",
)


def test_dashboard_is_self_contained(client: TestClient) -> None:
    response = client.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    # no external asset: every src/href is relative, and nothing is fetched but /v1/stats
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html
    assert re.findall(r"fetch\(\s*\"([^\"]+)\"", html) == ["/v1/stats"]
    for element in ("hit-ratio", "calls-avoided", "ms-saved", "hit-p99", "miss-p99", "gpu"):
        assert f'id="{element}"' in html


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER)
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()


def send_traffic(http: httpx.Client, wave: int) -> None:
    """Each wave: some new texts (misses), then repeats of earlier ones (hits)."""
    new = [f"driver {wave}-{i} near depot {i % 7}" for i in range(6 + 2 * wave)]
    assert http.post("/v1/embeddings", json={"input": new}).status_code == 200
    for repeat in range(wave + 1):
        texts = [f"driver {w}-{i} near depot {i % 7}" for w in range(wave + 1) for i in range(4)]
        response = http.post("/v1/embeddings", json={"input": texts[repeat:]})
        assert response.status_code == 200


def wait_for_polls(driver: Any, more_than: int, timeout: float = 15.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        polls = int(driver.find_element("id", "updated").get_attribute("data-polls"))
        if polls > more_than:
            return polls
        time.sleep(0.1)
    raise AssertionError(f"the dashboard did not poll /v1/stats within {timeout} s")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def shown(driver: Any, element: str) -> str:
    return str(driver.find_element("id", element).text)


def test_dashboard_shows_the_stats_live(browser: Any, tmp_path: Path) -> None:
    app = create_app(make_settings(tmp_path / "data"), engine=FakeEngine())
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        while http.get("/readyz").status_code != 200:
            time.sleep(0.02)
        browser.get(f"{server.url}/dashboard")
        polls = wait_for_polls(browser, 0)
        for wave in range(5):  # traffic while the page refreshes: the sparkline moves
            send_traffic(http, wave)
            polls = wait_for_polls(browser, polls)
        polls = wait_for_polls(browser, polls)  # a refresh after the last request
        stats = http.get("/v1/stats").json()

        cache, inference, latency = stats["cache"], stats["inference"], stats["latency"]
        assert inference["calls_avoided"] > 0 and inference["items"] > 0
        expected = {
            "calls-avoided": str(inference["calls_avoided"]),
            "hits": str(cache["hits"]),
            "coalesced": str(cache["coalesced"]),
            "misses": str(cache["misses"]),
            "hit-ratio": f"{100 * cache['hit_ratio']:.1f}%",
            "hit-ratio-1m": f"{100 * cache['windows']['1m']['hit_ratio']:.1f}%",
            "ms-saved": f"{inference['ms_saved']:.1f}",
            "hit-p50": f"{latency['hit_requests']['p50_ms']:.2f}",
            "hit-p99": f"{latency['hit_requests']['p99_ms']:.2f}",
            "miss-p50": f"{latency['miss_requests']['p50_ms']:.2f}",
            "miss-p99": f"{latency['miss_requests']['p99_ms']:.2f}",
            "mean-batch": f"{inference['mean_batch']:.1f}",
            "batches": str(inference["batches"]),
            "items": str(inference["items"]),
            "engine-kind": inference["engine"]["kind"],
            "engine-model": inference["engine"]["model"],
            "status": "ready",
        }
        assert {element: shown(browser, element) for element in expected} == expected
        # the raw value behind each figure is the /v1/stats value itself
        raw = float(browser.find_element("id", "ms-saved").get_attribute("data-value"))
        assert raw == pytest.approx(inference["ms_saved"])

        points = browser.find_element("id", "hit-ratio-line").get_attribute("points").split()
        assert len(points) >= polls - 1
        gpu = browser.find_element("id", "gpu")
        assert gpu.get_attribute("data-available") == str(stats["gpu"]["available"]).lower()
        if not stats["gpu"]["available"]:
            assert stats["gpu"]["reason"] in gpu.text

        screenshot = (
            SCREENSHOT
            if os.environ.get("UPDATE_DASHBOARD_SCREENSHOT")
            else (tmp_path / "dashboard.png")
        )
        assert browser.save_screenshot(str(screenshot))
    assert screenshot.stat().st_size > 10_000


def test_dashboard_asks_for_a_key_when_keys_are_on(browser: Any, tmp_path: Path) -> None:
    """With keys on, /v1/stats answers 401: the page shows its key field and the service's
    message; given an operator key it polls with it (kept in sessionStorage only)."""
    keys_file = tmp_path / "keys"
    key = add_key(keys_file, "ops", frozenset({"operator"}))
    dispatch = add_key(keys_file, "dispatcher", frozenset({"dispatch"}))
    app = create_app(make_settings(tmp_path / "data", api_keys_file=keys_file), FakeEngine())
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        while http.get("/readyz").status_code != 200:
            time.sleep(0.02)
        http.post("/v1/embeddings", json={"input": ["a", "b"]}, headers=bearer(dispatch))
        browser.get(f"{server.url}/dashboard")
        form = browser.find_element("id", "key-form")
        deadline = time.monotonic() + 15
        while not form.is_displayed():
            assert time.monotonic() < deadline, "the page never asked for a key"
            time.sleep(0.1)
        assert "no API key" in shown(browser, "error")
        assert shown(browser, "updated") == "never"

        browser.find_element("id", "key").send_keys(key)
        browser.find_element("css selector", "#key-form button").click()
        wait_for_polls(browser, 0)
        assert not form.is_displayed()
        assert shown(browser, "error") == ""
        stats = http.get("/v1/stats", headers=bearer(key)).json()
        assert shown(browser, "misses") == str(stats["cache"]["misses"]) == "2"
        stored = browser.execute_script(
            "return [sessionStorage.getItem('fleetcache.key'), localStorage.length]"
        )
        assert stored == [key, 0]
        assert key not in browser.current_url
