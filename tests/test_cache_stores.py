"""The cache's ByteStores behave like dicts of str -> bytes; the codec rejects bad entries."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from langchain_core.stores import ByteStore

from cache import codec, stores
from cache.stores import LmdbByteStore, MemoryByteStore, TieredByteStore, build_store
from tests.test_cache import BrokenStore

MiB = 1 << 20


StoreFactory = Callable[[Path], ByteStore]

FACTORIES: dict[str, StoreFactory] = {
    "memory": lambda _: MemoryByteStore(MiB),
    "lmdb": lambda p: LmdbByteStore(p / "db", 64 * MiB),
    "lmdb-small-scan-chunks": lambda p: LmdbByteStore(p / "db", 64 * MiB, scan_chunk=2),
    "lmdb-partitioned": lambda p: LmdbByteStore(p / "db", 64 * MiB, partitions=3, scan_chunk=2),
    "tiered-memory-lmdb": lambda p: TieredByteStore(
        MemoryByteStore(MiB), LmdbByteStore(p / "db", 64 * MiB)
    ),
    "tiered-memory-only": lambda _: TieredByteStore(MemoryByteStore(MiB), None),
    # A tiny memory tier in front: most reads are served by the store tier.
    "tiered-evicting": lambda p: TieredByteStore(
        MemoryByteStore(15), LmdbByteStore(p / "db", 64 * MiB)
    ),
}


@pytest.fixture(params=sorted(FACTORIES))
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ByteStore]:
    s = FACTORIES[request.param](tmp_path)
    yield s
    close = getattr(s, "close", None)
    if close is not None:
        close()


PAIRS = [("a:1", b"one"), ("a:2", b"two"), ("b:1", b"\x00\xffbin"), ("a:10", b"ten")]


def test_store_behaves_like_a_dict(store: ByteStore) -> None:
    assert store.mget(["a:1", "missing"]) == [None, None]
    store.mset(PAIRS)
    assert store.mget(["a:1", "b:1", "nope", "a:10"]) == [b"one", b"\x00\xffbin", None, b"ten"]
    store.mset([("a:1", b"ONE")])
    assert store.mget(["a:1"]) == [b"ONE"]
    assert sorted(store.yield_keys()) == ["a:1", "a:10", "a:2", "b:1"]
    assert sorted(store.yield_keys(prefix="a:")) == ["a:1", "a:10", "a:2"]
    assert sorted(store.yield_keys(prefix="a:1")) == ["a:1", "a:10"]
    assert list(store.yield_keys(prefix="zzz")) == []
    store.mdelete(["a:1", "never-there"])
    assert store.mget(["a:1", "a:2"]) == [None, b"two"]
    assert sorted(store.yield_keys()) == ["a:10", "a:2", "b:1"]
    store.mset([])
    store.mdelete([])


def test_store_async_forms_behave_like_a_dict(store: ByteStore) -> None:
    async def keys(it: AsyncIterator[str]) -> list[str]:
        return sorted([k async for k in it])

    async def scenario() -> None:
        assert await store.amget(["a:1"]) == [None]
        await store.amset(PAIRS)
        assert await store.amget(["a:2", "x", "b:1"]) == [b"two", None, b"\x00\xffbin"]
        assert await keys(store.ayield_keys()) == ["a:1", "a:10", "a:2", "b:1"]
        assert await keys(store.ayield_keys(prefix="a:")) == ["a:1", "a:10", "a:2"]
        await store.amdelete(["a:2", "b:1"])
        assert await store.amget(["a:2", "b:1", "a:1"]) == [None, None, b"one"]
        assert await keys(store.ayield_keys(prefix="b")) == []

    asyncio.run(scenario())


def test_contains_peeks_without_counting(store: ByteStore) -> None:
    store.mset(PAIRS[:2])
    assert isinstance(store, MemoryByteStore | LmdbByteStore | TieredByteStore)
    assert store.contains(["a:1", "zz", "a:2"]) == [True, False, True]
    assert asyncio.run(store.acontains(["zz", "a:2"])) == [False, True]
    if isinstance(store, TieredByteStore):
        assert store.memory_hits == store.store_hits == 0


# -- MemoryByteStore ---------------------------------------------------------------------


def test_memory_lru_is_bounded_by_key_plus_value_bytes() -> None:
    mem = MemoryByteStore(max_bytes=30)  # each entry below is 2 + 8 = 10 bytes
    mem.mset([("k1", b"x" * 8), ("k2", b"x" * 8), ("k3", b"x" * 8)])
    assert (mem.entries, mem.bytes) == (3, 30)
    mem.mget(["k1"])  # k1 becomes the most recently used
    mem.mset([("k4", b"x" * 8)])
    assert mem.mget(["k1", "k2", "k3", "k4"]) == [b"x" * 8, None, b"x" * 8, b"x" * 8]
    assert (mem.entries, mem.bytes, mem.evictions) == (3, 30, 1)
    mem.mset([("k3", b"y" * 18)])  # a bigger value for an existing key evicts the LRU ones
    assert mem.bytes <= 30
    assert mem.mget(["k3"]) == [b"y" * 18]
    mem.mset([("huge", b"z" * 100)])  # larger than the whole budget: not stored
    assert mem.mget(["huge"]) == [None]
    assert mem.bytes == sum(len(k) + len(v or b"") for k, v in zip(*_dump(mem), strict=True))


def _dump(mem: MemoryByteStore) -> tuple[list[str], list[bytes | None]]:
    keys = list(mem.yield_keys())
    return keys, mem.mget(keys)


def test_memory_store_with_zero_budget_stores_nothing() -> None:
    mem = MemoryByteStore(0)
    mem.mset([("k", b"v")])
    assert (mem.mget(["k"]), mem.entries, mem.bytes) == ([None], 0, 0)
    assert mem.keeps_nothing and not MemoryByteStore(1).keeps_nothing
    with pytest.raises(ValueError):
        MemoryByteStore(-1)


def test_memory_store_is_thread_safe() -> None:
    mem = MemoryByteStore(max_bytes=5_000)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(2_000):
                key = f"t{n}:{i % 97}"
                mem.mset([(key, b"v" * (i % 50))])
                mem.mget([key, f"t{(n + 1) % 4}:{i % 97}"])
                if i % 7 == 0:
                    mem.mdelete([key])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    keys, values = _dump(mem)
    assert mem.bytes == sum(len(k) + len(v or b"") for k, v in zip(keys, values, strict=True))
    assert mem.bytes <= 5_000


# -- LmdbByteStore -----------------------------------------------------------------------


def test_lmdb_survives_a_restart(tmp_path: Path) -> None:
    first = LmdbByteStore(tmp_path / "db", 64 * MiB)
    first.mset([("k", b"value"), ("j", b"other")])
    first.close()
    first.close()  # idempotent
    again = LmdbByteStore(tmp_path / "db", 64 * MiB)
    assert again.mget(["k", "j", "x"]) == [b"value", b"other", None]
    assert again.entries == 2
    assert again.info()["entries"] == 2
    again.close()


def test_lmdb_rejects_keys_it_cannot_hold(tmp_path: Path) -> None:
    db = LmdbByteStore(tmp_path / "db", 64 * MiB)
    with pytest.raises(ValueError):
        db.mset([("", b"v")])
    with pytest.raises(ValueError):
        db.mset([("k" * 600, b"v")])
    assert db.mget(["", "k" * 600]) == [None, None]  # lookups of impossible keys just miss
    db.close()


def test_lmdb_without_fsync_still_works(tmp_path: Path) -> None:
    db = LmdbByteStore(tmp_path / "db", 64 * MiB, sync=False)
    db.mset([("k", b"v")])
    assert db.mget(["k"]) == [b"v"]
    db.close()


def test_lmdb_reads_a_requests_keys_on_the_callers_thread_unless_large_or_from_the_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's lookup takes no hop to a thread and back (each a GIL handover behind a
    busy worker's loop: a miss's lookup 7.7-11.2 ms against 0.2 inline on an H100 host). A
    read larger than a request, and every read for a while after one that faulted pages in
    from the disk, go to a thread: the loop's other requests do not wait for a cold cache.
    A read that is only slow (its thread waiting for a core) changes nothing."""
    monkeypatch.setattr(stores, "COLD_READ_BACKOFF_S", 0.5)
    faults = [0]
    monkeypatch.setattr(stores, "_major_faults", lambda: faults[0])
    db = LmdbByteStore(tmp_path / "db", 64 * MiB)
    db.mset([("k", b"v")])
    read_on: list[int] = []
    mget, cold, slow = db.mget, [False], [False]

    def spy(keys: Sequence[str]) -> list[bytes | None]:
        read_on.append(threading.get_ident())
        faults[0] += cold[0]  # a page read from the disk
        if slow[0]:
            time.sleep(0.05)
        return mget(keys)

    db.mget = spy  # type: ignore[method-assign]

    async def reads() -> list[list[bytes | None]]:
        found = [await db.amget(["k", "x"])]  # inline
        found.append(await db.amget(["k"] * (stores.INLINE_READ_KEYS + 1)))  # a thread
        slow[0] = True
        found.append(await db.amget(["k"]))  # inline, slow but from memory
        slow[0], cold[0] = False, True
        found.append(await db.amget(["k"]))  # inline, cold
        cold[0] = False
        found.append(await db.amget(["k"]))  # a thread, for the backoff
        await asyncio.sleep(0.6)
        found.append(await db.amget(["k"]))  # inline again
        return found

    found = asyncio.run(reads())
    db.close()
    large = [b"v"] * (stores.INLINE_READ_KEYS + 1)
    assert found == [[b"v", None], large, [b"v"], [b"v"], [b"v"], [b"v"]]
    loop_thread = threading.get_ident()  # asyncio.run's loop runs on this thread
    inline = [thread == loop_thread for thread in read_on]
    assert inline == [True, False, True, True, False, True]


