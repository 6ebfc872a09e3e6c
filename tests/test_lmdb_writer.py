"""The engine process's LMDB writes run in a child process (``proxy.lmdb_writer``): what it
acknowledges is committed and readable from any process, it refuses bad keys before sending,
a killed writer is replaced on the next write, and ``auto`` picks it by the machine's cores."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from cache.stores import LmdbByteStore
from proxy.engine_host import lmdb_writer, shared_tier
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


@pytest.mark.parametrize(
    ("setting", "cores", "expected"),
    [
        ("auto", 2, "thread"),  # the 2-core box: the child's interpreter costs a core's share
        ("auto", 7, "thread"),
        ("auto", 8, "process"),
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
