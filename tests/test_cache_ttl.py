"""TTL per entity type: the codec's expiring entries, expiry on every store kind, and the TTLs
that /v1/features/embed, PUT /v1/fleet/drivers and warm-up give driver and vehicle texts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from typer.testing import CliRunner

from cache import codec
from cache.embedder import CachedEmbedder
from cache.stores import LmdbByteStore, TieredByteStore, build_store
from engines.fake import FakeEngine
from features.readers import write_records
from features.synthetic import generate_fleet
from features.text import driver_text, vehicle_text
from proxy.cli import app as cli
from proxy.engine_host import cache_namespace
from tests.conftest import make_settings, open_client, wait_ready
from tests.redis_server import (  # noqa: F401  (pytest fixtures)
    RedisServer,
    redis_server_fixture,
    redis_session_fixture,
)
from tests.test_cache import DIM, FakeCompute, assert_vectors, run, vec

MiB = 1 << 20


class Clock:
    """An injectable wall clock (seconds since the epoch)."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- codec ---------------------------------------------------------------------------------


def test_an_expiring_entry_roundtrips_and_stays_compact() -> None:
    v = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    data = codec.encode(v, expires_at=1234.5)
    assert len(data) == codec.encoded_size(384, expiring=True) == 20 + 384 * 4
    key_bytes = len("t1-0123456789abcdef:" + "0" * 64)
    assert len(data) <= 1.1 * (384 * 4 + key_bytes)
    assert codec.expires_at(data) == 1234.5
    np.testing.assert_array_equal(codec.decode(data, 384), v)  # no clock: no expiry check
    np.testing.assert_array_equal(codec.decode(data, 384, now=1234.4), v)
    with pytest.raises(codec.ExpiredEntryError):
        codec.decode(data, 384, now=1234.5)
    half = codec.encode(v, "float16", expires_at=99.0)
    assert len(half) == codec.encoded_size(384, "float16", expiring=True) == 20 + 384 * 2
    assert codec.expires_at(half) == 99.0


def test_version_1_entries_still_decode_and_never_expire() -> None:
    v = np.arange(8, dtype=np.float32)
    old = codec.encode(v)
    assert old[2] == 1 and len(old) == 12 + 32  # what every earlier release wrote
    assert codec.expires_at(old) is None
    np.testing.assert_array_equal(codec.decode(old, 8, now=1e12), v)


def test_a_corrupt_expiry_is_a_corrupt_entry_not_an_expired_one() -> None:
    data = codec.encode(np.arange(8, dtype=np.float32), expires_at=2e9)
    flipped = data[:13] + bytes([data[13] ^ 0x40]) + data[14:]  # inside the expiry field
    with pytest.raises(codec.CorruptEntryError, match="crc"):
        codec.decode(flipped, 8, now=0.0)
    with pytest.raises(codec.CorruptEntryError):
        codec.decode(data[:-1], 8, now=0.0)
    with pytest.raises(ValueError):
        codec.encode(np.zeros(2, np.float32), expires_at=float("inf"))


# -- expiry on each store kind --------------------------------------------------------------


@pytest.mark.parametrize("kind", ["memory", "lmdb"])
def test_an_entry_written_with_a_ttl_is_a_miss_after_it(kind: str, tmp_path: Path) -> None:
    clock = Clock()
    # LMDB with the memory tier off, so that every read comes from LMDB itself.
    store = build_store(kind, memory_bytes=MiB if kind == "memory" else 0, data_dir=tmp_path)
    compute = FakeCompute()
    emb = CachedEmbedder(compute, store, namespace="ns", dim=DIM, wall_clock=clock)

    first = run(lambda: emb.aembed(["a", "b"], ttl_s=[10.0, None]))
    assert first.misses == 2
    clock.now += 9.9
    assert run(lambda: emb.aembed(["a", "b"])).hits == 2
    clock.now += 0.1  # "a" expires at exactly t + 10
    again = run(lambda: emb.aembed(["a", "b"], ttl_s=10.0))
    assert again.statuses == ("miss", "hit")
    assert_vectors(again, ["a", "b"])
    assert compute.texts == ["a", "b", "a"]
    stats = emb.stats()
    assert (stats["expired_entries"], stats["store_errors"], stats["corrupt_entries"]) == (1, 0, 0)
    assert (stats["hits"], stats["misses"]) == (3, 3)
    (stored,) = store.mget([emb.key("a")])
    assert stored is not None and codec.expires_at(stored) == clock.now + 10.0  # rewritten
    (kept,) = store.mget([emb.key("b")])
    assert kept is not None and codec.expires_at(kept) is None  # a hit is not rewritten
    store.close()


