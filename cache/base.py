"""Base pieces shared by the cache's stores: the ``CacheStore`` ByteStore base and ``ErrorLog``."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

from langchain_core.stores import BaseStore

from cache.codec import RowEntries

log = logging.getLogger("fleetcache.cache")


class ErrorLog:
    """Counts absorbed cache failures and logs them, at most one warning per ``every_s``."""

    def __init__(self, what: str, every_s: float = 10.0) -> None:
        self.what = what
        self.count = 0
        self._every_s = every_s
        self._last = -every_s
        self._unreported = 0
        self._lock = threading.Lock()

    def record(self, op: str, exc: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            self.count += 1
            self._unreported += 1
            if now - self._last < self._every_s:
                return
            self._last, suppressed, self._unreported = now, self._unreported - 1, 0
        log.warning(
            "%s failed on %s (%d similar errors not logged): %r; serving without it",
            self.what,
            op,
            suppressed,
            exc,
        )


class CacheStore(BaseStore[str, bytes]):
    """Base of the cache's ByteStores: a ``kind`` name, a peek, and a close hook."""

    kind: ClassVar[str] = "custom"

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Which keys hold a value, without counting hits or touching LRU order."""
        return [v is not None for v in self.mget(keys)]

    async def acontains(self, keys: Sequence[str]) -> list[bool]:
        return await asyncio.to_thread(self.contains, keys)

    async def amset_rows(self, rows: RowEntries, extra: Sequence[tuple[str, bytes]] = ()) -> None:
        """``amset`` of ``rows``, encoded, and of the ``extra`` entries, in one call (one
        transaction where the store has them). A store writing in another process encodes
        there (``proxy.lmdb_writer``)."""
        await self.amset([*rows.entries(), *extra])

    def close(self) -> None:
        """Release files and connections; later calls may raise."""

    async def aclose(self) -> None:
        self.close()

    def info(self) -> dict[str, Any]:
        """Cheap facts for /v1/stats (never raises)."""
        return {"kind": self.kind}
