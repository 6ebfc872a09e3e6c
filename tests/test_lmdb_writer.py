"""The engine process's LMDB writes run in a child process (``proxy.lmdb_writer``): what it
acknowledges is committed and readable from any process, it refuses bad keys before sending,
a killed writer is replaced on the next write, rows sent unencoded are stored as this process
would encode them, and ``auto`` picks the child by the machine's cores."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from cache import codec
from cache.codec import RowEntries
from cache.stores import LmdbByteStore, MemoryByteStore, TieredByteStore
from cache.writer import VectorWriter
from proxy.engine_host import STORE_WRITE_NICE, lmdb_partitions, lmdb_writer, shared_tier
from proxy.lmdb_writer import LmdbWriterStore
from proxy.settings import Settings


def run(coroutine: object) -> None:
    asyncio.run(coroutine)  # type: ignore[arg-type]


def test_acknowledged_writes_are_committed_by_another_process(tmp_path: Path) -> None:
    path = tmp_path / "cache.lmdb"

    async def main() -> None:
        store = await LmdbWriterStore(path).start()
        try:
            assert store.pid not in (None, os.getpid())
            await store.amset([("a", b"1"), ("b", b"22"), ("empty", b"")])
            assert store.mget(["a", "b", "empty", "missing"]) == [b"1", b"22", b"", None]
            value = os.urandom(1548)  # one encoded 384-d row
            batches = [[(f"k{i}-{j}", value) for j in range(32)] for i in range(200)]
            await asyncio.gather(*(store.amset(batch) for batch in batches))  # group commits
            assert store.entries == 3 + 200 * 32
        finally:
            await store.aclose()

    run(main())
    reopened = LmdbByteStore(path)
    assert reopened.mget(["a", "k199-31"])[0] == b"1" and reopened.entries == 6403
    reopened.close()


def test_a_bad_key_is_refused_before_it_is_sent(tmp_path: Path) -> None:
    async def main() -> None:
        store = await LmdbWriterStore(tmp_path / "cache.lmdb").start()
        try:
            with pytest.raises(ValueError, match="LMDB keys"):
                await store.amset([("ok", b"1"), ("x" * 600, b"2")])
            assert store.mget(["ok"]) == [None]  # nothing of that call was written
        finally:
            await store.aclose()

    run(main())


def test_a_killed_writer_is_replaced_on_the_next_write(tmp_path: Path) -> None:
    async def main() -> None:
        store = await LmdbWriterStore(tmp_path / "cache.lmdb").start()
        try:
            await store.amset([("before", b"1")])
            first = store.pid
            assert first is not None
            os.kill(first, signal.SIGKILL)
            await asyncio.sleep(0.3)
            await store.amset([("after", b"2")])
            assert store.pid != first and store.starts == 2
            assert store.mget(["before", "after"]) == [b"1", b"2"]
        finally:
            await store.aclose()
        assert store.pid is None
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)

    run(main())


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def test_a_partitioned_store_is_written_by_a_process_a_partition(tmp_path: Path) -> None:
    """Each partition's entries are committed by a writer process of its own below the
    child (one environment a process: LMDB's one writer and its fsync each), vectors and
    links alike; a killed partition writer is replaced on the next write to it."""
    path = tmp_path / "cache.lmdb"
    matrix = np.random.default_rng(3).standard_normal((64, 16)).astype(np.float32)
    keys = [f"t1-x:{i:04d}" for i in range(64)]
    links = [(f"link:x:driver:d{i}", key.encode()) for i, key in enumerate(keys)]

    async def main() -> None:
        store = await LmdbWriterStore(path, partitions=4).start()
        try:
            assert store.pid is not None
            writers = _children(store.pid)
            assert len(writers) == 4 and store.pid not in writers
            await store.amset_rows(RowEntries(keys, matrix), links)
            await store.amset([("plain", b"1")])
            encoded = codec.encode_many(matrix, "float32", expires_at=[None] * 64)
            assert store.mget([*keys, "plain"]) == [*encoded, b"1"]
            assert store.mget([k for k, _ in links]) == [v for _, v in links]
            assert [int(env.stat()["entries"]) > 20 for env in store._envs] == [True] * 4
            os.kill(writers[0], signal.SIGKILL)
            await asyncio.sleep(0.3)
            more = [(f"after-{i}", b"2") for i in range(40)]  # some in every partition
            await store.amset(more)
            assert store.mget([k for k, _ in more]) == [b"2"] * 40
            assert len(_children(store.pid)) == 4 and writers[0] not in _children(store.pid)
        finally:
            await store.aclose()

    run(main())
    reopened = LmdbByteStore(path)
    assert reopened.partitions == 4 and reopened.entries == 64 * 2 + 1 + 40
    reopened.close()


def test_partition_writers_commit_the_links_before_the_rest(tmp_path: Path) -> None:
    """No write of a vector starts before every link of its call is committed (a crash
    between them leaves a link to nothing, never a vector no link points at)."""
    from proxy.lmdb_writer import PartitionWriters

    store = LmdbByteStore(tmp_path / "db", partitions=3)
    writers = PartitionWriters(store, 0.0, "ipc://@unused", "info")
    log: list[tuple[str, bool]] = []

    async def write(partition: int, items: list[tuple[str, bytes]]) -> None:
        log.append(("start", items[0][0].startswith("link:")))
        await asyncio.sleep(0.01)
        log.append(("end", items[0][0].startswith("link:")))

    writers._write = write  # type: ignore[method-assign]
    entries = [(f"t1-x:{i}", b"v") for i in range(30)]
    entries += [(f"link:x:driver:{i}", b"k") for i in range(30)]
    run(writers.amset(entries))
    first_vector = log.index(("start", False))
    assert log[:first_vector] and all(is_link for _, is_link in log[:first_vector])
    assert ("end", True) not in log[first_vector:]
    assert sum(1 for event in log if event == ("start", False)) == 3  # each partition's share
    store.close()


def test_partition_writers_send_the_calls_made_during_a_write_together(tmp_path: Path) -> None:
    """Calls made while a write is under way go out in the next one, each partition's share
    of all of them in one message a phase; each call returns once its own entries are
    written, and a write that fails fails the calls it carried, not those after it."""
    from proxy.lmdb_writer import PartitionWriters

    store = LmdbByteStore(tmp_path / "db", partitions=3)
    writers = PartitionWriters(store, 0.0, "ipc://@unused", "info")
    sent: list[list[str]] = []
    failing = {"bad-0"}

    async def write(partition: int, items: list[tuple[str, bytes]]) -> None:
        sent.append([key for key, _ in items])
        await asyncio.sleep(0.02)
        if failing & {key for key, _ in items}:
            raise OSError("disk gone")

    writers._write = write  # type: ignore[method-assign]

    async def main() -> list[BaseException | None]:
        first = asyncio.create_task(writers.amset([(f"a-{i}", b"v") for i in range(9)]))
        await asyncio.sleep(0.005)  # the first write is under way
        later = [writers.amset([(f"g{c}-{i}", b"v") for i in range(9)]) for c in range(4)]
        results = await asyncio.gather(first, *later, return_exceptions=True)
        bad = await asyncio.gather(writers.amset([("bad-0", b"v")]), return_exceptions=True)
        after = await asyncio.gather(writers.amset([("c-0", b"v")]), return_exceptions=True)
        return [*results, *bad, *after]

    outcome = asyncio.run(main())
    assert outcome[:5] == [None] * 5
    assert writers.writes == 4  # the first; the four calls made during it; bad; after
    grouped = [keys for keys in sent if any(k.startswith("g") for k in keys)]
    assert len(grouped) <= 3  # one message a partition for the four calls' 36 entries
    assert sorted(k for keys in grouped for k in keys) == sorted(
        f"g{c}-{i}" for c in range(4) for i in range(9)
    )
    assert isinstance(outcome[5], OSError) and outcome[6] is None
    store.close()


@pytest.mark.parametrize(
    ("setting", "cores", "expected"),
    [
        ("auto", 2, "thread"),  # the 2-core box: the child's interpreter costs a core's share
        ("auto", 3, "thread"),
        ("auto", 4, "process"),  # the H200 machine on 4 cores: 1.15-1.20x, warm-up the same
        ("auto", 16, "process"),  # the H200 machine: 1.41x the new texts with the child
        ("thread", 16, "thread"),
        ("process", 2, "process"),
    ],
)
def test_where_the_writes_run_follows_the_setting_and_the_cores(
    setting: str, cores: int, expected: str
) -> None:
    settings = Settings(lmdb_writer=setting)  # type: ignore[arg-type]
    assert lmdb_writer(settings, cores) == expected


@pytest.mark.parametrize("setting", ["auto", "thread", "process"])
def test_the_engine_store_writes_where_the_setting_says(tmp_path: Path, setting: str) -> None:
    """The engine process's shared tier is a writer child exactly when ``lmdb_writer`` says
    so (``auto``: by this machine's cores), and writes through it reach LMDB."""

    async def main() -> None:
        settings = Settings(store="lmdb", data_dir=tmp_path, lmdb_writer=setting)  # type: ignore[arg-type]
        async with shared_tier(settings) as tier:
            child = isinstance(tier.store, LmdbWriterStore)
            assert child == (lmdb_writer(settings) == "process")
            await tier.amset([("k", b"v")])
            assert await tier.amget(["k"]) == [b"v"]

    run(main())


def test_the_engine_commits_its_own_writes_below_its_other_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the engine process writes LMDB itself (``lmdb_writer=thread``), every commit
    runs on a thread ``STORE_WRITE_NICE`` below the event loop's, which keeps its own: a
    warm-up job's write-backs then leave the cores to the workers on a small machine."""
    native_id = threading.get_native_id
    loop_thread = native_id()
    base = os.getpriority(os.PRIO_PROCESS, loop_thread)
    commits: list[tuple[int, int]] = []  # (thread, its nice value)
    mset = LmdbByteStore.mset

    def recorded(self: LmdbByteStore, items: Sequence[tuple[str, bytes]]) -> None:
        commits.append((native_id(), os.getpriority(os.PRIO_PROCESS, native_id())))
        mset(self, items)

    monkeypatch.setattr(LmdbByteStore, "mset", recorded)

    async def main() -> None:
        settings = Settings(store="lmdb", data_dir=tmp_path, lmdb_writer="thread")
        async with shared_tier(settings) as tier:
            await asyncio.gather(*(tier.amset([(f"k{i}", b"v")]) for i in range(50)))
            assert await tier.amget(["k0", "k49"]) == [b"v", b"v"]

    run(main())
    assert commits and all(thread != loop_thread for thread, _ in commits)
    assert {nice for _, nice in commits} == {min(19, base + STORE_WRITE_NICE)}
    assert os.getpriority(os.PRIO_PROCESS, loop_thread) == base


def test_the_engine_writer_child_and_its_partition_writers_run_below_the_engine(
    tmp_path: Path,
) -> None:
    """With ``lmdb_writer=process`` every thread of the writer child and of the partitions'
    writers it starts runs ``STORE_WRITE_NICE`` below the engine thread that started it, a
    replacement of a killed child too: their write-backs are what no answer waits for, and
    a warm-up job's took ~1.6-1.9 cores beside the workers on the H100 machine."""
    below = min(19, os.getpriority(os.PRIO_PROCESS, 0) + STORE_WRITE_NICE)

    def nice_values(pid: int) -> set[int]:
        threads = [int(t.name) for p in [pid, *_children(pid)] for t in _tasks(p)]
        return {os.getpriority(os.PRIO_PROCESS, thread) for thread in threads}

    async def main() -> None:
        settings = Settings(
            store="lmdb", data_dir=tmp_path, lmdb_writer="process", lmdb_partitions=2
        )
        async with shared_tier(settings) as tier:
            store = tier.store
            assert isinstance(store, LmdbWriterStore) and store.pid is not None
            await tier.amset([("k", b"v")])
            assert len(_children(store.pid)) == 2 and nice_values(store.pid) == {below}
            first = store.pid
            os.kill(first, signal.SIGKILL)
            await asyncio.sleep(0.3)
            await tier.amset([("k2", b"v")])
            assert store.pid not in (None, first) and nice_values(store.pid) == {below}

    run(main())


def _tasks(pid: int) -> list[Path]:
    return list(Path(f"/proc/{pid}/task").iterdir())


@pytest.mark.parametrize(
    ("partitions", "writer", "cores", "expected"),
    [
        ("auto", "auto", 2, 1),  # the 2-core box: the thread writes them one after another
        ("auto", "auto", 16, 8),  # the H200 machine: a writer process a partition
        ("auto", "thread", 16, 1),
        ("auto", "process", 2, 8),
        (3, "thread", 16, 3),
    ],
)
def test_a_new_caches_partitions_follow_the_setting_and_the_writer(
    partitions: object, writer: str, cores: int, expected: int
) -> None:
    settings = Settings(lmdb_partitions=partitions, lmdb_writer=writer)  # type: ignore[arg-type]
    assert lmdb_partitions(settings, cores) == expected


def test_the_engine_and_the_workers_share_one_partitioned_cache(tmp_path: Path) -> None:
    """The engine's writer child writes the partitions the setting asked of a new data dir,
    and a worker's tiers (built by ``build_tiers``) read them."""
    from proxy.services import build_tiers

    settings = Settings(store="lmdb", data_dir=tmp_path, lmdb_writer="process", lmdb_partitions=4)

    async def main() -> None:
        async with shared_tier(settings) as tier:
            assert isinstance(tier.store, LmdbWriterStore) and tier.store.partitions == 4
            await tier.amset([(f"k{i}", b"v") for i in range(20)])
        worker = build_tiers(Settings(store="lmdb", data_dir=tmp_path, lmdb_partitions=1))
        assert isinstance(worker.store, LmdbByteStore) and worker.store.partitions == 4
        assert worker.mget([f"k{i}" for i in range(20)]) == [b"v"] * 20
        worker.close()

    run(main())


def test_rows_sent_unencoded_are_stored_as_the_engine_would_encode_them(tmp_path: Path) -> None:
    """``amset_rows``: the child encodes the rows (with and without an expiry) into the
    same bytes ``encode_many`` gives here, and writes the extra entries in the same call."""
    rng = np.random.default_rng(7)
    matrix = rng.standard_normal((5, 384)).astype(np.float32)
    matrix.flags.writeable = False  # as the in-flight map hands its rows over (shared)
    expiry = [None, 1_900_000_000.5, None, 1_900_000_001.0, None]
    keys = [f"t1-x:{i}" for i in range(5)]

    async def main() -> None:
        store = await LmdbWriterStore(tmp_path / "cache.lmdb").start()
        try:
            rows = RowEntries(keys, matrix, "float32", expiry)
            await store.amset_rows(rows, [("link:driver:d1", b"t1-x:0")])
            assert store.mget([*keys, "link:driver:d1"]) == [
                *codec.encode_many(matrix, "float32", expires_at=expiry),
                b"t1-x:0",
            ]
            half = RowEntries(["h"], matrix[:1], "float16")  # no expiry at all
            await store.amset_rows(half)
            assert store.mget(["h"]) == [codec.encode(matrix[0], "float16")]
        finally:
            await store.aclose()

    run(main())


def test_a_bad_key_fails_only_its_own_rows_call(tmp_path: Path) -> None:
    """The child checks a call's keys before it joins a transaction: a call with a key
    LMDB refuses fails alone (nothing of it written), calls beside it are committed."""
    matrix = np.ones((2, 8), np.float32)

    async def main() -> None:
        store = await LmdbWriterStore(tmp_path / "cache.lmdb").start()
        try:
            bad = store.amset_rows(RowEntries(["ok-1", "x" * 600], matrix))
            good = store.amset_rows(RowEntries(["ok-2", "ok-3"], matrix))
            outcomes = await asyncio.gather(bad, good, return_exceptions=True)
            assert isinstance(outcomes[0], Exception) and "LMDB keys" in str(outcomes[0])
            assert outcomes[1] is None
            assert store.rows_messages == 1  # both calls in one message, each its outcome
            assert [v is not None for v in store.mget(["ok-1", "ok-2", "ok-3"])] == [
                False,
                True,
                True,
            ]
        finally:
            await store.aclose()

    run(main())


def test_the_write_backs_of_one_turn_travel_as_one_message(tmp_path: Path) -> None:
    """The engine's write-backs of one batch's requests are made in one turn of its event
    loop: they reach the child as one message (not one each), and each is committed, with
    its own dtype, expiry and extra entries; a call of a later turn is a message of its own."""
    matrix = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)

    async def main() -> None:
        store = await LmdbWriterStore(tmp_path / "cache.lmdb").start()
        try:
            await asyncio.gather(
                store.amset_rows(RowEntries(["a", "b"], matrix[:2]), [("link:a", b"a")]),
                store.amset_rows(RowEntries(["c"], matrix[2:3], "float16", [1_900_000_000.0])),
                store.amset_rows(RowEntries([], matrix[:0])),
            )
            assert store.rows_messages == 1
            await store.amset_rows(RowEntries(["d"], matrix[3:]))
            assert store.rows_messages == 2
            assert store.mget(["a", "b", "c", "d", "link:a"]) == [
                *codec.encode_many(matrix[:2], "float32", expires_at=[None, None]),
                codec.encode(matrix[2], "float16", expires_at=1_900_000_000.0),
                codec.encode(matrix[3]),
                b"a",
            ]
        finally:
            await store.aclose()

    run(main())


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_the_engine_write_back_stores_the_same_bytes_either_way(
    tmp_path: Path, writer: str
) -> None:
    """``VectorWriter.write_rows`` over the engine's shared tier (no memory copy): vectors,
    their TTL'd expiry and the entities' links land as the in-process encoding writes them,
    whether the writer child encodes them or this process does."""
    texts = ["driver a", "driver b", "driver c"]
    matrix = np.arange(3 * 16, dtype=np.float32).reshape(3, 16)
    links = [("driver", "d1", "driver a"), ("driver", "d2", "driver c")]

    async def main() -> None:
        settings = Settings(store="lmdb", data_dir=tmp_path, lmdb_writer=writer)  # type: ignore[arg-type]
        async with shared_tier(settings) as tier:
            assert isinstance(tier.store, LmdbWriterStore) == (writer == "process")
            vectors = VectorWriter(tier, namespace="t1-x", wall_clock=lambda: 1_000.0)
            ok = await vectors.write_rows(texts, matrix, {"driver b": 60.0}, links=links)
            assert ok and tier.store_errors == 0
            keys = [vectors.key(t) for t in texts]
            expiry = [None, 1_060.0, None]
            expected = codec.encode_many(matrix, "float32", expires_at=expiry)
            assert await tier.amget(keys) == expected
            linked = [vectors.links.key("driver", d) for d in ("d1", "d2")]
            assert await tier.amget(linked) == [keys[0].encode(), keys[2].encode()]

    run(main())


def test_a_failing_store_under_rows_is_counted_not_raised() -> None:
    """The tiers absorb a store that fails on ``amset_rows`` as on ``amset``: counted, the
    store marked degraded, nothing raised to the write-back."""

    class Broken(MemoryByteStore):
        async def amset_rows(self, rows: RowEntries, extra: object = ()) -> None:
            raise OSError("disk gone")

    async def main() -> None:
        tier = TieredByteStore(MemoryByteStore(0), Broken(1 << 20))
        await tier.amset_rows(RowEntries(["k"], np.ones((1, 4), np.float32)))
        assert tier.store_errors == 1 and tier.store_degraded

    run(main())