def test_an_lmdb_entry_keeps_its_expiry_across_a_restart(tmp_path: Path) -> None:
    """The expiry travels with the value: a store reopened on the same file applies it."""
    clock = Clock()
    writer_store = LmdbByteStore(tmp_path / "db")
    writer = CachedEmbedder(FakeCompute(), writer_store, namespace="ns", dim=DIM, wall_clock=clock)
    run(lambda: writer.aembed(["a"], ttl_s=5.0))
    writer_store.close()
    reader_compute = FakeCompute()
    reader_store = LmdbByteStore(tmp_path / "db")
    reader = CachedEmbedder(reader_compute, reader_store, namespace="ns", dim=DIM, wall_clock=clock)
    assert run(lambda: reader.aembed(["a"])).hits == 1
    clock.now += 5.0
    assert run(lambda: reader.aembed(["a"])).misses == 1
    assert reader_compute.texts == ["a"]
    reader_store.close()


@pytest.mark.redis
def test_redis_expires_entries_written_with_a_ttl_by_itself(redis_server: RedisServer) -> None:
    store = build_store("redis", memory_bytes=0, redis_url=redis_server.url)
    compute = FakeCompute()
    emb = CachedEmbedder(compute, store, namespace="ns", dim=DIM)
    run(lambda: emb.aembed(["short", "forever"], ttl_s=[0.3, None]))
    raw = redis.Redis.from_url(redis_server.url)
    assert 0 < raw.pttl(f"fc:{emb.key('short')}") <= 300
    assert raw.pttl(f"fc:{emb.key('forever')}") == -1  # no expiry
    assert run(lambda: emb.aembed(["short"])).hits == 1
    time.sleep(0.4)
    assert raw.get(f"fc:{emb.key('short')}") is None  # gone from Redis itself
    after = run(lambda: emb.aembed(["short", "forever"]))
    assert after.statuses == ("miss", "hit")
    assert_vectors(after, ["short", "forever"])
    assert compute.texts == ["short", "forever", "short"]
    assert emb.stats()["store_errors"] == 0
    raw.close()
    store.close()


@pytest.mark.redis
def test_a_redis_entry_read_after_its_expiry_is_a_miss(redis_server: RedisServer) -> None:
    """The header check applies to Redis too (clock skew between replicas and Redis)."""
    clock = Clock(time.time())
    store = build_store("redis", memory_bytes=0, redis_url=redis_server.url)
    emb = CachedEmbedder(FakeCompute(), store, namespace="ns", dim=DIM, wall_clock=clock)
    run(lambda: emb.aembed(["a"], ttl_s=60.0))
    clock.now += 61.0  # still in Redis (its own clock has not moved), expired for us
    assert store.mget([emb.key("a")]) != [None]
    assert run(lambda: emb.aembed(["a"])).misses == 1
    assert emb.stats()["expired_entries"] == 1
    store.close()


# -- where the entity type is known ----------------------------------------------------------


def stored_expiry(store: TieredByteStore, key: str) -> float | None:
    (value,) = store.mget([key])
    assert value is not None, key
    return codec.expires_at(value)


def app_store(client: Any) -> tuple[CachedEmbedder, TieredByteStore]:
    embedder = client.app.state.services.embedder
    assert isinstance(embedder._store, TieredByteStore)
    return embedder, embedder._store


