"""CachedEmbedder: what is served from cache, what reaches the engine, and how it is counted."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
from langchain_core.stores import BaseStore, ByteStore

from cache import codec
from cache.embedder import CachedEmbedder, EmbedResult
from cache.flight import SingleFlight
from cache.links import Entity
from cache.stores import LmdbByteStore, MemoryByteStore, TieredByteStore
from engines.base import EngineError

DIM = 8
MiB = 1 << 20
T = TypeVar("T")


def vec(text: str) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(text.encode()).digest()[:8], "little")
    v = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return v / np.linalg.norm(v)


class FakeCompute:
    """Records every call; can be held at a gate or made to fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def __call__(self, texts: Sequence[str], lane: str) -> np.ndarray:
        self.calls.append((list(texts), lane))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        return np.stack([vec(t) for t in texts])

    @property
    def texts(self) -> list[str]:
        return [t for texts, _ in self.calls for t in texts]


class BrokenStore(BaseStore[str, bytes]):
    """A second tier that is down (Redis unreachable, disk gone)."""

    kind = "broken"

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        raise ConnectionError("store down")

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        raise ConnectionError("store down")

    def mdelete(self, keys: Sequence[str]) -> None:
        raise ConnectionError("store down")

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        raise ConnectionError("store down")


class CountingStore(BaseStore[str, bytes]):
    """Passes through to ``inner`` and counts finished ``amget`` calls."""

    def __init__(self, inner: ByteStore) -> None:
        self.inner = inner
        self.amgets = 0
        self.written: list[str] = []

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        return self.inner.mget(keys)

    async def amget(self, keys: Sequence[str]) -> list[bytes | None]:
        values = await self.inner.amget(keys)
        self.amgets += 1
        return values

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        self.written += [k for k, _ in key_value_pairs]
        self.inner.mset(key_value_pairs)

    def mdelete(self, keys: Sequence[str]) -> None:
        self.inner.mdelete(keys)

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        return iter(list(self.inner.yield_keys(prefix=prefix)))


def memory_cache(**kw: Any) -> tuple[CachedEmbedder, FakeCompute]:
    compute = FakeCompute()
    store = kw.pop("store", None) or TieredByteStore(MemoryByteStore(MiB), None)
    kw.setdefault("namespace", "fake-v1")
    return CachedEmbedder(compute, store, dim=DIM, **kw), compute


def run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    async def main() -> T:
        return await coro_fn()

    return asyncio.run(main())


async def until(predicate: Callable[[], bool]) -> None:
    for _ in range(10_000):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never became true")


def assert_vectors(result: EmbedResult, texts: list[str]) -> None:
    assert result.vectors.shape == (len(texts), DIM)
    assert result.vectors.dtype == np.float32
    np.testing.assert_array_equal(result.vectors, np.stack([vec(t) for t in texts]))


# -- what reaches the engine ---------------------------------------------------------------


def test_repeated_texts_are_served_from_cache() -> None:
    emb, compute = memory_cache()

    async def scenario() -> tuple[EmbedResult, EmbedResult]:
        return await emb.aembed(["a", "b", "c"]), await emb.aembed(["a", "b", "d"])

    first, second = run(scenario)
    assert (first.hits, first.coalesced, first.misses) == (0, 0, 3)
    assert (second.hits, second.coalesced, second.misses, second.not_sent) == (2, 0, 1, 2)
    assert second.statuses == ("hit", "hit", "miss")
    assert compute.texts == ["a", "b", "c", "d"]
    assert_vectors(first, ["a", "b", "c"])
    assert_vectors(second, ["a", "b", "d"])
    stats = emb.stats()
    assert (stats["hits"], stats["misses"], stats["coalesced"]) == (2, 4, 0)
    assert stats["hit_ratio"] == pytest.approx(2 / 6)


def test_empty_request_is_an_empty_result() -> None:
    emb, compute = memory_cache()
    result = run(lambda: emb.aembed([]))
    assert result.vectors.shape == (0, DIM)
    assert (result.hits, result.misses, result.statuses) == (0, 0, ())
    assert compute.calls == []


def test_duplicates_inside_one_request_are_computed_once() -> None:
    emb, compute = memory_cache()
    result = run(lambda: emb.aembed(["x", "x", "x"]))
    assert (result.hits, result.coalesced, result.misses) == (0, 2, 1)
    assert result.statuses == ("miss", "coalesced", "coalesced")
    assert result.not_sent == 2
    assert compute.calls == [(["x"], "dispatch")]
    assert_vectors(result, ["x", "x", "x"])


