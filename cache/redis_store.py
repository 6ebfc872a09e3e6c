"""``RedisByteStore``: the shared second tier, over redis-py (not langchain-community).

One ``MGET`` per ``mget`` (chunked past ``chunk`` keys, the chunks pipelined in one round
trip), one pipeline per ``mset`` (``MSET``, or ``SET key value PX ttl`` per key that has a TTL:
the store's ``ttl_s``, or the value's own expiry time read by ``expiry_of``, which the cache
sets to ``codec.expires_at``), ``UNLINK`` for ``mdelete``, ``SCAN MATCH prefix*`` for
``yield_keys``. Keys are stored as ``prefix + key`` so that several namespaces or services
can share one Redis database.

Connections come from a ``BlockingConnectionPool`` of ``max_connections``: a caller waits up to
``socket_timeout_s`` for a free connection instead of opening more. Every command has the same
timeout, and a failed command is retried once on a new connection: that retry is what makes the
store reconnect by itself after a Redis restart (the pooled sockets are dead by then). Errors
(``redis.exceptions.RedisError``: ``ConnectionError``, ``TimeoutError``) propagate to the
caller; ``TieredByteStore`` absorbs and counts them.

The async forms run the sync client on the store's own thread pool (one thread per pooled
connection). For the cache's pattern (one ``MGET`` of 1,000 keys per request) it measured on
par with ``redis.asyncio`` (bench/cache_bench.py, 2-core box: 32 vs 58 ms per 1,000 on a quiet
run, 34 vs 28 ms on a loaded one), keeps the reply parsing off the event loop, and is bound to
no event loop, so one store serves every loop (the server's, ``asyncio.run`` in the CLI and
tests) without leaking sockets.
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar, cast
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from cache.base import CacheStore

T = TypeVar("T")
_GLOB_SPECIAL = frozenset("*?[]\\")


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis MATCH pattern."""
    return "".join("\\" + c if c in _GLOB_SPECIAL else c for c in text)


