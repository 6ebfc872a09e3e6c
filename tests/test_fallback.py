"""The primary engine's health and the same-fingerprint fallback, via the batcher and over HTTP.

Engines here are fakes that a test breaks or slows down and repairs. Recovery is awaited by
polling (bounded), never by asserting a duration.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from fastapi.testclient import TestClient

from engines.base import Batch, BatchError, EngineError, EngineUnavailableError, Vectors
from engines.batcher import Batcher
from engines.fake import FakeEngine
from engines.fallback import PROBE_TEXTS, FallbackEngine
from proxy.app import create_app
from proxy.engine_host import build_engine
from tests.conftest import make_settings, open_client, wait_ready


class FlakyEngine(FakeEngine):
    """A fake that fails every batch while ``broken``; ``texts`` records what reached it."""

    def __init__(self, **options: Any) -> None:
        super().__init__(dim=8, **options)
        self.broken = False
        self.texts: list[str] = []
        self._record = threading.Lock()

    def forward(self, batch: Batch) -> Vectors:
        with self._record:
            self.texts.extend(batch.data["texts"])
        if self.broken:
            raise EngineError("device lost")
        return super().forward(batch)

    def misses_seen(self) -> list[str]:
        """What reached the engine apart from health probes."""
        with self._record:
            return [text for text in self.texts if text not in PROBE_TEXTS]


def poll(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        time.sleep(0.01)


async def apoll(condition: Callable[[], bool]) -> None:
    await asyncio.to_thread(poll, condition)


def test_a_fallback_with_another_fingerprint_is_refused() -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        FallbackEngine(FakeEngine(dim=8), FakeEngine(dim=16))
    same = FallbackEngine(FakeEngine(dim=8), FakeEngine(dim=8))
    assert same.fingerprint == FakeEngine(dim=8).fingerprint


def test_engine_error_refuses_misses_until_a_probe_succeeds() -> None:
    async def test() -> None:
        primary = FlakyEngine()
        engine = FallbackEngine(primary, backoff_s=0.05, max_backoff_s=0.1)
        async with Batcher(engine) as batcher:
            await batcher.submit(["before"])
            primary.broken = True
            with pytest.raises(EngineUnavailableError, match="device lost"):
                await batcher.submit(["fails"])
            health = batcher.engine_health()
            assert (health.healthy, health.serving) == (False, "none")
            assert health.reason is not None and "device lost" in health.reason
            with pytest.raises(EngineUnavailableError, match="no engine can serve"):
                await batcher.submit(["refused"])  # at once: never reaches the engine
            assert "refused" not in primary.misses_seen()
            await apoll(lambda: PROBE_TEXTS[0] in primary.texts)  # probes keep failing
            assert not batcher.healthy
            primary.broken = False
            await apoll(lambda: batcher.healthy)
            vectors = await batcher.submit(["after"])
        assert primary.misses_seen() == ["before", "fails", "after"]
        np.testing.assert_array_equal(vectors, FakeEngine(dim=8).embed(["after"]))
        engine.close()

    asyncio.run(test())


def test_a_batch_that_fails_while_the_engine_still_answers_trips_nothing() -> None:
    """A text the model cannot take fails its own request only: the probe right after the
    failed batch succeeds, so the primary stays healthy and nothing else is refused."""

    async def test() -> None:
        primary = FlakyEngine(fail_on="POISON")
        engine = FallbackEngine(primary, backoff_s=60, max_backoff_s=60)
        async with Batcher(engine) as batcher:
            results = await asyncio.gather(
                batcher.submit(["good-1"]),
                batcher.submit(["POISON"]),
                batcher.submit(["good-2"]),
                return_exceptions=True,
            )
            assert isinstance(results[1], BatchError)
            assert not isinstance(results[0], BaseException)
            assert not isinstance(results[2], BaseException)
            health = batcher.engine_health()
            assert (health.healthy, health.serving) == (True, "primary")
            assert PROBE_TEXTS[0] in primary.texts  # the probe that cleared the engine
            await batcher.submit(["good-3"])
        engine.close()

    asyncio.run(test())


def test_same_fingerprint_fallback_serves_misses_while_the_primary_is_down() -> None:
    async def test() -> None:
        primary, fallback = FlakyEngine(), FlakyEngine()
        engine = FallbackEngine(primary, fallback, backoff_s=60, max_backoff_s=60)  # no probe
        async with Batcher(engine) as batcher:
            primary.broken = True
            first = await batcher.submit(["a", "b"])  # the primary fails, the fallback serves
            second = await batcher.submit(["c"])  # straight to the fallback
            health = batcher.engine_health()
        assert primary.misses_seen() == ["a", "b"]
        assert fallback.misses_seen() == ["a", "b", "c"]
        np.testing.assert_array_equal(first, fallback.embed(["a", "b"]))
        np.testing.assert_array_equal(second, fallback.embed(["c"]))
        assert (health.healthy, health.serving) == (False, "fallback")
        engine.close()

    asyncio.run(test())


def test_padded_lengths_are_those_of_the_engine_expected_to_run_the_batch() -> None:
    """What the batcher forms a batch within the token budget by: the primary's lengths
    while it serves, the fallback's once it has tripped."""

    class KnownLengths(FlakyEngine):
        def padded_lengths(self, texts: Sequence[str]) -> npt.NDArray[np.int64]:
            return np.full(len(texts), 7, np.int64)

    async def test() -> None:
        primary = KnownLengths()
        engine = FallbackEngine(primary, FlakyEngine(), backoff_s=60, max_backoff_s=60)
        known = engine.padded_lengths(["a", "b"])
        assert known is not None and known.tolist() == [7, 7]
        async with Batcher(engine) as batcher:
            primary.broken = True
            await batcher.submit(["a"])  # the primary fails, the fallback serves
        assert engine.padded_lengths(["a", "b"]) is None  # the fallback's: once tokenized
        engine.close()

    asyncio.run(test())