def test_the_write_back_stores_each_text_under_the_key_its_caller_hashed() -> None:
    """A caller that hashed its texts for its lookup hands the keys over: each new text is
    written under its own key (the first caller's, for a text computed once)."""
    written: list[tuple[list[str], list[str] | None]] = []

    async def write_back(
        texts: list[str], rows: np.ndarray, ttl_s: Any, keys: list[str] | None, links: Any
    ) -> bool:
        assert rows.shape == (len(texts), DIM)
        written.append((texts, keys))
        return True

    async def scenario() -> None:
        compute = FakeCompute()
        compute.gate = asyncio.Event()
        flight = SingleFlight(compute, DIM, write_back=write_back)
        first = asyncio.ensure_future(
            flight.embed(["a", "b", "a"], lane="dispatch", caller="c", keys=["ka", "kb", "ka"])
        )
        await asyncio.sleep(0)
        others = [
            asyncio.ensure_future(
                flight.embed(["b", "c"], lane="dispatch", caller="c", keys=["kb", "kc"])
            ),
            asyncio.ensure_future(flight.embed(["d"], lane="dispatch", caller="c")),  # no keys
        ]
        await asyncio.sleep(0)  # all three in flight
        compute.gate.set()
        await asyncio.gather(first, *others)

    asyncio.run(scenario())
    assert sorted(written) == [(["a", "b"], ["ka", "kb"]), (["c"], ["kc"]), (["d"], None)]

    async def miscounted() -> int:
        flight = SingleFlight(FakeCompute(), DIM, write_back=write_back)
        with pytest.raises(ValueError, match="2 store keys for 3 texts"):
            await flight.embed(["x", "y", "z"], lane="dispatch", caller="c", keys=["kx", "ky"])
        return flight.in_flight

    assert asyncio.run(miscounted()) == 0  # nothing left in flight that nobody computes


def test_rows_shared_by_coalesced_callers_are_read_only_and_copied_unless_handed_over() -> None:
    """Callers coalesced on one computation share its rows: read-only. A compute that keeps
    its arrays (the default) gets a copy made, so it may still write them; one that hands
    them over (``own_rows``, the batcher's) has them kept as they are."""
    kept: list[np.ndarray] = []

    async def compute(texts: Sequence[str], lane: str) -> np.ndarray:
        kept.append(np.stack([vec(t) for t in texts]))
        return kept[-1]

    async def rows(own_rows: bool) -> np.ndarray:
        flight = SingleFlight(compute, DIM, own_rows=own_rows)
        return (await flight.embed(["a", "b"], lane="dispatch", caller="c")).rows

    copied = asyncio.run(rows(False))
    assert copied is not kept[-1] and kept[-1].flags.writeable and not copied.flags.writeable
    kept[-1][:] = 0.0  # the compute's own array: the callers' rows do not change
    assert np.array_equal(copied, np.stack([vec("a"), vec("b")]))
    handed = asyncio.run(rows(True))
    assert handed is kept[-1] and not handed.flags.writeable


def test_each_caller_of_a_merged_call_joins_by_its_own_lookup_s_time() -> None:
    """A worker merges callers' misses into one call. With the latest caller's ``since`` for
    the whole call, a text written back between the two lookups was computed again for the
    first caller, whose lookup began before the write (tests/test_devices.py saw one text of
    eight computed twice through two engines)."""

    async def write_back(*_: Any) -> bool:
        return True

    async def scenario() -> None:
        compute = FakeCompute()
        flight = SingleFlight(compute, DIM, write_back=write_back, recent=8)
        first = time.monotonic()  # the first caller's lookup: "a" not yet stored
        await flight.embed(["a"], lane="dispatch", caller="c")  # computed, written back
        second = time.monotonic()  # the second caller's lookup: "a" was in the store for it
        merged = await flight.embed(
            ["a", "z"], lane="dispatch", caller="c", since=[[1, first], [1, second]]
        )
        assert merged.coalesced == [True, False]  # the first caller's "a" joins the write
        apart = await flight.embed(
            ["a", "y"], lane="dispatch", caller="c", since=[[1, second], [1, first]]
        )
        assert apart.coalesced == [False, False]  # looked up after the write: computed
        assert [texts for texts, _ in compute.calls] == [["a"], ["z"], ["a", "y"]]
        with pytest.raises(ValueError):
            await flight.embed(["a", "b"], lane="dispatch", caller="c", since=[[1, first]])

    asyncio.run(scenario())