def test_driver_and_vehicle_texts_get_their_ttls_plain_texts_none(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, cache_ttl_driver_s=600.0, cache_ttl_vehicle_s=3600.0)
    d1, d2 = generate_fleet(2, seed=4)
    with open_client(settings) as client:
        wait_ready(client)
        body = {
            "drivers": [d1.model_dump(mode="json")],
            "vehicles": [d1.vehicle.model_dump(mode="json")],
        }
        before = time.time()
        assert client.post("/v1/features/embed", json=body).status_code == 200
        assert client.put("/v1/fleet/drivers", json={"drivers": [d2.model_dump(mode="json")]})
        assert client.post("/v1/embeddings", json={"input": "plain text"}).status_code == 200
        after = time.time()
        emb, store = app_store(client)
        for text, ttl in ((driver_text(d1), 600), (vehicle_text(d1.vehicle), 3600)):
            expiry = stored_expiry(store, emb.key(text))
            assert expiry is not None and before + ttl <= expiry <= after + ttl
        expiry = stored_expiry(store, emb.key(driver_text(d2)))
        assert expiry is not None and before + 600 <= expiry <= after + 600
        assert stored_expiry(store, emb.key("plain text")) is None


def test_a_driver_embedded_over_http_is_computed_again_after_its_ttl(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, cache_ttl_driver_s=0.5)
    engine = FakeEngine()
    (driver,) = generate_fleet(1, seed=5)
    body = {"drivers": [driver.model_dump(mode="json")], "include_vectors": False}
    with open_client(settings, engine) as client:
        wait_ready(client)
        assert client.post("/v1/features/embed", json=body).json()["misses"] == 1
        assert client.post("/v1/features/embed", json=body).json()["hits"] == 1
        time.sleep(0.6)
        items = engine.items
        later = client.post("/v1/features/embed", json=body).json()
        assert (later["hits"], later["misses"]) == (0, 1)
        assert engine.items == items + 1
        stats = client.get("/v1/stats").json()["cache"]
        assert stats["expired_entries"] == 1 and stats["store_errors"] == 0


def test_warmup_writes_driver_texts_with_the_driver_ttl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    for name, value in {
        "ENGINE": "fake",
        "DATA_DIR": str(data),
        "LMDB_MAP_SIZE_GB": "0.25",
        "CACHE_TTL_DRIVER_S": "86400",
    }.items():
        monkeypatch.setenv(f"FLEETCACHE_{name}", value)
    monkeypatch.chdir(tmp_path)
    drivers = generate_fleet(20, seed=6)
    write_records(drivers, tmp_path / "fleet.jsonl")
    before = time.time()
    result = CliRunner().invoke(cli, ["warmup", str(tmp_path / "fleet.jsonl")])
    assert result.exit_code == 0, result.output
    store = LmdbByteStore(data / "cache.lmdb")
    namespace = cache_namespace(FakeEngine().info)
    emb = CachedEmbedder(FakeCompute(), store, namespace=namespace, dim=384)
    texts = {driver_text(d) for d in drivers}
    values = store.mget([emb.key(t) for t in texts])
    expiries = [codec.expires_at(v) for v in values if v is not None]
    assert len(expiries) == len(texts)
    assert all(e is not None and before + 86400 <= e <= time.time() + 86400 for e in expiries)
    store.close()


def test_vectors_are_right_whatever_the_ttl() -> None:
    """A TTL changes when an entry expires, never the vector served."""
    clock = Clock()
    emb = CachedEmbedder(
        FakeCompute(),
        build_store("memory", memory_bytes=MiB),
        namespace="ns",
        dim=DIM,
        wall_clock=clock,
    )
    run(lambda: emb.aembed(["x", "y"], ttl_s=[1.0, 2.0]))
    hit = run(lambda: emb.aembed(["x", "y"]))
    assert hit.hits == 2
    np.testing.assert_array_equal(hit.vectors, np.stack([vec("x"), vec("y")]))
    with pytest.raises(ValueError):
        run(lambda: emb.aembed(["x"], ttl_s=[1.0, 2.0]))  # one TTL per text
    with pytest.raises(ValueError):
        run(lambda: emb.aembed(["z"], ttl_s=0.0))