PARTITIONED = [(f"t1-ns:{i:064x}", bytes([i % 251]) * 100) for i in range(400)]


def test_a_partitioned_store_spreads_its_keys_and_keeps_its_layout(tmp_path: Path) -> None:
    """Its entries live across its partitions' environments, and a later open, whatever it
    asks, reads it as it was made (all the server's processes must agree where a key is)."""
    made = LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=4)
    made.mset(PARTITIONED)
    counts = [int(env.stat()["entries"]) for env in made._envs]
    assert len(counts) == 4 and min(counts) > 50 and sum(counts) == len(PARTITIONED)
    assert made.info()["partitions"] == 4 and made.info()["entries"] == len(PARTITIONED)
    made.close()
    other = LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=2)
    assert other.partitions == 4
    assert other.mget([k for k, _ in PARTITIONED]) == [v for _, v in PARTITIONED]
    other.mdelete([k for k, _ in PARTITIONED[:100]])
    assert sorted(other.yield_keys(prefix="t1-ns:")) == sorted(k for k, _ in PARTITIONED[100:])
    other.close()
    again = LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=1)
    assert again.partitions == 4 and again.entries == len(PARTITIONED) - 100
    again.close()


def test_a_cache_made_as_one_environment_stays_one(tmp_path: Path) -> None:
    """A data dir from before partitions (a ``data.mdb`` of its own) keeps its entries."""
    old = LmdbByteStore(tmp_path / "db", 64 * MiB)
    old.mset(PARTITIONED[:10])
    old.close()
    (tmp_path / "db" / "partitions").unlink()  # as a cache made before the file was
    reopened = LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=8)
    assert reopened.partitions == 1
    assert reopened.mget([k for k, _ in PARTITIONED[:10]]) == [v for _, v in PARTITIONED[:10]]
    reopened.close()