def test_texts_just_written_back_stay_joinable_for_a_lookup_that_began_before() -> None:
    """A caller whose store lookup began before a text's write-back landed (``since``)
    joins it as coalesced instead of computing it again; one whose lookup began after
    computes it (it was in the store for it); the window keeps the last ``recent // 2`` to
    ``recent`` texts written (two generations), older ones are computed again."""

    async def write_back(*_: Any) -> bool:
        return True

    async def scenario() -> None:
        compute = FakeCompute()
        flight = SingleFlight(compute, DIM, write_back=write_back, recent=4)
        before = time.monotonic()
        await flight.embed(["a", "b"], lane="dispatch", caller="c")  # durable: written back
        joined = await flight.embed(["a", "x"], lane="dispatch", caller="c", since=before)
        assert joined.coalesced == [True, False]
        np.testing.assert_array_equal(joined.rows[0], vec("a"))
        after = time.monotonic()
        again = await flight.embed(["b"], lane="dispatch", caller="c", since=after)
        assert again.coalesced == [False]  # looked up after the write: the store had it
        await flight.embed(["c", "d", "e", "f"], lane="dispatch", caller="c")  # 2 generations
        late = await flight.embed(["a", "e"], lane="dispatch", caller="c", since=before)
        assert late.coalesced == [False, True]  # "a" left the window, "e" is in it
        assert [texts for texts, _ in compute.calls] == [
            ["a", "b"], ["x"], ["b"], ["c", "d", "e", "f"], ["a"]
        ]  # fmt: skip

    asyncio.run(scenario())


def test_new_texts_wait_while_the_store_is_behind() -> None:
    """Computed rows waiting for a slow store are bounded: past ``max_unwritten`` a call with
    new texts waits before computing (warm-up from half the bound), one whose texts are all
    in flight does not, and each ended write-back (a failed one too) makes room."""
    release: list[asyncio.Event] = []  # one per write-back, in order

    async def write_back(texts: list[str], *_: Any) -> bool:
        gate = asyncio.Event()
        release.append(gate)
        await gate.wait()
        if texts == ["fails"]:
            raise RuntimeError("store down")
        return True

    async def scenario() -> None:
        compute = FakeCompute()
        flight = SingleFlight(compute, DIM, write_back=write_back, max_unwritten=4)

        def embed(texts: list[str], lane: str = "dispatch") -> asyncio.Future[Any]:
            call = flight.embed(texts, lane=lane, caller="c", durable=False)
            return asyncio.ensure_future(call)

        await embed(["a", "b"])  # answered before its write-back
        await embed(["fails"])
        warmup = embed(["w"], lane="warmup")  # 3 unwritten, over half the bound: waits
        await embed(["c"])  # dispatch: 3 < 4
        assert flight.unwritten == 4
        late = embed(["d", "a"])  # a new text: waits
        assert (await embed(["c", "a"])).coalesced == [True, True]  # all in flight: served
        await asyncio.sleep(0.01)
        assert not late.done() and not warmup.done()
        assert (compute.texts, flight.store_waits, flight.in_flight) == (
            ["a", "b", "fails", "c"],
            2,
            4,  # "d" not in the map while it waits
        )
        release[1].set()  # the failed write-back makes room too
        assert (await late).coalesced == [False, True]
        assert not warmup.done()  # 4 unwritten again
        for gate in release:
            gate.set()
        await warmup
        assert compute.texts == ["a", "b", "fails", "c", "d", "w"]
        release[-1].set()  # "w"'s own
        await flight.drain(1.0)
        assert (flight.unwritten, flight.in_flight) == (0, 0)

    asyncio.run(scenario())


