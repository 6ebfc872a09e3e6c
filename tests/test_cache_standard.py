"""LangChain's standard ByteStore suites (``langchain-tests``), sync and async, for every store.

Each store under test starts empty: a fresh directory for LMDB, a flushed redis-server for Redis.
The async suites run under anyio's pytest plugin (``@pytest.mark.anyio``, asyncio backend), which
works whether or not pytest-asyncio (a dependency of langchain-tests) is installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from langchain_core.stores import BaseStore

# langchain_tests.integration_tests imports its chat-model suites, which use the ``benchmark``
# marker that pytest-benchmark (a dependency of langchain-tests) registers; without it
# --strict-markers fails the import. Skip, with the reason, where the install is partial.
pytest.importorskip("pytest_benchmark", reason="langchain-tests is installed without its deps")
pytest.importorskip("langchain_tests", reason="langchain-tests is not installed")
from langchain_tests.integration_tests import (
    BaseStoreAsyncTests,
    BaseStoreSyncTests,
)

from cache.stores import (
    CacheStore,
    LmdbByteStore,
    MemoryByteStore,
    RedisByteStore,
    TieredByteStore,
)
from tests.redis_server import (  # noqa: F401  (pytest fixtures)
    RedisServer,
    redis_server_fixture,
    redis_session_fixture,
)

MiB = 1 << 20
VALUES = (b"foo", b"\x00\xffbar", b"buzz" * 1000)


@pytest.fixture
def anyio_backend() -> str:
    """The cache runs on asyncio only (anyio would also try trio where it is installed)."""
    return "asyncio"


def _open(store: CacheStore) -> Iterator[BaseStore[str, bytes]]:
    yield store
    store.close()


class _Values:
    """The values every suite stores: short, with NUL and 0xFF bytes, and 4 KB."""

    @pytest.fixture
    def three_values(self) -> tuple[bytes, bytes, bytes]:
        return VALUES


# Each store is a mixin giving ``kv_store``; the sync and async suites share it.


class _Memory(_Values):
    @pytest.fixture
    def kv_store(self) -> Iterator[BaseStore[str, bytes]]:
        yield from _open(MemoryByteStore(MiB))


class _Lmdb(_Values):
    @pytest.fixture
    def kv_store(self, tmp_path: Path) -> Iterator[BaseStore[str, bytes]]:
        yield from _open(LmdbByteStore(tmp_path / "db", 64 * MiB))


class _PartitionedLmdb(_Values):
    @pytest.fixture
    def kv_store(self, tmp_path: Path) -> Iterator[BaseStore[str, bytes]]:
        yield from _open(LmdbByteStore(tmp_path / "db", 64 * MiB, partitions=4, scan_chunk=2))


class _TieredLmdb(_Values):
    @pytest.fixture
    def kv_store(self, tmp_path: Path) -> Iterator[BaseStore[str, bytes]]:
        yield from _open(
            TieredByteStore(MemoryByteStore(MiB), LmdbByteStore(tmp_path / "db", 64 * MiB))
        )


class _Redis(_Values):
    @pytest.fixture
    def kv_store(self, redis_server: RedisServer) -> Iterator[BaseStore[str, bytes]]:
        yield from _open(RedisByteStore(redis_server.url, socket_timeout_s=2.0))


class _TieredRedis(_Values):
    @pytest.fixture
    def kv_store(self, redis_server: RedisServer) -> Iterator[BaseStore[str, bytes]]:
        redis_store = RedisByteStore(redis_server.url, socket_timeout_s=2.0)
        yield from _open(TieredByteStore(MemoryByteStore(MiB), redis_store))


class TestMemorySync(_Memory, BaseStoreSyncTests[bytes]):
    pass


@pytest.mark.anyio
class TestMemoryAsync(_Memory, BaseStoreAsyncTests[bytes]):
    pass


class TestLmdbSync(_Lmdb, BaseStoreSyncTests[bytes]):
    pass


@pytest.mark.anyio
class TestLmdbAsync(_Lmdb, BaseStoreAsyncTests[bytes]):
    pass


class TestPartitionedLmdbSync(_PartitionedLmdb, BaseStoreSyncTests[bytes]):
    pass


@pytest.mark.anyio
class TestPartitionedLmdbAsync(_PartitionedLmdb, BaseStoreAsyncTests[bytes]):
    pass


class TestTieredLmdbSync(_TieredLmdb, BaseStoreSyncTests[bytes]):
    pass


@pytest.mark.anyio
class TestTieredLmdbAsync(_TieredLmdb, BaseStoreAsyncTests[bytes]):
    pass


@pytest.mark.redis
class TestRedisSync(_Redis, BaseStoreSyncTests[bytes]):
    pass


@pytest.mark.redis
@pytest.mark.anyio
class TestRedisAsync(_Redis, BaseStoreAsyncTests[bytes]):
    pass


@pytest.mark.redis
class TestTieredRedisSync(_TieredRedis, BaseStoreSyncTests[bytes]):
    pass


@pytest.mark.redis
@pytest.mark.anyio
class TestTieredRedisAsync(_TieredRedis, BaseStoreAsyncTests[bytes]):
    pass