def test_links_are_written_before_and_deleted_after_what_they_point_at(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Across partitions a group is not one transaction: a failure between them leaves a
    link to nothing (a miss, computed again), never a vector that no link points at (which
    ``DELETE /v1/cache/entities`` could not find)."""
    store = LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=4)
    vectors = PARTITIONED[:40]
    links = [(f"link:ns:driver:d{i}", key.encode()) for i, (key, _) in enumerate(vectors)]
    real_put, real_delete = store._put, store._delete

    def put_links_only(partition: int, items: Sequence[tuple[bytes, bytes]]) -> None:
        if not all(k.startswith(b"link:") for k, _ in items):
            raise OSError("the disk failed")
        real_put(partition, items)

    monkeypatch.setattr(store, "_put", put_links_only)
    with pytest.raises(OSError):
        store.mset([*vectors, *links])  # one group, the links last in it
    assert store.mget([k for k, _ in links]) == [v for _, v in links]
    assert store.mget([k for k, _ in vectors]) == [None] * len(vectors)
    monkeypatch.setattr(store, "_put", real_put)
    store.mset([*vectors, *links])

    def delete_vectors_only(partition: int, keys: Sequence[bytes]) -> None:
        if any(k.startswith(b"link:") for k in keys):
            raise OSError("the disk failed")
        real_delete(partition, keys)

    monkeypatch.setattr(store, "_delete", delete_vectors_only)
    with pytest.raises(OSError):
        store.mdelete([k for k, _ in links] + [k for k, _ in vectors])
    assert store.mget([k for k, _ in vectors]) == [None] * len(vectors)
    assert store.mget([k for k, _ in links]) == [v for _, v in links]
    store.close()


def test_a_partitioned_store_without_fsync_empties_every_partition_after_an_os_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cache import boot

    crashed = LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=3, sync=False)
    crashed.mset(PARTITIONED)  # the OS goes down with it open: it never closes
    monkeypatch.setattr(boot, "current_boot_id", lambda: "a-boot-after-a-crash")
    store = LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=3, sync=False)
    assert store.emptied_at_open and store.entries == 0
    store.close()


def test_a_partitioned_store_needs_a_partition(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 1 partition"):
        LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=0)


# -- TieredByteStore ---------------------------------------------------------------------


def test_tiered_promotes_store_hits_to_memory(tmp_path: Path) -> None:
    lmdb_store = LmdbByteStore(tmp_path / "db", 64 * MiB)
    lmdb_store.mset([("k", b"v")])
    tiered = TieredByteStore(MemoryByteStore(MiB), lmdb_store)
    assert tiered.mget(["k", "x"]) == [b"v", None]
    assert (tiered.memory_hits, tiered.store_hits) == (0, 1)
    assert tiered.memory.mget(["k"]) == [b"v"]
    assert asyncio.run(tiered.amget(["k"])) == [b"v"]
    assert (tiered.memory_hits, tiered.store_hits) == (1, 1)
    tiered.mset([("n", b"new")])  # writes reach both tiers
    assert lmdb_store.mget(["n"]) == [b"new"]
    assert tiered.store_kind == "lmdb"
    tiered.close()


def test_tiered_survives_a_broken_store(caplog: pytest.LogCaptureFixture) -> None:
    tiered = TieredByteStore(MemoryByteStore(MiB), BrokenStore(), retry_after_s=0)
    assert not tiered.store_degraded
    with caplog.at_level(logging.WARNING, logger="fleetcache.cache"):
        tiered.mset([("k", b"v")])
        assert tiered.mget(["k", "x"]) == [b"v", None]
        assert asyncio.run(tiered.amget(["y"])) == [None]
        asyncio.run(tiered.amset([("z", b"zz")]))
        assert tiered.memory.mget(["z"]) == [b"zz"]
        tiered.mdelete(["k"])
        assert tiered.mget(["k"]) == [None]
        assert sorted(tiered.yield_keys()) == ["z"]
        assert tiered.contains(["z", "q"]) == [True, False]
    assert tiered.store_errors >= 6
    assert tiered.store_kind == "broken"
    health = tiered.info()["store"]
    assert health["degraded"] is True
    assert health["last_error"] is not None and "store down" in health["last_error"]
    assert health["last_error_at"] is not None
    assert any("store down" in r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 1  # throttled: one warning, not one per failure


class FlakyStore(MemoryByteStore):
    """A second tier that can be switched off and on, counting the calls that reach it."""

    kind = "flaky"

    def __init__(self) -> None:
        super().__init__(MiB)
        self.down = False
        self.calls = 0

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        self.calls += 1
        if self.down:
            raise ConnectionError("store down")
        return super().mget(keys)

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("store down")
        super().mset(key_value_pairs)


def test_tiered_skips_a_degraded_store_then_recovers_by_itself() -> None:
    now = [100.0]
    flaky = FlakyStore()
    tiered = TieredByteStore(MemoryByteStore(MiB), flaky, retry_after_s=2.0, clock=lambda: now[0])
    flaky.down = True
    assert tiered.mget(["a"]) == [None]
    assert tiered.store_degraded and tiered.store_errors == 1
    calls = flaky.calls
    tiered.mset([("b", b"2")])  # within retry_after_s: memory only, the store is not called
    assert tiered.mget(["c"]) == [None]
    assert (flaky.calls, tiered.store_skipped, tiered.store_errors) == (calls, 2, 1)
    assert tiered.mget(["b"]) == [b"2"]  # memory still serves

    flaky.down = False
    now[0] += 2.0
    tiered.mset([("d", b"4")])  # the first call after retry_after_s tries and succeeds
    assert not tiered.store_degraded
    assert flaky.mget(["d"]) == [b"4"]
    assert tiered.info()["store"]["degraded"] is False


def test_tiered_rejects_a_negative_retry_after() -> None:
    with pytest.raises(ValueError):
        TieredByteStore(MemoryByteStore(MiB), None, retry_after_s=-1)


def test_tiered_yields_each_key_once(tmp_path: Path) -> None:
    tiered = TieredByteStore(MemoryByteStore(MiB), LmdbByteStore(tmp_path / "db", 64 * MiB))
    tiered.mset([("p:1", b"1"), ("p:2", b"2")])
    tiered.store.mset([("p:3", b"3")])  # type: ignore[union-attr]  # only in the store tier
    tiered.memory.mset([("p:4", b"4")])  # only in memory (its store write failed)
    assert sorted(tiered.yield_keys(prefix="p:")) == ["p:1", "p:2", "p:3", "p:4"]
    tiered.close()


def test_build_store_kinds(tmp_path: Path) -> None:
    lmdb_tiered = build_store("lmdb", memory_bytes=MiB, data_dir=tmp_path, map_size=64 * MiB)
    assert lmdb_tiered.store_kind == "lmdb"
    assert (tmp_path / "cache.lmdb").is_dir()
    lmdb_tiered.close()
    assert build_store("memory", memory_bytes=MiB).store_kind == "none"
    with pytest.raises(ValueError, match="redis_url"):
        build_store("redis", memory_bytes=MiB)
    with pytest.raises(ValueError):
        build_store("sqlite", memory_bytes=MiB)


# -- codec -------------------------------------------------------------------------------


def test_codec_roundtrip_float32_is_exact_and_compact() -> None:
    vec = np.random.default_rng(0).standard_normal(384).astype(np.float32)
    data = codec.encode(vec)
    assert len(data) == codec.encoded_size(384) == 12 + 384 * 4
    out = codec.decode(data, expected_dim=384)
    assert out.dtype == np.float32
    assert np.array_equal(out, vec)
    assert codec.decode(data) is not None  # dim check is optional


def test_codec_float16_halves_the_payload() -> None:
    vec = np.random.default_rng(1).standard_normal(384).astype(np.float32)
    data = codec.encode(vec, "float16")
    assert len(data) == 12 + 384 * 2
    out = codec.decode(data, 384)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, vec, rtol=1e-3, atol=1e-3)


GOOD = codec.encode(np.arange(8, dtype=np.float32))


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"garbage",
        GOOD[:-1],  # truncated payload
        GOOD[:10],  # truncated header
        GOOD + b"\x00",  # trailing bytes
        b"XX" + GOOD[2:],  # magic
        GOOD[:2] + b"\x09" + GOOD[3:],  # unknown version
        GOOD[:3] + b"\x07" + GOOD[4:],  # unknown dtype
        GOOD[:-1] + bytes([GOOD[-1] ^ 1]),  # flipped bit: crc mismatch
        codec.encode(np.arange(4, dtype=np.float32)),  # wrong dim
    ],
)
def test_codec_rejects_corrupt_entries(bad: bytes) -> None:
    with pytest.raises(codec.CorruptEntryError):
        codec.decode(bad, expected_dim=8)


def test_codec_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        codec.encode(np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError):
        codec.encode(np.zeros(2, np.float32), "int8")  # type: ignore[arg-type]


def test_group_commit_takes_calls_up_to_max_group_entries(tmp_path: Path) -> None:
    """Writes queued behind a transaction go in the next ones together, each taking calls
    until it holds ``max_group`` entries (whole calls: one may pass the mark), so that a write
    behind a backlog waits for one transaction, not one of the whole backlog."""
    transactions: list[int] = []

    class Counted(LmdbByteStore):
        async def _commit(self, items: Sequence[tuple[str, bytes]]) -> None:
            transactions.append(len(items))
            await super()._commit(items)

    store = Counted(tmp_path / "db", 16 * 1024 * 1024, max_group=3)
    calls = [[(f"k{i}:{j}", b"v") for j in range(2)] for i in range(5)]

    async def scenario() -> None:
        await asyncio.gather(*(store.amset(pairs) for pairs in calls))

    asyncio.run(scenario())
    assert transactions == [4, 4, 2]
    assert all(v == b"v" for v in store.mget([k for pairs in calls for k, _ in pairs]))
    store.close()