def test_an_entity_whose_text_was_cached_is_linked_with_the_call_s_new_vectors() -> None:
    """A call's entities whose texts were found in the store are linked in the same store
    call as its new vectors (one LMDB transaction), so its own relink writes nothing more."""
    batches: list[list[str]] = []

    class Recording(CountingStore):
        def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
            batches.append([k for k, _ in key_value_pairs])
            super().mset(key_value_pairs)

    store = TieredByteStore(MemoryByteStore(MiB), Recording(MemoryByteStore(MiB)))
    emb, compute = memory_cache(store=store)
    run(lambda: emb.aembed_entities([Entity("driver", "a", "t1")]))
    batches.clear()
    both = [Entity("driver", "b", "t1"), Entity("driver", "c", "t2")]
    result = run(lambda: emb.aembed_entities(both))
    assert (result.hits, result.misses, compute.texts) == (1, 1, ["t1", "t2"])
    link = emb.links.key
    assert batches == [[emb.key("t2"), link("driver", "b"), link("driver", "c")]]
    assert store.mget([link("driver", "b"), link("driver", "c")]) == [
        emb.key("t1").encode(),
        emb.key("t2").encode(),
    ]


def test_concurrent_identical_requests_compute_once() -> None:
    emb, compute = memory_cache()

    async def scenario() -> list[EmbedResult]:
        return await asyncio.gather(*(emb.aembed(["new"]) for _ in range(50)))

    results = run(scenario)
    assert compute.texts == ["new"]
    assert sum(r.misses for r in results) == 1
    assert sum(r.coalesced for r in results) == 49
    assert all(np.array_equal(r.vectors, results[0].vectors) for r in results)
    stats = emb.stats()
    assert (stats["hits"], stats["coalesced"], stats["misses"]) == (0, 49, 1)


def test_concurrent_identical_requests_over_lmdb_compute_once(tmp_path: Path) -> None:
    counting = CountingStore(LmdbByteStore(tmp_path / "db", 64 * MiB))
    emb, compute = memory_cache(store=TieredByteStore(MemoryByteStore(MiB), counting))
    compute.gate = asyncio.Event()

    async def scenario() -> list[EmbedResult]:
        tasks = [asyncio.create_task(emb.aembed(["new"])) for _ in range(50)]
        await until(lambda: counting.amgets == 50)  # every request has looked it up
        assert compute.gate is not None
        compute.gate.set()
        return await asyncio.gather(*tasks)

    results = run(scenario)
    assert compute.texts == ["new"]
    assert (sum(r.misses for r in results), sum(r.coalesced for r in results)) == (1, 49)
    assert all(np.array_equal(r.vectors, results[0].vectors) for r in results)
    assert counting.written == [emb.key("new")]  # written once, by the request that computed it
    assert run(lambda: emb.aembed(["new"])).hits == 1


def test_counts_stay_exact_under_overlapping_concurrency() -> None:
    emb, compute = memory_cache()
    rng = np.random.default_rng(7)
    requests = [[f"t{int(i)}" for i in rng.integers(0, 40, size=12)] for _ in range(60)]

    async def scenario() -> list[EmbedResult]:
        await emb.aembed(["t1", "t2", "t3"])  # a few warm entries
        out = []
        for wave in range(0, 60, 20):  # later waves find earlier ones cached
            out += await asyncio.gather(*(emb.aembed(r) for r in requests[wave : wave + 20]))
        return out

    results = run(scenario)
    looked_up = 3 + sum(len(r) for r in requests)
    stats = emb.stats()
    assert stats["hits"] + stats["coalesced"] + stats["misses"] == looked_up
    assert stats["misses"] == len(compute.texts) == len(set(compute.texts))
    assert set(compute.texts) == {t for r in requests for t in r} | {"t1", "t2", "t3"}
    for result, texts in zip(results, requests, strict=True):
        assert result.hits + result.coalesced + result.misses == len(texts)
        assert result.statuses.count("hit") == result.hits
        assert_vectors(result, texts)


def test_compute_error_reaches_every_waiter_and_is_not_cached() -> None:
    store = TieredByteStore(MemoryByteStore(MiB), None)
    emb, compute = memory_cache(store=store)
    compute.gate = asyncio.Event()
    compute.fail = EngineError("GPU fell over")

    async def scenario() -> list[BaseException | EmbedResult]:
        tasks = [
            asyncio.create_task(emb.aembed(["e", "f"])),
            asyncio.create_task(emb.aembed(["e"])),  # coalesced on the first request
            asyncio.create_task(emb.aembed(["f", "f"])),
        ]
        await until(lambda: len(compute.calls) == 1)
        await asyncio.sleep(0)
        assert compute.gate is not None
        compute.gate.set()
        return await asyncio.gather(*tasks, return_exceptions=True)

    outcomes = run(scenario)
    assert all(isinstance(o, EngineError) for o in outcomes), outcomes
    assert compute.calls == [(["e", "f"], "dispatch")]
    assert list(store.yield_keys()) == []  # nothing written
    assert emb.stats()["failed_calls"] == 3

    compute.gate, compute.fail = None, None
    retry = run(lambda: emb.aembed(["e"]))
    assert (retry.hits, retry.misses) == (0, 1)
    assert compute.calls[-1] == (["e"], "dispatch")


