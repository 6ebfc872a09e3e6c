"""LangChain ``ByteStore`` implementations behind the embedding cache.

::

    CacheStore (BaseStore[str, bytes])  adds kind, a non-counting contains() peek, close()
     +-- MemoryByteStore   in-process LRU bounded by bytes; async forms run inline
     +-- LmdbByteStore     LMDB on disk: one environment, or partitions of the keys each in
                           an environment of its own; async forms hop to a thread
     +-- RedisByteStore    (redis_store.py) shared by replicas, over redis-py; async forms
                           run on its own thread pool
     +-- TieredByteStore   memory first, then a second-tier ByteStore; store errors are
                           logged and counted, never raised, and mark the store degraded
                           until it answers again

Every store is a complete ``ByteStore``: ``mget``, ``mset``, ``mdelete``,
``yield_keys(prefix=)`` and their async forms behave like a dict of ``str -> bytes``.
"""

from __future__ import annotations

import asyncio
import os
import resource
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, ClassVar, cast

import lmdb
from langchain_core.stores import ByteStore

from cache import codec
from cache.base import CacheStore, ErrorLog, log
from cache.boot import BootGuard
from cache.redis_store import RedisByteStore

GiB = 1 << 30
# Keys that point at other entries (``cache.links``): written before the entries they point
# at and deleted after them, so that a crash between two partitions' commits never leaves an
# entry that nothing points at (an entity's vector that ``forget`` could not find).
POINTER_PREFIX = b"link:"
LAYOUT_FILE = "partitions"  # how many partitions the directory was made with
INLINE_READ_KEYS = 256  # an LMDB read of at most this many keys runs on the caller's thread,
COLD_READ_BACKOFF_S = 1.0  # unless one read pages from the disk less than this long ago
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)  # Linux: this thread


def _major_faults() -> int:
    """Page faults of the calling thread that read the disk so far (0.6 us a call)."""
    return resource.getrusage(_RUSAGE_THREAD).ru_majflt


_Bytes = bytes  # MemoryByteStore has a ``bytes`` property that shadows the builtin


class MemoryByteStore(CacheStore):
    """Thread-safe LRU of ``str -> bytes`` bounded by total ``len(key) + len(value)``.

    Calls come both from the event loop and from worker threads, so one lock guards the
    ``OrderedDict``; every operation is O(1) per key. A value larger than ``max_bytes`` is not
    stored; ``max_bytes=0`` disables the tier. The async forms run inline: an in-memory
    lookup is far cheaper than a thread hop.
    """

    kind: ClassVar[str] = "memory"

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max_bytes = max_bytes
        self._data: OrderedDict[str, _Bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.evictions = 0

    @property
    def entries(self) -> int:
        return len(self._data)

    @property
    def bytes(self) -> int:
        return self._bytes

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def keeps_nothing(self) -> bool:
        """``max_bytes=0``: the tier is off (nothing is worth encoding for it)."""
        return self._max_bytes == 0

    def mget(self, keys: Sequence[str]) -> list[_Bytes | None]:
        with self._lock:
            get, touch = self._data.get, self._data.move_to_end
            out = [get(k) for k in keys]
            for k, v in zip(keys, out, strict=True):
                if v is not None:
                    touch(k)
        return out

    def mset(self, key_value_pairs: Sequence[tuple[str, _Bytes]]) -> None:
        with self._lock:
            data = self._data
            for key, value in key_value_pairs:
                old = data.pop(key, None)
                if old is not None:
                    self._bytes -= len(key) + len(old)
                size = len(key) + len(value)
                if size <= self._max_bytes:
                    data[key] = value
                    self._bytes += size
            while self._bytes > self._max_bytes:
                key, value = data.popitem(last=False)
                self._bytes -= len(key) + len(value)
                self.evictions += 1

    def mdelete(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                old = self._data.pop(key, None)
                if old is not None:
                    self._bytes -= len(key) + len(old)

    def _keys(self, prefix: str | None) -> list[str]:
        with self._lock:
            keys = list(self._data)
        return keys if not prefix else [k for k in keys if k.startswith(prefix)]

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        yield from self._keys(prefix)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0

    async def amget(self, keys: Sequence[str]) -> list[_Bytes | None]:
        return self.mget(keys)

    async def amset(self, key_value_pairs: Sequence[tuple[str, _Bytes]]) -> None:
        self.mset(key_value_pairs)

    async def amdelete(self, keys: Sequence[str]) -> None:
        self.mdelete(keys)

    async def ayield_keys(self, *, prefix: str | None = None) -> AsyncIterator[str]:
        for key in self._keys(prefix):
            yield key

    async def acontains(self, keys: Sequence[str]) -> list[bool]:
        return self.contains(keys)

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "entries": self.entries,
            "bytes": self._bytes,
            "max_bytes": self._max_bytes,
            "evictions": self.evictions,
        }


class GroupCommit:
    """Writes that arrive while ``commit`` runs go in its next call together, each call taking
    the queued writes until it holds ``max_group`` entries (whole writes: one may pass the
    mark); each write returns, or raises, with its group. Follows the event loop of the
    latest write (a store may serve one loop after another)."""

    def __init__(
        self, commit: Callable[[Sequence[tuple[str, bytes]]], Awaitable[None]], max_group: int
    ) -> None:
        self._commit = commit
        self.max_group = max_group
        self._queued: list[tuple[Sequence[tuple[str, bytes]], asyncio.Future[None]]] = []
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, items: Sequence[tuple[str, bytes]]) -> None:
        if not items:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queued.append((items, done))
        if self._task is None or self._task.done() or self._loop is not loop:
            self._task, self._loop = loop.create_task(self._run()), loop
        await done

    async def _run(self) -> None:
        while self._queued:
            taken, size = 0, 0
            while taken < len(self._queued) and (not taken or size < self.max_group):
                size += len(self._queued[taken][0])
                taken += 1
            group, self._queued = self._queued[:taken], self._queued[taken:]
            try:
                await self._commit([pair for pairs, _ in group for pair in pairs])
            except Exception as exc:
                for _, done in group:
                    if not done.done():
                        done.set_exception(exc)
            else:
                for _, done in group:
                    if not done.done():
                        done.set_result(None)


