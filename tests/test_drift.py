"""The drift check (API.md v1.1): recent cache hits re-embedded and compared with what the
cache holds; an engine whose output changed under the same fingerprint is caught."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from engines.base import Batch, Vectors
from engines.fake import FakeEngine
from proxy.drift import RESERVOIR, HitReservoir, cosines
from tests.conftest import make_settings, open_client, wait_ready
from tests.serve_process import FleetcacheServer
from tests.test_fallback import poll

ADMIN = {"Authorization": "Bearer drift-admin"}


class RebuiltEngine(FakeEngine):
    """A test double: after ``rebuild()`` its vectors move (a driver or TensorRT rebuild),
    while its fingerprint, and so the cache namespace, stays the same."""

    def __init__(self) -> None:
        super().__init__()
        self.rebuilt = False

    def rebuild(self) -> None:
        self.rebuilt = True

    def forward(self, batch: Batch) -> Vectors:
        vectors = super().forward(batch)
        if not self.rebuilt:
            return vectors
        noise = np.random.default_rng(7).standard_normal(vectors.shape, dtype=np.float32)
        moved = vectors + 0.1 / np.sqrt(self.dim) * noise  # cosine about 0.995 with the old
        return moved / np.linalg.norm(moved, axis=1, keepdims=True)


def stats(client: TestClient) -> dict[str, Any]:
    body: dict[str, Any] = client.get("/v1/stats").json()
    return body


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def embed_twice(client: TestClient, texts: list[str]) -> None:
    for _ in range(2):  # the second time every text is a hit: into the reservoir
        response = client.post("/v1/embeddings", json={"input": texts})
        assert response.status_code == 200, response.text


@pytest.fixture
def rebuilt() -> RebuiltEngine:
    return RebuiltEngine()


@pytest.fixture
def admin_client(tmp_path: Path, rebuilt: RebuiltEngine) -> Iterator[TestClient]:
    settings = make_settings(tmp_path, admin_token="drift-admin", drift_interval_s=0)
    with open_client(settings, rebuilt) as client:
        wait_ready(client)
        yield client


def test_the_reservoir_keeps_the_last_hits_bounded() -> None:
    reservoir = HitReservoir(capacity=4)
    reservoir.add(["a", "b", "a"])
    reservoir.add(["c", "x" * 5000, "d", "e"])  # an over-long text is left out
    assert reservoir.texts() == ["a", "c", "d", "e"]  # distinct, the last four kept
    assert HitReservoir()._texts.maxlen == RESERVOIR
    reservoir.add([f"t{i}" for i in range(10)])
    assert reservoir.texts() == ["t6", "t7", "t8", "t9"]


def test_cosines_of_rows() -> None:
    a = np.array([[1.0, 0.0], [0.0, 2.0]], np.float32)
    b = np.array([[1.0, 0.0], [2.0, 0.0]], np.float32)
    np.testing.assert_allclose(cosines(a, b), [1.0, 0.0])


def test_a_healthy_engine_has_not_drifted_and_the_check_is_no_lookup(
    admin_client: TestClient,
) -> None:
    texts = [f"electric van {i}, tail lift" for i in range(20)]
    embed_twice(admin_client, texts)
    before = stats(admin_client)
    assert before["cache"]["drift"] is None  # null before the first check
    response = admin_client.post("/v1/cache/drift", json={"sample": 256}, headers=ADMIN)
    assert response.status_code == 200, response.text
    result = response.json()
    assert set(result) == {"sampled", "min_cosine", "mean_cosine", "below_threshold", "threshold"}
    assert result["sampled"] == 20
    assert result["min_cosine"] >= 0.9999 and result["mean_cosine"] >= 0.9999
    assert (result["below_threshold"], result["threshold"]) == (0, 0.999)
    after = stats(admin_client)
    assert after["inference"]["drift_items"] == before["inference"]["drift_items"] + 20
    assert after["inference"]["items"] == before["inference"]["items"]  # not lookups
    assert after["cache"]["misses"] == before["cache"]["misses"]
    assert after["cache"]["hits"] == before["cache"]["hits"]
    assert after["cache"]["tiers"] == before["cache"]["tiers"]  # no tier hit either
    drift = after["cache"]["drift"]
    assert {k: drift[k] for k in result} == result and drift["at"] <= time.time()
    text = admin_client.get("/metrics").text
    assert metric(text, "fleetcache_cache_drift_min_cosine") == pytest.approx(result["min_cosine"])
    assert metric(text, "fleetcache_cache_drift_threshold") == 0.999
    assert metric(text, "fleetcache_engine_drift_items_total") == 20


def test_an_engine_changed_under_the_same_fingerprint_is_caught(
    admin_client: TestClient, rebuilt: RebuiltEngine
) -> None:
    texts = [f"refrigerated truck {i}" for i in range(30)]
    embed_twice(admin_client, texts)
    rebuilt.rebuild()
    result = admin_client.post("/v1/cache/drift", json={"sample": 10}, headers=ADMIN).json()
    assert result["sampled"] == 10  # a random sample of the 30
    assert result["below_threshold"] == 10
    assert 0.9 < result["min_cosine"] <= result["mean_cosine"] < 0.999
    text = admin_client.get("/metrics").text
    assert metric(text, "fleetcache_cache_drift_below_threshold") == 10
    assert stats(admin_client)["cache"]["drift"]["below_threshold"] == 10
    # the default sample (no body) takes every one of them
    assert admin_client.post("/v1/cache/drift", headers=ADMIN).json()["sampled"] == 30


def test_nothing_to_sample_gives_nulls(admin_client: TestClient) -> None:
    response = admin_client.post("/v1/cache/drift", json={}, headers=ADMIN)
    assert response.json() == {
        "sampled": 0,
        "min_cosine": None,
        "mean_cosine": None,
        "below_threshold": 0,
        "threshold": 0.999,
    }
    assert metric(admin_client.get("/metrics").text, "fleetcache_cache_drift_min_cosine") is None


@pytest.mark.parametrize(
    ("body", "param"),
    [({"sample": 0}, "sample"), ({"sample": 5000}, "sample"), ({"samples": 3}, "samples")],
)
def test_a_bad_sample_is_a_422_naming_it(
    admin_client: TestClient, body: dict[str, Any], param: str
) -> None:
    response = admin_client.post("/v1/cache/drift", json=body, headers=ADMIN)
    assert response.status_code == 422
    assert response.json()["error"]["param"] == param


def test_the_check_is_admin_only(admin_client: TestClient, tmp_path: Path) -> None:
    assert admin_client.post("/v1/cache/drift").status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert admin_client.post("/v1/cache/drift", headers=wrong).status_code == 401
    with open_client(make_settings(tmp_path / "open")) as client:  # no token configured
        wait_ready(client)
        response = client.post("/v1/cache/drift")
        assert response.status_code == 403
        assert response.json()["error"]["type"] == "permission_error"


def test_the_background_check_runs_every_interval(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, drift_interval_s=0.2)
    with open_client(settings) as client:
        wait_ready(client)
        embed_twice(client, ["a hit to check"])
        poll(lambda: (stats(client)["cache"]["drift"] or {}).get("sampled") == 1)
        first = stats(client)["cache"]["drift"]["at"]
        poll(lambda: stats(client)["cache"]["drift"]["at"] > first)
        assert stats(client)["cache"]["drift"]["min_cosine"] >= 0.9999


def test_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="drift_threshold"):
        make_settings(tmp_path, drift_threshold=1.5)
    with pytest.raises(ValueError, match="drift_interval_s"):
        make_settings(tmp_path, drift_interval_s=-1)


@pytest.mark.timeout(300)
def test_the_sample_is_drawn_over_every_workers_hits(tmp_path: Path) -> None:
    """fleetcache serve with two workers: hits land in both; the check sees all of them."""
    admin = {"Authorization": "Bearer secret"}
    with FleetcacheServer(tmp_path, workers=2, admin_token="secret", drift_interval_s=0) as server:
        texts = [f"tail lift {i}" for i in range(40)]

        def requests() -> dict[int, int]:
            return {w["pid"]: w["requests"] for w in server.pids()["workers"]}

        for text in texts:  # computed once, written to the shared tier
            with httpx.Client(base_url=server.url, timeout=30) as client:
                assert client.post("/v1/embeddings", json={"input": [text]}).status_code == 200
        before = requests()
        for text in texts:  # each on a new connection: the hits spread over the workers
            with httpx.Client(base_url=server.url, timeout=30) as client:
                response = client.post("/v1/embeddings", json={"input": [text]})
                assert response.headers["X-Cache-Hits"] == "1"
        after = requests()
        assert all(after[pid] > before.get(pid, 0) + 1 for pid in after), (before, after)
        with httpx.Client(base_url=server.url, timeout=60, headers=admin) as client:
            result = client.post("/v1/cache/drift", json={"sample": 4096}).json()
        assert result["sampled"] == 40  # one worker's reservoir alone holds fewer
        assert result["min_cosine"] >= 0.9999
        stats = server.stats()
        assert stats["inference"]["drift_items"] == 40
        assert stats["inference"]["items"] == stats["cache"]["misses"] == 40
        assert stats["cache"]["drift"]["sampled"] == 40  # through either worker


@pytest.mark.model
def test_the_real_model_on_the_cpu_has_not_drifted(tmp_path: Path) -> None:
    from proxy.app import create_app

    settings = make_settings(
        tmp_path, engine="torch", device="cpu", admin_token="drift-admin", drift_interval_s=0
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client, timeout=300)
        texts = [f"van, electric, capacity {100 * i} kg, on-time {90 + i % 10}%" for i in range(24)]
        for size in (1, 5, 24):  # cached from batches of other sizes than the re-embed's
            response = client.post("/v1/embeddings", json={"input": texts[:size]})
            assert response.status_code == 200
        embed_twice(client, texts)
        result = client.post("/v1/cache/drift", json={"sample": 24}, headers=ADMIN).json()
    assert result["sampled"] == 24
    assert result["min_cosine"] >= 0.9999 and result["below_threshold"] == 0