def test_batch_p99_over_the_limit_turns_unhealthy_until_the_primary_is_fast() -> None:
    async def test() -> None:
        primary, fallback = FakeEngine(dim=8, delay_s=0.03), FakeEngine(dim=8)
        engine = FallbackEngine(
            primary, fallback, max_batch_p99_ms=10, window=3, min_batches=3, backoff_s=0.05
        )
        async with Batcher(engine) as batcher:
            for i in range(3):
                assert batcher.healthy
                await batcher.submit([f"slow {i}"])
            health = batcher.engine_health()
            assert (health.healthy, health.serving) == (False, "fallback")
            assert health.reason is not None and "max_batch_p99_ms=10" in health.reason
            served = fallback.calls
            await batcher.submit(["served by the fallback"])
            assert fallback.calls == served + 1
            primary.delay_s = 0.0
            await apoll(lambda: batcher.healthy)
            calls = primary.calls
            await batcher.submit(["back on the primary"])
            assert primary.calls == calls + 1
        engine.close()

    asyncio.run(test())


# -- over HTTP ---------------------------------------------------------------------------------


def embed_status(client: TestClient, texts: list[str]) -> int:
    return client.post("/v1/embeddings", json={"input": texts}).status_code


class PathEngine(FlakyEngine):
    """Failures whose text names a file by its absolute path, as library errors do: a batch
    holding ``POISON`` (its contents), or every batch while ``broken`` (the device)."""

    def forward(self, batch: Batch) -> Vectors:
        if self.broken or any("POISON" in text for text in batch.data["texts"]):
            raise EngineError("device lost at /opt/fleet/private/kernel.cu:42")
        return super().forward(batch)


def test_an_engine_failure_answers_without_its_exception_text(tmp_path: Path) -> None:
    """API.md: error messages carry no absolute paths and no internal exception text. A
    batch failed by its contents (``engine_error``), an engine failed by its device
    (``engine_unavailable``) and ``/readyz`` say what failed and point at the log; the
    exception's text is for operators (``/v1/stats``). The onnxruntime engine's failures
    named its library's source files."""
    primary = PathEngine()
    engine = FallbackEngine(primary, backoff_s=5.0, max_backoff_s=5.0)
    with open_client(make_settings(tmp_path), engine) as client:
        wait_ready(client)
        answers = [client.post("/v1/embeddings", json={"input": ["POISON"]})]
        primary.broken = True
        answers.append(client.post("/v1/embeddings", json={"input": ["new"]}))
        assert [a.status_code for a in answers] == [503, 503]
        errors = [a.json()["error"] for a in answers]
        assert [e["type"] for e in errors] == ["engine_error", "engine_unavailable"]
        errors.append(client.get("/readyz").json()["error"])
        assert "primary engine failed" in errors[-1]["message"]
        for error in errors:
            assert "in the server log" in error["message"], error
            assert "device lost" not in error["message"] and "EngineError" not in error["message"]
            assert "/opt" not in error["message"] and "kernel.cu" not in error["message"]
        assert "device lost at /opt/fleet/private/kernel.cu:42" in client.get("/v1/stats").text


def engine_health(client: TestClient) -> dict[str, Any]:
    health: dict[str, Any] = client.get("/v1/stats").json()["inference"]["engine_health"]
    return health


