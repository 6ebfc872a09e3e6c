"""RedisByteStore against a real redis-server: keys, TTL, errors, reconnects, and the cache
serving through a Redis that dies, comes back, or holds corrupt entries."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from cache import codec
from cache.embedder import CachedEmbedder
from cache.stores import MemoryByteStore, RedisByteStore, TieredByteStore, build_store
from tests.redis_server import (  # noqa: F401  (pytest fixtures)
    RedisServer,
    own_redis_fixture,
    redis_server_fixture,
    redis_session_fixture,
)
from tests.test_cache import (
    CORRUPT_IDS,
    CORRUPT_VALUES,
    DIM,
    FakeCompute,
    assert_vectors,
    run,
    vec,
)

pytestmark = pytest.mark.redis
MiB = 1 << 20


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RedisByteStore]:
    s = RedisByteStore(redis_server.url, socket_timeout_s=2.0)
    yield s
    s.close()


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


# -- the store --------------------------------------------------------------------------


def test_keys_live_under_the_prefix_and_prefixes_do_not_mix(redis_server: RedisServer) -> None:
    a = RedisByteStore(redis_server.url, prefix="fc[1]*:")  # glob characters are literal
    b = RedisByteStore(redis_server.url, prefix="fc1x:")
    a.mset([("k", b"from a"), ("k2", b"a2")])
    b.mset([("k", b"from b")])
    assert a.mget(["k", "k2"]) == [b"from a", b"a2"]
    assert b.mget(["k", "k2"]) == [b"from b", None]
    assert sorted(a.yield_keys()) == ["k", "k2"]
    assert list(b.yield_keys()) == ["k"]
    assert sorted(raw_client(redis_server).keys()) == [b"fc1x:k", b"fc[1]*:k", b"fc[1]*:k2"]
    a.mdelete(["k", "k2"])
    assert b.mget(["k"]) == [b"from b"]
    a.close()
    b.close()


def test_prefix_scan_escapes_glob_characters(store: RedisByteStore) -> None:
    store.mset([("a*b", b"1"), ("axb", b"2"), ("a?", b"3"), ("a[b]", b"4")])
    assert list(store.yield_keys(prefix="a*")) == ["a*b"]
    assert list(store.yield_keys(prefix="a?")) == ["a?"]
    assert list(store.yield_keys(prefix="a[")) == ["a[b]"]


def test_ttl_expires_entries(redis_server: RedisServer) -> None:
    s = RedisByteStore(redis_server.url, prefix="t:", ttl_s=30)
    s.mset([("k", b"v"), ("j", b"w")])
    client = raw_client(redis_server)
    assert 0 < client.pttl("t:k") <= 30_000
    assert 0 < client.pttl("t:j") <= 30_000
    s.close()
    forever = RedisByteStore(redis_server.url, prefix="t:")
    forever.mset([("k", b"v")])
    assert client.pttl("t:k") == -1  # no TTL: the entry stays until deleted or evicted
    forever.close()
    with pytest.raises(ValueError):
        RedisByteStore(redis_server.url, ttl_s=0)


def test_large_batches_are_split_into_pipelined_chunks(redis_server: RedisServer) -> None:
    s = RedisByteStore(redis_server.url, chunk=7, scan_count=5)
    pairs = [(f"k{i}", f"v{i}".encode()) for i in range(50)]
    s.mset(pairs)
    keys = [k for k, _ in pairs] + ["missing"]
    assert s.mget(keys) == [v for _, v in pairs] + [None]
    assert asyncio.run(s.amget(keys)) == [v for _, v in pairs] + [None]
    assert sorted(s.yield_keys()) == sorted(k for k, _ in pairs)
    assert s.contains(["k3", "nope", "k49"]) == [True, False, True]
    s.mdelete([f"k{i}" for i in range(0, 50, 2)])
    assert len(list(s.yield_keys())) == 25
    assert s.mget([]) == []
    s.close()


def test_info_never_shows_the_password() -> None:
    s = RedisByteStore("redis://user:s3cret@127.0.0.1:1/0", ttl_s=60)
    info = s.info()
    assert "s3cret" not in str(info)
    assert info == {
        "kind": "redis",
        "url": "redis://user:***@127.0.0.1:1/0",
        "prefix": "fc:",
        "ttl_s": 60.0,
    }
    s.close()


def test_errors_propagate_while_redis_is_down_and_it_reconnects_by_itself(
    own_redis: RedisServer,
) -> None:
    s = RedisByteStore(own_redis.url)
    s.mset([("k", b"v")])
    own_redis.stop()  # SIGKILL: the pooled connections die with it
    with pytest.raises(redis.exceptions.ConnectionError):
        s.mget(["k"])
    with pytest.raises(redis.exceptions.ConnectionError):
        asyncio.run(s.amset([("k", b"v")]))
    own_redis.start()  # same port, empty (no persistence)
    assert s.mget(["k"]) == [None]  # the same store object, no reconnect call
    s.mset([("k", b"again")])
    assert asyncio.run(s.amget(["k"])) == [b"again"]
    s.close()


def test_build_store_redis(redis_server: RedisServer) -> None:
    tiered = build_store("redis", memory_bytes=MiB, redis_url=redis_server.url, redis_ttl_s=60)
    assert tiered.store_kind == "redis"
    tiered.mset([("k", b"v")])
    assert raw_client(redis_server).pttl("fc:k") > 0
    tiered.close()
    with pytest.raises(ValueError, match="redis_url"):
        build_store("redis", memory_bytes=MiB)


# -- the cache through a failing Redis --------------------------------------------------------


def redis_cache(
    server: RedisServer, retry_after_s: float = 1.0, clock: Callable[[], float] = time.monotonic
) -> tuple[CachedEmbedder, FakeCompute]:
    compute = FakeCompute()
    redis_store = RedisByteStore(server.url)
    store = TieredByteStore(
        MemoryByteStore(MiB), redis_store, retry_after_s=retry_after_s, clock=clock
    )
    return CachedEmbedder(compute, store, namespace="fake-v1", dim=DIM), compute


def store_of(emb: CachedEmbedder) -> TieredByteStore:
    store = emb._store
    assert isinstance(store, TieredByteStore)
    return store


def test_requests_are_served_while_redis_is_down_and_writes_resume_after(
    own_redis: RedisServer,
) -> None:
    emb, compute = redis_cache(own_redis, retry_after_s=0)
    redis_store = store_of(emb).store
    assert isinstance(redis_store, RedisByteStore)
    run(lambda: emb.aembed(["a", "b"]))
    assert redis_store.mget([emb.key("a")]) != [None]  # written through to Redis
    assert emb.stats()["tiers"]["store"]["degraded"] is False

    own_redis.stop()
    during = run(lambda: emb.aembed(["a", "b", "c"]))
    assert (during.hits, during.misses) == (2, 1)  # memory hits served, the miss computed
    assert_vectors(during, ["a", "b", "c"])
    store_stats = emb.stats()["tiers"]["store"]
    assert store_stats["degraded"] is True
    assert store_stats["errors"] >= 1
    assert "ConnectionError" in store_stats["last_error"]
    assert emb.stats()["store_errors"] >= 1

    own_redis.start()  # back on the same port, empty
    after = run(lambda: emb.aembed(["d"]))
    assert after.misses == 1
    assert emb.stats()["tiers"]["store"]["degraded"] is False  # recovered by itself
    (stored,) = redis_store.mget([emb.key("d")])
    assert stored is not None  # new writes land in Redis again
    np.testing.assert_array_equal(codec.decode(stored, DIM), vec("d"))
    assert compute.texts == ["a", "b", "c", "d"]
    store_of(emb).close()


def test_a_degraded_store_is_skipped_until_retry_after(own_redis: RedisServer) -> None:
    now = [0.0]
    emb, compute = redis_cache(own_redis, retry_after_s=5.0, clock=lambda: now[0])
    tiered = store_of(emb)
    own_redis.stop()
    run(lambda: emb.aembed(["a"]))  # lookup fails: degraded; the write-back skips Redis
    errors = tiered.store_errors
    run(lambda: emb.aembed(["b"]))
    assert tiered.store_errors == errors  # not tried again within retry_after_s
    assert tiered.store_skipped >= 2
    assert tiered.store_degraded

    own_redis.start()
    now[0] = 5.0  # retry_after_s later, the next call tries Redis again and succeeds
    run(lambda: emb.aembed(["c"]))
    assert not tiered.store_degraded
    assert store_of(emb).store.mget([emb.key("c")]) != [None]
    assert compute.texts == ["a", "b", "c"]
    tiered.close()


@pytest.mark.parametrize(
    "garbage",
    CORRUPT_VALUES,
    ids=CORRUPT_IDS,
)
def test_corrupt_redis_entry_is_a_counted_miss_and_is_overwritten(
    redis_server: RedisServer, garbage: bytes
) -> None:
    emb, compute = redis_cache(redis_server)
    redis_store = store_of(emb).store
    assert isinstance(redis_store, RedisByteStore)
    redis_store.mset([(emb.key("a"), garbage)])

    result = run(lambda: emb.aembed(["a", "b"]))
    assert (result.hits, result.misses) == (0, 2)
    assert_vectors(result, ["a", "b"])
    stats = emb.stats()
    assert (stats["corrupt_entries"], stats["store_errors"]) == (1, 1)
    (stored,) = redis_store.mget([emb.key("a")])
    assert stored is not None
    np.testing.assert_array_equal(codec.decode(stored, DIM), vec("a"))

    # A second replica (fresh memory tier) now reads the repaired entry from Redis.
    other, other_compute = redis_cache(redis_server)
    assert run(lambda: other.aembed(["a"])).hits == 1
    assert other_compute.calls == []
    assert compute.texts == ["a", "b"]
    store_of(emb).close()
    store_of(other).close()