class LmdbByteStore(CacheStore):
    """``str -> bytes`` in LMDB: one environment (a directory holding data.mdb and lock.mdb,
    and the files of its boot guard, ``cache.boot``), or ``partitions`` of the keys (by a
    CRC32 of the key), each an environment in a subdirectory ``p<i>`` of its own.

    Why partitions: LMDB has one writer at a time per environment, and a hashed key lands on
    a random page, so with an fsync at every commit one environment takes as many new entries
    a second as one writer's random pages and fsyncs allow (12-20k on the H200 machine's
    disk); a partition has a write lock and an fsync of its own, so one writer process a
    partition (``proxy.lmdb_writer``) writes 4-5x that with 8 (docs/BENCHMARKS.md). Threads of
    one process do not: py-lmdb hands the GIL back and forth around every ``put``, and 8
    partitions written from 8 threads took no more than one. So this class writes the
    partitions of a call one after another. A read of N keys takes a read transaction per
    partition it touches. The directory decides the layout: it is made with ``partitions``
    (recorded in its ``partitions`` file) and opened as it was made whatever is asked later
    (a directory of one environment, an older cache, stays one), so every process of a server
    agrees on where each key lives.

    ``mget`` runs in one read transaction a partition and ``mset`` / ``mdelete`` in one write
    transaction a partition each: atomic within a partition. Across partitions, entity links
    (``POINTER_PREFIX``) are committed before and deleted after the entries they point at.
    Durability: ``sync=True`` (default) with ``metasync=False`` keeps atomicity and
    consistency on any crash and loses at most the last committed batch on an OS crash or
    power loss (a process crash loses nothing); ``sync=False`` also skips the data fsync at
    each commit (an fsync every ``sync_every_s`` seconds instead, if given, and at close): a
    process crash still loses nothing, and after an OS crash or a power loss the cache starts
    empty (``cache.boot``: the tree may be torn, so it is not read). Several processes may
    open the same directory (the server and ``fleetcache warmup``): LMDB locks writers.
    A full map (``map_size``, shared by the partitions) makes writes raise
    ``lmdb.MapFullError``; TieredByteStore counts that as a store error and keeps serving.
    Async forms run the call in a worker thread (``amget`` of a request's keys inline),
    ``amset``'s commits on ``write_executor`` when given (the engine process runs its
    write-backs below its serving threads: ``proxy.engine_host.shared_tier``). Keys are
    UTF-8; at most ``max_key_size`` (511) bytes.
    """

    kind: ClassVar[str] = "lmdb"

    def __init__(
        self,
        path: Path | str,
        map_size: int = 4 * GiB,
        *,
        partitions: int = 1,
        sync: bool = True,
        sync_every_s: float | None = None,
        readahead: bool = False,
        max_readers: int = 256,
        scan_chunk: int = 1024,
        max_group: int = 4096,
        write_executor: Executor | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.partitions = _layout(self.path, partitions)
        where = (
            [self.path]
            if self.partitions == 1
            else [self.path / f"p{i}" for i in range(self.partitions)]
        )
        # a key's partition is a CRC32 of it: a few keys more in one than another, so each
        # partition may take an eighth more than an even share of the map
        share = map_size if self.partitions == 1 else map_size // self.partitions * 9 // 8
        self.directories, self.partition_map_size = where, share
        self._guards: list[BootGuard] = []
        self._envs: list[lmdb.Environment] = []
        try:
            for directory in where:
                directory.mkdir(exist_ok=True)
                self._guards.append(BootGuard(directory, unsynced=not sync))
                # readahead=False: lookups are random single pages, the OS readahead only
                # evicts useful pages once the file outgrows RAM.
                self._envs.append(
                    lmdb.open(
                        str(directory),
                        subdir=True,
                        map_size=share,
                        max_dbs=0,
                        sync=sync,
                        metasync=False,
                        readahead=readahead,
                        writemap=False,
                        max_readers=max_readers,
                        lock=True,
                    )
                )
        except BaseException:
            for env in self._envs:
                env.close()
            for guard in self._guards:
                guard.release(synced=False)
            raise
        # after an OS crash, unsynced (cache.boot)
        self.emptied_at_open = any(guard.emptied for guard in self._guards)
        for env in self._envs:
            env.reader_check()  # free slots left by crashed processes
        self._env = self._envs[0]
        self.syncs = 0  # fsyncs by the timer (``sync_every_s``)
        self._stop_syncing = threading.Event()
        self._syncer: threading.Thread | None = None
        if not sync and sync_every_s:
            self._syncer = threading.Thread(
                target=self._sync_every, args=(sync_every_s,), name="lmdb-fsync", daemon=True
            )
            self._syncer.start()
        self._max_key = self._env.max_key_size()
        self._scan_chunk = scan_chunk
        self._closed = False
        self._write_executor = write_executor
        self._inline_after = 0.0  # time.monotonic() from which reads may run inline again
        # looked up at each commit: a subclass's or an instance's own ``_commit`` (tests hold it)
        self._grouped = GroupCommit(lambda items: self._commit(items), max_group)

    def _key(self, key: str) -> bytes:
        raw = key.encode("utf-8")
        if not raw or len(raw) > self._max_key:
            raise ValueError(f"LMDB keys must be 1..{self._max_key} bytes, got {len(raw)}")
        return raw

    def _by_partition(self, raw: Sequence[bytes]) -> dict[int, list[bytes]]:
        """Keys (valid ones only) grouped by the partition that holds them."""
        valid = [k for k in raw if 0 < len(k) <= self._max_key]
        n = self.partitions
        if n == 1:
            return {0: valid}
        parts: dict[int, list[bytes]] = {}
        for k in valid:
            parts.setdefault(zlib.crc32(k) % n, []).append(k)
        return parts

    def write_phases(self, raw: Sequence[bytes]) -> list[dict[int, list[int]]]:
        """Where one write's keys ``raw`` go, as their positions by partition, in phases:
        the links (``POINTER_PREFIX``) first, the rest once those are committed (a delete
        takes them the other way round); one phase in a store of one environment, whose
        single transaction is atomic."""
        n = self.partitions
        if n == 1:
            return [{0: list(range(len(raw)))}]
        phases: list[dict[int, list[int]]] = [{}, {}]
        for j, k in enumerate(raw):
            phase = phases[not k.startswith(POINTER_PREFIX)]
            phase.setdefault(zlib.crc32(k) % n, []).append(j)
        return phases

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        raw = [k.encode("utf-8") for k in keys]
        found: dict[bytes, bytes] = {}
        for i, part in self._by_partition(raw).items():
            # getmulti looks all keys up in one C loop: ~3x faster than txn.get per key.
            with self._envs[i].begin() as txn, txn.cursor() as cur:
                found.update(cur.getmulti(part))
        return [found.get(k) for k in raw]

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        if not key_value_pairs:
            return
        items = [(self._key(k), v) for k, v in key_value_pairs]
        for phase in self.write_phases([k for k, _ in items]):
            for i, positions in phase.items():
                self._put(i, [items[j] for j in positions])

    def _put(self, partition: int, items: Sequence[tuple[bytes, bytes]]) -> None:
        with self._envs[partition].begin(write=True) as txn:
            put = txn.put
            for k, v in items:
                put(k, v)

    def mdelete(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        valid = [k for k in (k.encode("utf-8") for k in keys) if 0 < len(k) <= self._max_key]
        for phase in reversed(self.write_phases(valid)):  # the links last
            for i, positions in phase.items():
                self._delete(i, [valid[j] for j in positions])

    def _delete(self, partition: int, keys: Sequence[bytes]) -> None:
        with self._envs[partition].begin(write=True) as txn:
            for k in keys:
                txn.delete(k)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        raw = [k.encode("utf-8") for k in keys]
        present: set[bytes] = set()
        for i, part in self._by_partition(raw).items():
            with self._envs[i].begin() as txn, txn.cursor() as cur:
                present.update(k for k in part if cur.set_key(k))
        return [k in present for k in raw]

    def _scan(self, partition: int, prefix: bytes, after: bytes | None) -> list[bytes]:
        """Up to ``scan_chunk`` keys of one partition with ``prefix`` after ``after``, in a
        short read txn.

        Scanning in chunks keeps no read transaction open while the caller consumes keys
        (a long-lived reader would pin old pages and grow the file).
        """
        out: list[bytes] = []
        with self._envs[partition].begin() as txn, txn.cursor() as cur:
            if after is not None:
                ok = cur.set_range(after)
                if ok and cur.key() == after:
                    ok = cur.next()
            else:
                ok = cur.set_range(prefix) if prefix else cur.first()
            while ok and len(out) < self._scan_chunk:
                key = cur.key()
                if not key.startswith(prefix):
                    break
                out.append(bytes(key))
                ok = cur.next()
        return out

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        """Keys in order within each partition, one partition after another."""
        pfx = (prefix or "").encode("utf-8")
        for partition in range(self.partitions):
            after = None
            while chunk := self._scan(partition, pfx, after):
                yield from (k.decode("utf-8") for k in chunk)
                if len(chunk) < self._scan_chunk:
                    break
                after = chunk[-1]

    async def amget(self, keys: Sequence[str]) -> list[bytes | None]:
        """A request's keys (up to ``INLINE_READ_KEYS``) are read on the caller's thread: a
        read transaction over the memory map, ``getmulti`` in C, tens of microseconds from the
        page cache, where a hop to a thread and back costs a busy worker's loop a GIL handover
        each way (a miss's lookup 7.7-11.2 -> 0.2 ms on an H100 host, docs/BENCHMARKS.md).
        Larger reads (a warm-up chunk's) go to a thread, and so does every read for
        ``COLD_READ_BACKOFF_S`` after one that took a major page fault (its pages came from
        the disk: a cold cache after a restart), so that the loop's other requests do not
        wait for the disk. Faults, not time: a read's time on a busy machine is mostly its
        thread waiting for a core (a 2 ms bound sent most reads of 2 loaded cores to a
        thread)."""
        if len(keys) > INLINE_READ_KEYS or time.monotonic() < self._inline_after:
            return await asyncio.to_thread(self.mget, keys)
        faults = _major_faults()
        values = self.mget(keys)
        if _major_faults() > faults:
            self._inline_after = time.monotonic() + COLD_READ_BACKOFF_S
        return values

    async def amset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        """Group commit: writes that arrive while a transaction is being committed go in the
        next one together, so one fsync serves them all. Measured on the H200 machine: with
        a transaction (and fsync) per call, 64 connections of new texts stopped at ~375 engine
        write-backs/s (10-12k texts/s, the batcher alone did 78k). A transaction takes calls
        until it holds ``max_group`` entries: behind a backlog, a write still ends within one
        transaction's time (each entry costs a 4 KiB page: ~57 us with the fsync on the H200's
        disk, ``bench/lmdb_write_bench.py``), not after one transaction of the whole backlog."""
        await self._grouped(key_value_pairs)

    @property
    def max_group(self) -> int:
        """Entries a transaction takes at most (whole calls: one may pass the mark)."""
        return self._grouped.max_group

    async def _commit(self, items: Sequence[tuple[str, bytes]]) -> None:
        """One write transaction of a group's ``items``."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._write_executor, self.mset, items)

    async def amdelete(self, keys: Sequence[str]) -> None:
        await asyncio.to_thread(self.mdelete, keys)

    async def ayield_keys(self, *, prefix: str | None = None) -> AsyncIterator[str]:
        pfx = (prefix or "").encode("utf-8")
        for partition in range(self.partitions):
            after = None
            while chunk := await asyncio.to_thread(self._scan, partition, pfx, after):
                for key in chunk:
                    yield key.decode("utf-8")
                if len(chunk) < self._scan_chunk:
                    break
                after = chunk[-1]

    @property
    def entries(self) -> int:
        return sum(int(env.stat()["entries"]) for env in self._envs)

    def info(self) -> dict[str, Any]:
        try:
            infos = [(env.info(), env.stat()) for env in self._envs]
        except lmdb.Error:
            return {"kind": self.kind, "closed": True}
        return {
            "kind": self.kind,
            "path": str(self.path),
            "partitions": self.partitions,
            "entries": sum(stat["entries"] for _, stat in infos),
            "bytes": sum((info["last_pgno"] + 1) * stat["psize"] for info, stat in infos),
            "map_size": sum(info["map_size"] for info, _ in infos),
        }

    def _sync_every(self, seconds: float) -> None:
        while not self._stop_syncing.wait(seconds):
            for env in self._envs:
                env.sync(True)
            self.syncs += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._stop_syncing.set()
            if self._syncer is not None:
                self._syncer.join()
            for env, guard in zip(self._envs, self._guards, strict=True):
                env.sync(True)  # everything on disk: the last one out may mark it clean
                env.close()
                guard.release(synced=True)


class _Guarded:
    """One store call of a ``TieredByteStore`` (``_guarded``): an ``Exception`` from the block
    is counted and absorbed, a success ends degraded mode; ``ok`` says which. Cancellation
    and other ``BaseException``s go on."""

    __slots__ = ("_op", "_tiers", "ok")

    def __init__(self, tiers: TieredByteStore, op: str) -> None:
        self._tiers, self._op, self.ok = tiers, op, False

    def __enter__(self) -> _Guarded:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> bool:
        if exc is None:
            self.ok = True
            self._tiers._store_ok()
            return False
        if not isinstance(exc, Exception):
            return False
        self._tiers._store_failed(self._op, exc)
        return True


class TieredByteStore(CacheStore):
    """Memory first, then ``store`` for the keys memory lacks; a store hit is promoted.

    Writes go to ``store`` then memory. Any exception from ``store`` is logged (throttled),
    counted in ``store_errors`` and swallowed: on read its keys count as missing, on write
    memory is still written. ``memory_hits`` / ``store_hits`` count keys found per tier by
    lookups (not by ``read_uncounted``: entity links, the drift check's reads). The memory
    tier never leaves the calling thread; only ``store``'s own async forms may hop.
    ``store=None`` is a memory-only cache (``store_kind == "none"``).

    Degraded mode: after a store error the store is ``store_degraded`` and reads and writes
    skip it for ``retry_after_s`` (counted in ``store_skipped``), so that a Redis that hangs
    costs one timeout per ``retry_after_s`` rather than one per request. The first call after
    that tries the store again; its success ends degraded mode by itself. Deletes always try
    the store (a skipped delete would leave an invalidated entry behind).
    """

    kind: ClassVar[str] = "tiered"

    def __init__(
        self,
        memory: MemoryByteStore,
        store: ByteStore | None = None,
        *,
        retry_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.memory = memory
        self.store = store
        self._lock = threading.Lock()
        self.memory_hits = 0
        self.store_hits = 0
        self.store_skipped = 0
        self._errors = ErrorLog(f"cache store {self.store_kind}")
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._degraded = False
        self._retry_at = 0.0
        self.last_error: str | None = None
        self.last_error_at: float | None = None  # wall clock (time.time()) of the last error

    @property
    def store_degraded(self) -> bool:
        """True from a store error until the next store call that succeeds."""
        return self._degraded

    @property
    def store_errors(self) -> int:
        return self._errors.count

    @property
    def store_kind(self) -> str:
        if self.store is None:
            return "none"
        return str(getattr(self.store, "kind", type(self.store).__name__))

    def _guarded(self, op: str) -> _Guarded:
        """``with self._guarded(op) as call:`` around one store call, sync or async: its
        exception counted and absorbed, its success ending degraded mode (``call.ok``)."""
        return _Guarded(self, op)

    def _store_failed(self, op: str, exc: BaseException) -> None:
        self._errors.record(op, exc)
        with self._lock:
            self._degraded = True
            self._retry_at = self._clock() + self._retry_after_s
            self.last_error, self.last_error_at = f"{op}: {exc!r}", time.time()

    def _store_ok(self) -> None:
        if self._degraded:
            with self._lock:
                if self._degraded:
                    self._degraded = False
                    log.warning("cache store %s is back", self.store_kind)

    def _live_store(self) -> ByteStore | None:
        """The store, or None when there is none or it is skipped while degraded."""
        if self.store is None or not self._degraded or self._clock() >= self._retry_at:
            return self.store
        with self._lock:
            self.store_skipped += 1
        return None

    def _from_memory(
        self, keys: Sequence[str], counted: bool
    ) -> tuple[list[bytes | None], list[int]]:
        values = self.memory.mget(keys)
        missing = [i for i, v in enumerate(values) if v is None]
        if counted and len(missing) < len(keys):
            with self._lock:
                self.memory_hits += len(keys) - len(missing)
        return values, missing

    def _merge(
        self,
        keys: Sequence[str],
        values: list[bytes | None],
        missing: list[int],
        fetched: Sequence[bytes | None],
        counted: bool,
    ) -> list[bytes | None]:
        promote = []
        for i, value in zip(missing, fetched, strict=True):
            if value is not None:
                values[i] = value
                promote.append((keys[i], value))
        if promote:
            self.memory.mset(promote)
        if promote and counted:
            with self._lock:
                self.store_hits += len(promote)
        return values

    def mget(self, keys: Sequence[str], *, counted: bool = True) -> list[bytes | None]:
        """``counted=False``: a read that is no cache lookup (``read_uncounted``)."""
        values, missing = self._from_memory(keys, counted)
        store = self._live_store() if missing else None
        if store is None:
            return values
        with self._guarded("mget") as call:
            fetched = store.mget([keys[i] for i in missing])
        return self._merge(keys, values, missing, fetched, counted) if call.ok else values

    async def amget(self, keys: Sequence[str], *, counted: bool = True) -> list[bytes | None]:
        values, missing = self._from_memory(keys, counted)
        store = self._live_store() if missing else None
        if store is None:
            return values
        with self._guarded("mget") as call:
            fetched = await store.amget([keys[i] for i in missing])
        return self._merge(keys, values, missing, fetched, counted) if call.ok else values

    def mset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        store = self._live_store() if key_value_pairs else None
        if store is not None:
            with self._guarded("mset"):
                store.mset(key_value_pairs)
        self.memory.mset(key_value_pairs)

    async def _awrite(self, write: Callable[[ByteStore], Awaitable[None]]) -> None:
        """``write`` to the store, unless it is skipped while degraded: a failure is counted
        and absorbed (``amset``, ``amset_rows``)."""
        store = self._live_store()
        if store is not None:
            with self._guarded("mset"):
                await write(store)

    async def amset(self, key_value_pairs: Sequence[tuple[str, bytes]]) -> None:
        if key_value_pairs:
            await self._awrite(lambda store: store.amset(key_value_pairs))
        self.memory.mset(key_value_pairs)

    async def amset_rows(
        self, rows: codec.RowEntries, extra: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """``amset`` of ``rows`` and ``extra``, the rows encoded by the store itself when
        this tier keeps no copy in memory (the engine process's shared tier: a writer child
        encodes them in its own interpreter), else here, once, for both tiers."""
        if not self.memory.keeps_nothing or not isinstance(self.store, CacheStore):
            await self.amset([*rows.entries(), *extra])
        elif len(rows.keys) or extra:
            await self._awrite(lambda store: cast("CacheStore", store).amset_rows(rows, extra))

    def mdelete(self, keys: Sequence[str]) -> None:
        if self.store is not None and keys:
            with self._guarded("mdelete"):
                self.store.mdelete(keys)
        self.memory.mdelete(keys)

    async def amdelete(self, keys: Sequence[str]) -> None:
        if self.store is not None and keys:
            with self._guarded("mdelete"):
                await self.store.amdelete(keys)
        self.memory.mdelete(keys)

    def yield_keys(self, *, prefix: str | None = None) -> Iterator[str]:
        # Memory is bounded, so remembering its keys to skip duplicates is cheap.
        seen = set(self.memory.yield_keys(prefix=prefix))
        yield from seen
        if self.store is None:
            return
        with self._guarded("yield_keys"):
            for key in self.store.yield_keys(prefix=prefix):
                if key not in seen:
                    yield str(key)

    async def ayield_keys(self, *, prefix: str | None = None) -> AsyncIterator[str]:
        seen = set(self.memory.yield_keys(prefix=prefix))
        for key in seen:
            yield key
        if self.store is None:
            return
        with self._guarded("yield_keys"):
            async for key in self.store.ayield_keys(prefix=prefix):
                if key not in seen:
                    yield str(key)

    def _memory_contains(self, keys: Sequence[str]) -> tuple[list[bool], list[int]]:
        found = self.memory.contains(keys)
        return found, [i for i, f in enumerate(found) if not f]

    def _merge_found(
        self, found: list[bool], missing: list[int], in_store: Sequence[bool]
    ) -> list[bool]:
        for i, f in zip(missing, in_store, strict=True):
            found[i] = f
        return found

    def contains(self, keys: Sequence[str]) -> list[bool]:
        found, missing = self._memory_contains(keys)
        store = self._live_store() if missing else None
        if store is None:
            return found
        sub = [keys[i] for i in missing]
        with self._guarded("contains") as call:
            if isinstance(store, CacheStore):
                in_store = store.contains(sub)
            else:
                in_store = [v is not None for v in store.mget(sub)]
        return self._merge_found(found, missing, in_store) if call.ok else found

    async def acontains(self, keys: Sequence[str]) -> list[bool]:
        found, missing = self._memory_contains(keys)
        store = self._live_store() if missing else None
        if store is None:
            return found
        sub = [keys[i] for i in missing]
        with self._guarded("contains") as call:
            if isinstance(store, CacheStore):
                in_store = await store.acontains(sub)
            else:
                in_store = [v is not None for v in await store.amget(sub)]
        return self._merge_found(found, missing, in_store) if call.ok else found

    def info(self) -> dict[str, Any]:
        store_info: dict[str, Any] = {"kind": self.store_kind}
        if isinstance(self.store, CacheStore):
            store_info = {**self.store.info(), "kind": self.store_kind}
        return {
            "kind": self.kind,
            "memory": {**self.memory.info(), "hits": self.memory_hits},
            "store": {**store_info, **self.store_health()},
        }

    def store_health(self) -> dict[str, Any]:
        """The store tier's counters and state, shaped for ``stats()["tiers"]["store"]``."""
        return {
            "kind": self.store_kind,
            "hits": self.store_hits,
            "errors": self.store_errors,
            "degraded": self._degraded,
            "skipped": self.store_skipped,
            "last_error": self.last_error,
            "last_error_at": self.last_error_at,
        }

    def close(self) -> None:
        if isinstance(self.store, CacheStore):
            self.store.close()

    async def aclose(self) -> None:
        if isinstance(self.store, CacheStore):
            await self.store.aclose()


def _layout(path: Path, partitions: int) -> int:
    """How many partitions the store in ``path`` has: as many as it was made with (recorded
    in its ``partitions`` file by the first process that opened it; a directory with a
    ``data.mdb`` and no such file is a cache made before partitions, one environment), else
    ``partitions``, recorded now. A count asked of a directory made with another is said in
    the log (the layout of a cache with entries never changes under its readers)."""
    if partitions < 1:
        raise ValueError(f"an LMDB store needs at least 1 partition, got {partitions}")
    recorded = path / LAYOUT_FILE
    if not recorded.exists() and (path / "data.mdb").exists():
        return 1
    tmp = path / f"{LAYOUT_FILE}.{os.getpid()}.{threading.get_ident()}"
    with tmp.open("w") as out:
        out.write(f"{partitions}\n")
        out.flush()
        os.fsync(out.fileno())
    try:
        os.link(tmp, recorded)  # atomic: the first of several processes opening it decides
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    made = int(recorded.read_text())
    if made != partitions and partitions > 1:  # an operator's count that cannot apply
        log.warning("%s: %d LMDB partitions, as it was made (%d asked)", path, made, partitions)
    return made


def fsync_options(every_s: float) -> dict[str, Any]:
    """``LmdbByteStore``'s ``sync`` and ``sync_every_s`` for ``FLEETCACHE_LMDB_FSYNC_EVERY_S``
    (0: an fsync at every commit)."""
    return {"sync": every_s <= 0, "sync_every_s": every_s if every_s > 0 else None}


def build_store(
    kind: str,
    *,
    memory_bytes: int,
    data_dir: Path | str | None = None,
    map_size: int = 4 * GiB,
    lmdb_fsync_every_s: float = 0.0,
    lmdb_partitions: int = 1,
    redis_url: str | None = None,
    redis_prefix: str = "fc:",
    redis_ttl_s: float | None = None,
    redis_timeout_s: float = 0.25,
    retry_after_s: float = 1.0,
    lmdb_write_executor: Executor | None = None,
) -> TieredByteStore:
    """The tiered store for ``FLEETCACHE_STORE``: ``memory`` | ``lmdb`` | ``redis``.

    LMDB lives in ``data_dir / "cache.lmdb"`` (in ``lmdb_partitions`` environments when the
    directory is new), with an fsync at every commit, or without (``lmdb_fsync_every_s`` >
    0: an fsync that often; ``LmdbByteStore``); Redis at
    ``redis_url`` under ``redis_prefix``. ``lmdb_write_executor``: where LMDB's async commits
    run (``LmdbByteStore``).
    """
    memory = MemoryByteStore(memory_bytes)
    store: CacheStore | None
    if kind == "memory":
        store = None
    elif kind == "lmdb":
        if data_dir is None:
            raise ValueError("store kind 'lmdb' needs a data_dir")
        store = LmdbByteStore(
            Path(data_dir) / "cache.lmdb",
            map_size,
            partitions=lmdb_partitions,
            write_executor=lmdb_write_executor,
            **fsync_options(lmdb_fsync_every_s),
        )
    elif kind == "redis":
        if not redis_url:
            raise ValueError("store kind 'redis' needs a redis_url")
        store = RedisByteStore(
            redis_url,
            prefix=redis_prefix,
            ttl_s=redis_ttl_s,
            socket_timeout_s=redis_timeout_s,
            expiry_of=codec.expires_at,  # entries written with a TTL expire in Redis too
        )
    else:
        raise ValueError(f"unknown cache store kind {kind!r}; use 'memory', 'lmdb' or 'redis'")
    return TieredByteStore(memory, store, retry_after_s=retry_after_s)


async def read_uncounted(store: ByteStore, keys: Sequence[str]) -> list[bytes | None]:
    """``store.amget(keys)`` for a read that is no cache lookup (an entity's link, the drift
    check's stored vectors): a tiered store counts no tier hit for it (API.md's tier hits are
    where lookups were found)."""
    if isinstance(store, TieredByteStore):
        return await store.amget(keys, counted=False)
    return await store.amget(keys)