def test_compute_returning_the_wrong_shape_is_an_engine_error() -> None:
    async def bad_compute(texts: Sequence[str], lane: str) -> np.ndarray:
        return np.zeros((len(texts), DIM + 1), np.float32)

    emb = CachedEmbedder(bad_compute, TieredByteStore(MemoryByteStore(MiB)), namespace="n", dim=DIM)
    with pytest.raises(EngineError, match="shape"):
        run(lambda: emb.aembed(["a"]))


def test_a_cancelled_request_does_not_fail_the_requests_coalesced_on_it() -> None:
    emb, compute = memory_cache()
    compute.gate = asyncio.Event()

    async def scenario() -> EmbedResult:
        owner = asyncio.create_task(emb.aembed(["slow"]))
        await until(lambda: len(compute.calls) == 1)
        follower = asyncio.create_task(emb.aembed(["slow"]))
        await asyncio.sleep(0)
        owner.cancel()
        await asyncio.sleep(0)
        assert compute.gate is not None
        compute.gate.set()
        result = await follower
        await emb.aclose()  # waits for the write-back the departed owner left behind
        return result

    result = run(scenario)
    assert (result.coalesced, result.misses) == (1, 0)
    assert_vectors(result, ["slow"])
    assert len(compute.calls) == 1
    assert emb.stats()["in_flight"] == 0
    assert run(lambda: emb.aembed(["slow"])).hits == 1  # written back all the same


# -- persistence, namespaces, corruption, failing stores -------------------------------------


def test_vectors_survive_a_restart(tmp_path: Path) -> None:
    def open_cache() -> tuple[CachedEmbedder, FakeCompute]:
        store = TieredByteStore(MemoryByteStore(MiB), LmdbByteStore(tmp_path / "db", 64 * MiB))
        return memory_cache(store=store)

    first, _ = open_cache()
    run(lambda: first.aembed(["a", "b"]))
    run(first.aclose)

    second, compute2 = open_cache()
    result = run(lambda: second.aembed(["a", "b"]))
    assert (result.hits, result.misses) == (2, 0)
    assert compute2.calls == []
    assert_vectors(result, ["a", "b"])
    tiers = second.stats()["tiers"]
    assert (tiers["store"]["hits"], tiers["store"]["kind"]) == (2, "lmdb")
    run(second.aclose)


def test_namespaces_do_not_share_vectors(tmp_path: Path) -> None:
    store = TieredByteStore(MemoryByteStore(MiB), LmdbByteStore(tmp_path / "db", 64 * MiB))
    fp16, _ = memory_cache(store=store, namespace="engine-fp16")
    fp32, compute_b = memory_cache(store=store, namespace="engine-fp32")
    run(lambda: fp16.aembed(["a"]))
    result = run(lambda: fp32.aembed(["a"]))
    assert (result.hits, result.misses) == (0, 1)
    assert compute_b.texts == ["a"]
    assert fp16.key("a") != fp32.key("a")
    assert fp16.key("a").startswith("engine-fp16:")
    store.close()


# garbage, truncated and wrong-dim entries, shared by the LMDB and Redis corruption tests
GOOD_OTHER_DIM = codec.encode(np.ones(DIM * 2, np.float32))
CORRUPT_VALUES = [b"not a vector at all", codec.encode(vec("a"))[:-3], GOOD_OTHER_DIM]
CORRUPT_IDS = ["garbage", "truncated", "wrong-dim"]


@pytest.mark.parametrize(
    "garbage",
    CORRUPT_VALUES,
    ids=CORRUPT_IDS,
)
def test_corrupt_entry_is_a_miss_and_is_overwritten(tmp_path: Path, garbage: bytes) -> None:
    lmdb_store = LmdbByteStore(tmp_path / "db", 64 * MiB)
    emb, compute = memory_cache(store=TieredByteStore(MemoryByteStore(MiB), lmdb_store))
    lmdb_store.mset([(emb.key("a"), garbage)])

    result = run(lambda: emb.aembed(["a", "b"]))
    assert (result.hits, result.misses) == (0, 2)
    assert compute.texts == ["a", "b"]
    assert_vectors(result, ["a", "b"])
    stats = emb.stats()
    assert (stats["corrupt_entries"], stats["store_errors"]) == (1, 1)
    (stored,) = lmdb_store.mget([emb.key("a")])
    assert stored is not None
    np.testing.assert_array_equal(codec.decode(stored, DIM), vec("a"))
    assert run(lambda: emb.aembed(["a"])).hits == 1
    lmdb_store.close()