def test_http_primary_failure_without_fallback(tmp_path: Path) -> None:
    primary = FlakyEngine()
    engine = FallbackEngine(primary, backoff_s=0.05, max_backoff_s=0.1)
    with open_client(make_settings(tmp_path), engine) as client:
        wait_ready(client)
        assert engine_health(client) == {
            "healthy": True,
            "degraded": False,
            "reason": None,
            "serving": "primary",
        }
        assert embed_status(client, ["cached"]) == 200
        primary.broken = True
        failed = client.post("/v1/embeddings", json={"input": ["new-1"]})
        assert failed.status_code == 503
        assert "primary engine failed" in failed.json()["error"]["message"]

        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert "primary engine failed" in ready.json()["error"]["message"]
        health = engine_health(client)
        assert (health["healthy"], health["serving"]) == (False, "none")
        assert "device lost" in health["reason"]
        stats = client.get("/v1/stats").json()
        assert stats["ready"] is False and "device lost" in stats["status"]

        assert embed_status(client, ["cached"]) == 200  # a hit never needs the engine
        assert embed_status(client, ["new-2"]) == 503
        assert primary.misses_seen().count("new-2") == 0

        primary.broken = False
        wait_ready(client, timeout=30)
        assert embed_status(client, ["new-2"]) == 200
        assert engine_health(client)["healthy"] is True


def test_http_fallback_serves_misses_and_readyz_still_reports_the_primary(
    tmp_path: Path,
) -> None:
    primary, fallback = FlakyEngine(), FlakyEngine()
    engine = FallbackEngine(primary, fallback, backoff_s=60, max_backoff_s=60)
    with open_client(make_settings(tmp_path), engine) as client:
        wait_ready(client)
        primary.broken = True
        response = client.post("/v1/embeddings", json={"input": ["x", "y"]})
        assert response.status_code == 200
        vectors = np.array([row["embedding"] for row in response.json()["data"]])
        np.testing.assert_allclose(vectors, fallback.embed(["x", "y"]), atol=1e-6)
        assert embed_status(client, ["z"]) == 200
        assert fallback.misses_seen()[-3:] == ["x", "y", "z"]
        assert "z" not in primary.misses_seen()
        assert client.get("/readyz").status_code == 503
        assert engine_health(client)["serving"] == "fallback"


def test_http_dispatch_items_past_their_deadline_never_reach_the_engine(tmp_path: Path) -> None:
    engine = FakeEngine(dim=8, delay_s=0.5)  # one text per batch, 0.5 s each
    settings = make_settings(tmp_path, max_batch_size=1, dispatch_deadline_ms=150)
    with open_client(settings, engine) as client:
        wait_ready(client)
        before = engine.items  # warm-up texts
        response = client.post("/v1/embeddings", json={"input": ["first", "second"]})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "deadline_exceeded"
        assert response.headers["Retry-After"] == "1"
        time.sleep(0.6)  # "first" finishes in the engine; "second" was dropped while queued
        assert engine.items == before + 1
        stats = client.get("/v1/stats").json()["inference"]
        assert stats["expired_items"] == 1


def test_settings_build_a_watched_engine_with_a_same_fingerprint_fallback(tmp_path: Path) -> None:
    engine = build_engine(make_settings(tmp_path, fallback_engine="fake"))
    assert isinstance(engine, FallbackEngine) and engine.fallback is not None
    assert engine.fallback.fingerprint == engine.fingerprint
    assert build_engine(make_settings(tmp_path)).fallback is None
    with pytest.raises(ValueError, match="fingerprint"):
        build_engine(make_settings(tmp_path, engine="torch", fallback_engine="fake"))


def test_a_failed_start_answers_without_its_exception_text(tmp_path: Path) -> None:
    """A start-up that failed (here: the data directory is a file) answers every route 503
    ``not_ready`` saying so, without the OS error's text or the server's paths."""
    taken = tmp_path / "a-file"
    taken.write_text("not a directory")
    app = create_app(make_settings(taken / "data"), engine=FakeEngine())
    with TestClient(app) as client:
        deadline = time.monotonic() + 30
        while app.state.startup_error is None:
            assert time.monotonic() < deadline, "the start did not fail"
            time.sleep(0.05)
        for answer in (client.get("/readyz"), client.post("/v1/embeddings", json={"input": "x"})):
            assert answer.status_code == 503
            error = answer.json()["error"]
            assert error["type"] == "not_ready" and "start-up failed" in error["message"]
            assert "Errno" not in error["message"] and str(tmp_path) not in error["message"]
            assert "a-file" not in error["message"], error