def _redact(url: str) -> str:
    """The URL without its password, for logs and /v1/stats."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}"
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def _unseen(keys: Iterable[str], seen: set[str]) -> list[str]:
    """The keys not seen before, in order, now remembered (SCAN may return a key twice)."""
    fresh = []
    for key in keys:
        if key not in seen:
            seen.add(key)
            fresh.append(key)
    return fresh


class RedisByteStore(CacheStore):
    """``str -> bytes`` in Redis under ``prefix``; ``ttl_s`` (optional) expires each write.

    ``url`` is a redis-py URL (``redis://host:port/db``, ``rediss://`` for TLS,
    ``unix:///path``). ``expiry_of(value)`` (optional) gives a value's own expiry time
    (``time.time()`` seconds, or None); such a value gets ``PX`` of the time left, computed
    here so that the Redis server's clock does not matter; it takes precedence over ``ttl_s``.
    Nothing connects until the first command, so building the store never fails because
    Redis is down. ``close()`` shuts the thread pool and the connections.
    """

    kind: ClassVar[str] = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "fc:",
        ttl_s: float | None = None,
        socket_timeout_s: float = 0.25,
        connect_timeout_s: float | None = None,
        max_connections: int = 16,
        chunk: int = 10_000,
        scan_count: int = 1_000,
        expiry_of: Callable[[bytes], float | None] | None = None,
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s}")
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be positive, got {socket_timeout_s}")
        if max_connections < 1 or chunk < 1 or scan_count < 1:
            raise ValueError("max_connections, chunk and scan_count must be >= 1")
        self.url = _redact(url)
        self.prefix = prefix
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self._pool = redis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=socket_timeout_s,  # wait for a free pooled connection
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s or socket_timeout_s,
            socket_keepalive=True,
            retry=Retry(NoBackoff(), retries=1),
        )
        self._client = redis.Redis(connection_pool=self._pool)
        self._executor = ThreadPoolExecutor(max_connections, thread_name_prefix="fleetcache-redis")
        self._chunk = chunk
        self._scan_count = scan_count
        self._pattern = _glob_escape(prefix)
        self._expiry_of = expiry_of
        self._closed = False

    def _k(self, key: str) -> bytes:
        return (self.prefix + key).encode("utf-8", "surrogatepass")

    def _chunks(self, items: Sequence[T]) -> Iterator[Sequence[T]]:
        for start in range(0, len(items), self._chunk):
            yield items[start : start + self._chunk]

    # -- sync ------------------------------------------------------------------------------

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        raw = [self._k(k) for k in keys]
        if len(raw) <= self._chunk:
            return cast("list[bytes | None]", self._client.mget(raw))  # decode_responses off
        with self._client.pipeline(transaction=False) as pipe:
            for part in self._chunks(raw):
                pipe.mget(part)
            return [v for values in pipe.execute() for v in values]

    def _ttl_ms(self, value: bytes, now: float) -> int | None:
        expires_at = self._expiry_of(value) if self._expiry_of is not None else None
        if expires_at is None:
            return self.ttl_ms
        return max(1, math.ceil((expires_at - now) * 1000))

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        if not key_value_pairs:
            return
        plain: Sequence[tuple[str, bytes]] = key_value_pairs
        with self._client.pipeline(transaction=False) as pipe:
            if self.ttl_ms is not None or self._expiry_of is not None:
                now, plain = time.time(), []
                for k, v in key_value_pairs:
                    if (ttl_ms := self._ttl_ms(v, now)) is None:
                        plain.append((k, v))
                    else:
                        pipe.set(self._k(k), v, px=ttl_ms)
            for part in self._chunks(plain):
                pipe.mset({self._k(k): v for k, v in part})
            pipe.execute()

    def mdelete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        with self._client.pipeline(transaction=False) as pipe:
            for part in self._chunks(keys):
                pipe.unlink(*(self._k(k) for k in part))
            pipe.execute()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._client.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.exists(self._k(k))
            return [bool(n) for n in pipe.execute()]

    def _scan(self, cursor: int, match: str) -> tuple[int, list[str]]:
        """One SCAN step: the next cursor (0 at the end) and the keys, prefix removed."""
        cursor, found = self._client.scan(cursor, match=match, count=self._scan_count)
        raw = cast("list[bytes]", found)
        cut = len(self.prefix.encode("utf-8", "surrogatepass"))
        return int(cursor), [k[cut:].decode("utf-8", "surrogatepass") for k in raw]

    def _match(self, prefix: str | None) -> str:
        return self._pattern + _glob_escape(prefix or "") + "*"

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        """Keys under ``prefix``, each once (SCAN repeats keys moved by a rehash, so the keys
        seen are remembered: memory grows with the number of keys yielded)."""
        match, cursor, seen = self._match(prefix), 0, set[str]()
        while True:
            cursor, keys = self._scan(cursor, match)
            yield from _unseen(keys, seen)
            if cursor == 0:
                return

    def ping(self) -> bool:
        """True when Redis answers (raises on a connection error)."""
        return bool(self._client.ping())

    # -- async: the sync client on the store's own threads -----------------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    async def amget(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._run(self.mget, keys)

    async def amset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        await self._run(self.mset, key_value_pairs)

    async def amdelete(self, keys: Sequence[str]) -> None:
        await self._run(self.mdelete, keys)

    async def acontains(self, keys: Sequence[str]) -> list[bool]:
        return await self._run(self.contains, keys)

    async def ayield_keys(self, *, prefix: str | None = None) -> AsyncIterator[str]:
        match, cursor, seen = self._match(prefix), 0, set[str]()
        while True:
            cursor, keys = await self._run(self._scan, cursor, match)
            for key in _unseen(keys, seen):
                yield key
            if cursor == 0:
                return

    # -- lifecycle -------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "url": self.url,
            "prefix": self.prefix,
            "ttl_s": None if self.ttl_ms is None else self.ttl_ms / 1000,
        }

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._executor.shutdown(wait=True)
            self._client.close()
            self._pool.disconnect()

    async def aclose(self) -> None:
        # Shutting the executor down waits for its running calls: not on the event loop.
        await asyncio.to_thread(self.close)