@pytest.mark.parametrize("tiered", [True, False], ids=["tiered", "bare"])
def test_a_failing_store_never_fails_the_request(tiered: bool) -> None:
    store: ByteStore = (
        TieredByteStore(MemoryByteStore(MiB), BrokenStore()) if tiered else BrokenStore()
    )
    emb, _ = memory_cache(store=store)
    first = run(lambda: emb.aembed(["a", "b"]))
    assert first.misses == 2
    assert_vectors(first, ["a", "b"])
    second = run(lambda: emb.aembed(["a"]))
    # The memory tier still works when only the second tier is down.
    assert (second.hits, second.misses) == ((1, 0) if tiered else (0, 1))
    stats = emb.stats()
    assert stats["store_errors"] >= 1
    assert stats["tiers"]["store"]["kind"] == "broken"
    assert stats["tiers"]["store"]["degraded"] is tiered


def test_store_hits_are_promoted_to_memory(tmp_path: Path) -> None:
    lmdb_store = LmdbByteStore(tmp_path / "db", 64 * MiB)
    writer, _ = memory_cache(store=TieredByteStore(MemoryByteStore(MiB), lmdb_store))
    run(lambda: writer.aembed(["a", "b"]))

    reader, compute = memory_cache(store=TieredByteStore(MemoryByteStore(MiB), lmdb_store))
    run(lambda: reader.aembed(["a", "b"]))  # from LMDB
    run(lambda: reader.aembed(["a"]))  # from memory
    tiers = reader.stats()["tiers"]
    assert (tiers["store"]["hits"], tiers["memory"]["hits"]) == (2, 1)
    assert tiers["memory"]["entries"] == 2
    assert compute.calls == []
    lmdb_store.close()


def test_float16_entries_are_half_the_size(tmp_path: Path) -> None:
    lmdb_store = LmdbByteStore(tmp_path / "db", 64 * MiB)
    emb, _ = memory_cache(store=lmdb_store, dtype="float16")
    run(lambda: emb.aembed(["a"]))
    (stored,) = lmdb_store.mget([emb.key("a")])
    assert stored is not None and len(stored) == codec.encoded_size(DIM, "float16")
    hit = run(lambda: emb.aembed(["a"]))
    assert hit.hits == 1
    np.testing.assert_allclose(hit.vectors[0], vec("a"), atol=1e-3)
    lmdb_store.close()


def test_contains_peeks_without_counting() -> None:
    emb, _ = memory_cache()
    run(lambda: emb.aembed(["a"]))
    assert run(lambda: emb.acontains(["a", "b"])) == [True, False]
    stats = emb.stats()
    assert (stats["hits"], stats["misses"]) == (0, 1)


# -- counting for /v1/stats ------------------------------------------------------------------


def test_ms_saved_uses_the_per_item_cost_at_each_avoided_call() -> None:
    cost = [0.0]
    emb, _ = memory_cache(per_item_ms=lambda: cost[0])

    async def scenario() -> None:
        cost[0] = 9.0
        await emb.aembed(["a", "b", "c"])  # all misses: nothing saved
        cost[0] = 2.0
        await emb.aembed(["a", "b", "c"])  # 3 avoided x 2.0
        cost[0] = 5.0
        await emb.aembed(["a", "d", "d"])  # 1 hit + 1 coalesced x 5.0

    run(scenario)
    assert emb.savings() == {"calls_avoided": 5, "ms_saved": pytest.approx(16.0)}


def test_windows_count_recent_lookups_only() -> None:
    now = [1000.0]
    emb, _ = memory_cache(clock=lambda: now[0])
    run(lambda: emb.aembed(["a", "b"]))  # t=1000: 2 misses
    now[0] = 1090.0
    run(lambda: emb.aembed(["a", "c", "c"]))  # t=1090: 1 hit, 1 coalesced, 1 miss
    windows = emb.stats()["windows"]
    assert windows["1m"] == {"hits": 2, "misses": 1, "hit_ratio": pytest.approx(2 / 3)}
    assert windows["5m"] == {"hits": 2, "misses": 3, "hit_ratio": pytest.approx(0.4)}
    now[0] = 1000.0 + 301
    windows = emb.stats()["windows"]
    assert windows["5m"] == {"hits": 2, "misses": 1, "hit_ratio": pytest.approx(2 / 3)}
    now[0] = 5000.0
    windows = emb.stats()["windows"]
    assert windows["1m"] == windows["5m"] == {"hits": 0, "misses": 0, "hit_ratio": 0.0}


def test_by_caller_and_lanes() -> None:
    emb, compute = memory_cache()

    async def scenario() -> None:
        await emb.aembed(["a", "b"], caller="warmup")
        await emb.aembed(["a", "c", "c"])
        await emb.aembed(["d"], caller="dispatch", lane="warmup")

    run(scenario)
    assert [lane for _, lane in compute.calls] == ["warmup", "dispatch", "warmup"]
    assert emb.by_caller() == {
        "warmup": {"hits": 0, "misses": 2, "coalesced": 0},
        "dispatch": {"hits": 2, "misses": 2, "coalesced": 1},  # hits = not sent to the engine
    }


def test_caller_names_are_bounded() -> None:
    emb, _ = memory_cache()

    async def scenario() -> None:
        for i in range(100):
            await emb.aembed(["a"], caller=f"job-{i}")

    run(scenario)
    callers = emb.by_caller()
    assert len(callers) <= 65
    assert sum(c["hits"] + c["misses"] for c in callers.values()) == 100


def test_stats_have_the_api_shape() -> None:
    emb, _ = memory_cache()
    stats = emb.stats()
    assert stats["hit_ratio"] == 0.0
    assert {"hits", "misses", "coalesced", "hit_ratio", "tiers", "windows"} <= stats.keys()
    assert {"hits", "entries"} <= stats["tiers"]["memory"].keys()
    assert {"hits", "kind"} <= stats["tiers"]["store"].keys()
    assert stats["tiers"]["store"]["kind"] == "none"
    assert set(stats["windows"]) == {"1m", "5m"}
    assert emb.savings() == {"calls_avoided": 0, "ms_saved": 0.0}
    assert emb.by_caller() == {}


def test_it_is_a_langchain_embeddings() -> None:
    emb, _ = memory_cache()
    warm = emb.with_caller("warmup")

    async def scenario() -> tuple[list[list[float]], list[float]]:
        docs = await warm.aembed_documents(["a", "b"])
        query = await emb.aembed_query("a")
        return docs, query

    docs, query = run(scenario)
    assert isinstance(docs[0][0], float)
    np.testing.assert_allclose(query, vec("a"))
    assert emb.by_caller()["warmup"]["misses"] == 2
    assert emb.by_caller()["dispatch"]["hits"] == 1
    with pytest.raises(NotImplementedError):
        emb.embed_documents(["a"])


def test_namespace_must_be_usable() -> None:
    store = TieredByteStore(MemoryByteStore(MiB))
    for bad in ["", "has space", "x" * 300]:
        with pytest.raises(ValueError):
            CachedEmbedder(FakeCompute(), store, namespace=bad, dim=DIM)
    with pytest.raises(ValueError):
        CachedEmbedder(FakeCompute(), store, namespace="n", dim=DIM, dtype="int8")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_encode_many_writes_the_same_entries_as_encode(dtype: codec.Dtype) -> None:
    rows = np.random.default_rng(1).standard_normal((6, 384), dtype=np.float32)
    expiry = [None, 1.8e9, None, 2.0e9, 5.5, None]
    entries = codec.encode_many(list(rows), dtype, expires_at=expiry)
    assert entries == [
        codec.encode(r, dtype, expires_at=e) for r, e in zip(rows, expiry, strict=True)
    ]
    for expiries in ([None] * 6, [1.8e9 + i for i in range(6)], expiry):  # one matrix
        assert codec.encode_many(rows, dtype, expires_at=expiries) == [
            codec.encode(r, dtype, expires_at=e) for r, e in zip(rows, expiries, strict=True)
        ]
    assert codec.encode_many([], dtype, expires_at=[]) == []
    with pytest.raises(ValueError):
        codec.encode_many(list(rows), dtype, expires_at=[None])
    with pytest.raises(ValueError):
        codec.encode_many(list(rows[:1]), dtype, expires_at=[float("inf")])
