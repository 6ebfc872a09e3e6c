"""The engine's side of every miss: what one engine process owns (ARCHITECTURE.md, "Processes").

    EngineHost
      engine       FallbackEngine: the configured engine, watched, with an optional stand-in
      batcher      lanes (dispatch before warm-up), deadlines, token budget, tokenize-ahead;
                   counts items, and the misses by caller at the same moment (so that
                   ``misses == inference.items`` whatever fails afterwards)
      flight       one in-flight map for every worker: an identical text sent through any
                   number of workers at once is computed once (one miss, the rest coalesced),
                   its rows written back to the shared tier (LMDB | Redis) before the entry
                   is dropped
      board        this process's counters (proxy.board)

A server runs it in its engine process, reached over IPC (``proxy.processes``); ``create_app``
without the supervisor runs it in-process (tests). The workers call ``embed`` either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import asdict
from itertools import repeat
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import zmq

from cache.flight import Flown, Since, SingleFlight, Vectors
from cache.stores import TieredByteStore
from cache.writer import VectorWriter
from engines.base import BatchError, Engine, EngineInfo
from engines.batcher import Batcher, EngineHealth, deadline_after, name_thread
from engines.fallback import FallbackEngine
from engines.registry import create_engine
from engines.tokenization import FastTokenizer, TokenizedTexts
from features.text import TEXT_SCHEMA_VERSION
from proxy.board import Board
from proxy.cores import lower, usable_cores
from proxy.device_process import DeviceProcessEngine, use_device_process
from proxy.gpu_health import GpuCheck
from proxy.ipc import Blobs, Handler, RpcClient, RpcServer, frame_rows, rows_frame
from proxy.lmdb_writer import LmdbWriterStore
from proxy.settings import Settings
from proxy.telemetry import (
    LANE_QUEUE_WAIT,
    REQUEST_STAGES,
    BoardCacheStats,
    StageTimingEngine,
)

log = logging.getLogger("fleetcache.engine")
Msg = dict[str, Any]
Frames = list[zmq.Frame]
Out = tuple[Msg, Blobs]

# The caller of the flight being computed: the flight's compute task inherits it from the
# ``embed`` call that started it, and the batcher counts that flight's misses under it.
_CALLER: ContextVar[str] = ContextVar("fleetcache_engine_caller", default="dispatch")


def cache_namespace(info: EngineInfo) -> str:
    """Vectors of another engine fingerprint or text schema never mix (ARCHITECTURE.md)."""
    return f"t{TEXT_SCHEMA_VERSION}-{info.fingerprint}"


def engine_name(engine: int) -> str:
    """Engine ``engine``'s socket and identity file in the run directory (of a device list)."""
    return "engine" if engine == 0 else f"engine-{engine}"


def engine_options(
    settings: Settings, kind: str | None = None, device: str | None = None
) -> dict[str, Any]:
    """``create_engine`` options of the configured engine, or of another kind/device (the
    first of a device list unless told)."""
    device = device or settings.devices[0]
    if (kind or settings.engine) == "fake":
        return {
            "delay_s": settings.fake_delay_ms / 1000.0,
            "fail_on": settings.fake_fail_on,
            "device": device,
        }
    options: dict[str, Any] = {
        "device": device,
        "max_seq_length": settings.max_seq_length,
    }
    if settings.model_path:
        options["model_path"] = settings.model_path
    return options


def build_engine(settings: Settings, device_cpus: Sequence[int] = ()) -> FallbackEngine:
    """The configured engine, watched: unhealthy on a failed batch, a batch p99 over
    ``max_batch_p99_ms`` or a hard fault of its GPU, then misses go to the fallback (same
    fingerprint only) or get 503; degraded by a soft reading of its GPU (``GpuCheck`` every
    ``gpu_health_interval_s``, on a CUDA device only). ``device_cpus``: where its device
    child runs (``proxy.cores.CpuPlan``; empty: where this process does)."""
    options = engine_options(settings)
    if use_device_process(settings.device_process, options["device"], settings.engine):
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        budget = settings.max_batch_tokens
        primary: Engine = DeviceProcessEngine(
            settings.engine, options, log_level=level, max_batch_tokens=budget, cpus=device_cpus
        )
    else:
        primary = create_engine(settings.engine, **options)
    fallback = None
    if settings.fallback_engine is not None:
        kind, device = settings.fallback_engine, settings.fallback_device
        fallback = create_engine(kind, **engine_options(settings, kind, device))
    watch = None
    if settings.gpu_health_interval_s > 0:
        watch = GpuCheck(lambda: primary.info.device, max_temp_c=settings.gpu_max_temp_c)
    return FallbackEngine(
        primary,
        fallback,
        max_batch_p99_ms=settings.max_batch_p99_ms,
        watch=watch,
        watch_interval_s=settings.gpu_health_interval_s or 5.0,
    )


class EngineHost:
    """See the module docstring. Build it with ``open_engine_host``."""

    def __init__(
        self,
        settings: Settings,
        engine: Engine,
        board: Board,
        stats: BoardCacheStats,
        writer: VectorWriter | None,
        store: TieredByteStore | None = None,
    ) -> None:
        """``engine``: loaded and warm; the batcher over it is started by whoever enters
        ``host.batcher`` (``open_engine_host``). ``store``: the shared tier this host owns
        (the engine process of ``fleetcache serve``), whose failures it reports; None when
        the process's services report it."""
        self.settings = settings
        self.store = store
        self.writer = writer
        self.engine = engine
        self.board = board
        self.batcher = batcher = Batcher(
            StageTimingEngine(engine, board),
            max_batch_size=settings.max_batch_size,
            max_delay_ms=settings.max_delay_ms,
            max_queue=settings.max_queue,
            max_batch_tokens=settings.max_batch_tokens,
            on_queue_wait=self._queue_wait,
            on_sent=self._sent,
            on_batch_done=self.publish,
        )
        self.stats = stats
        self.info = engine.info
        self.namespace = cache_namespace(engine.info)
        self._key_prefix = f"{self.namespace}:"  # of the store keys this engine writes
        self.tokenizer = engine.tokenizer()  # the workers tokenize with the same file, if any
        self._deadlines_ms = {
            "dispatch": settings.dispatch_deadline_ms,
            "warmup": settings.warmup_deadline_ms,
        }
        self.flight = SingleFlight(
            self._compute,
            engine.info.dim,
            write_back=None if writer is None else self._write_back,
            stats=stats,
            count_misses=False,  # the batcher counts them, as it hands them to the engine
            per_item_ms=lambda: batcher.per_item_ms,
            on_settled=self.publish,  # the in-flight gauge, once written back
            max_unwritten=settings.max_unwritten if writer is not None else None,
            own_rows=True,  # each request's rows are its own (``Batcher.submit``)
        )

    def _queue_wait(self, lane: str, seconds: float) -> None:
        board = self.board
        board.observe(REQUEST_STAGES, ("queue_wait",), seconds)
        board.observe(LANE_QUEUE_WAIT, (lane,), seconds)
        board.recent("queue_wait", seconds * 1000.0)

    async def _write_back(self, *args: Any) -> bool:
        """The writer's ``write_rows``, timed (``write_back``: computed to committed)."""
        assert self.writer is not None
        started = time.perf_counter()
        try:
            return await self.writer.write_rows(*args)
        finally:
            self.board.observe(REQUEST_STAGES, ("write_back",), time.perf_counter() - started)

    def _sent(self, caller: str, count: int) -> None:
        """Texts handed to the engine: misses and items counted at the same moment."""
        self.stats.record(caller, 0, 0, count, 0.0)
        self.publish()

    async def _compute(self, texts: Sequence[str], lane: str) -> Vectors:
        deadline = deadline_after(self._deadlines_ms[lane])
        return await self.batcher.submit(texts, lane, deadline, tag=_CALLER.get())

    def _own_keys(self, keys: Sequence[str]) -> bool:
        """Whether each of ``keys`` is a string of this engine's namespace (one C call a key:
        ``str.startswith`` refuses any other type)."""
        try:
            return all(map(str.startswith, keys, repeat(self._key_prefix)))
        except TypeError:
            return False

    async def embed(
        self,
        texts: Sequence[str],
        *,
        lane: str,
        caller: str,
        ttl_s: Mapping[str, float],
        since: Since = None,
        links: Sequence[tuple[str, str, str]] = (),
        durable: bool = True,
        keys: Sequence[str] | None = None,
    ) -> Flown:
        """Rows of ``texts`` (the misses of some worker's cache), computed once across every
        caller in flight; ``coalesced`` marks the texts that joined another computation.
        ``since``, ``links``, ``durable``, ``keys``: as ``cache.flight.SingleFlight.embed``
        (keys of another namespace than this engine's are not used)."""
        if keys is not None and (len(keys) != len(texts) or not self._own_keys(keys)):
            keys = None
        token = _CALLER.set(caller)
        try:
            return await self.flight.embed(
                texts,
                lane=lane,
                caller=caller,
                ttl_s=ttl_s,
                since=since,
                links=links,
                durable=durable,
                keys=keys,
            )
        finally:
            _CALLER.reset(token)
            self.publish()

    def health(self) -> EngineHealth:
        return self.batcher.engine_health()

    def device_health(self) -> list[dict[str, Any]]:
        """In one process, one engine on the first device of the list."""
        return [{"device": self.settings.devices[0], "up": True, **asdict(self.health())}]

    async def reembed(self, texts: Sequence[str]) -> Vectors:
        """Fresh vectors of ``texts`` on the warm-up lane, bypassing the cache and the
        in-flight map: a drift check's, counted in ``inference.drift_items`` only."""
        deadline = deadline_after(self._deadlines_ms["warmup"])
        try:
            return await self.batcher.submit(texts, "warmup", deadline, counted=False)
        finally:
            self.publish()

    async def hit_texts(self, own: Sequence[str]) -> list[str]:
        """The texts of every worker's hit reservoir: in one process, ``own``."""
        return list(own)

    def per_item_ms(self) -> float:
        return self.batcher.per_item_ms

    async def invalidate(self, keys: Sequence[str]) -> dict[str, Any]:
        """In one process there is no other memory tier to reach."""
        return {"workers": 1, "silent": []}

    def facts(self) -> dict[str, Any]:
        """What the board cannot hold: the engine's identity, health and last error (every
        worker's ping asks, five times a second: nothing here may cost a percentile)."""
        batcher = self.batcher
        return {
            "info": asdict(self.info),
            "namespace": self.namespace,
            "health": asdict(self.health()),
            "last_error": batcher.last_error,
            "per_item_ms": batcher.per_item_ms,
            "store": None if self.store is None else self.store.store_health(),
            "device_process": self._device_process(),
            "tokenizer": None
            if (t := self.tokenizer) is None
            else {
                "path": str(t.path.parent),
                "max_seq_length": t.max_seq_length,
                "digest": t.digest,
            },
        }

    def _device_process(self) -> dict[str, Any] | None:
        """The device child's pid, starts and why it is down (None: the device runs here)."""
        primary = getattr(self.engine, "primary", self.engine)
        return primary.health() if isinstance(primary, DeviceProcessEngine) else None

    def publish(self) -> None:
        """Mirror the batcher's totals and the queue onto the board (after every batch and
        every embed: a reader then sees them as of the last change)."""
        board = self.board
        names = (
            *("items", "batches", "failed_batches", "expired_items", "ok_items", "engine_ms"),
            "drift_items",  # the batcher's uncounted items: drift checks' re-embeds
        )
        for name, value in zip(names, self.batcher.totals(), strict=True):
            board.put(f"inference.{name}", value)
        board.gauge("queue.depth", self.batcher.queued)
        board.gauge("cache.in_flight", self.flight.in_flight)
        board.gauge("cache.unwritten", self.flight.unwritten)
        board.put("cache.store_waits", self.flight.store_waits)
        if self.store is not None:  # its write-backs' failures (a full LMDB map, Redis down)
            links = self.writer.errors.count if self.writer is not None else 0
            board.put("cache.store_errors", self.store.store_errors + links)
            board.put("cache.store_skipped", self.store.store_skipped)
            board.gauge("cache.store_degraded", float(self.store.store_degraded))


@contextlib.asynccontextmanager
async def open_engine_host(
    settings: Settings,
    board: Board,
    engine: Engine | None = None,
    store: TieredByteStore | None = None,
    stats: BoardCacheStats | None = None,
    writer_cpus: Sequence[int] = (),
) -> AsyncIterator[EngineHost]:
    """Load and warm the engine (off the event loop), start the batcher, and write computed
    rows to the shared tier of ``store`` (built from the settings when not given; an
    in-process server passes its own, since LMDB may not be opened twice by one process).
    ``stats``: the lookup counters, when this process's cache shares them (one process).
    ``writer_cpus``: where an LMDB writer child runs (empty: where this process does)."""
    async with contextlib.AsyncExitStack() as stack:
        if engine is None:
            engine = build_engine(settings)
        log.info("loading engine %s", settings.engine)
        await asyncio.to_thread(engine.load)
        stack.callback(engine.close)
        await asyncio.to_thread(engine.warmup)
        info = engine.info
        log.info(
            "engine ready: %s on %s (%s), fingerprint %s",
            info.model,
            info.device,
            info.precision,
            info.fingerprint,
        )
        owned = store is None
        if store is None:
            store = await stack.enter_async_context(shared_tier(settings, writer_cpus))
        writer = None
        if store.store is not None:  # through the tiers: a degraded store is skipped a while
            writer = VectorWriter(store, namespace=cache_namespace(info))
        counts = stats or BoardCacheStats(board)
        host = EngineHost(settings, engine, board, counts, writer, store if owned else None)
        await stack.enter_async_context(host.batcher)
        stack.push_async_callback(host.flight.drain, 5.0)  # exits first: rows written back
        host.publish()
        yield host


WRITER_CHILD_CORES = 4  # FLEETCACHE_LMDB_WRITER=auto: a writer child from this many cores


def lmdb_writer(settings: Settings, cores: int | None = None) -> str:
    """Where the engine process's LMDB writes run: ``thread`` or ``process`` (a writer child,
    ``proxy.lmdb_writer``). ``auto``: the child with ``WRITER_CHILD_CORES`` usable cores or
    more (``proxy.cores``). Measured (``bench/serve_bench.py``, docs/BENCHMARKS.md,
    2026-12-02): on the H200 machine (16 cores) the child served 1.41x the new texts of the
    thread with the data dir on its disk (31,458 vs 22,315 texts/s, medians of two runs in
    turns; p99 144 vs 208 ms), 1.43x on tmpfs, where it also warmed 1.44x the features (a job
    on the disk: the same); on the 2-core box the same new texts (1.04x) and 0.80x the
    warm-up, its interpreter taking a share of two cores. On the H200 machine confined to
    fewer cores (``--server-cpus``, the disk, auto workers, 2026-12-03): 8 cores 1.40x the
    new texts (36,150 vs 25,850/s), 4 cores 1.20x and 1.15x (33,059 and 31,578 vs 27,581
    and 27,568/s) with the same warm-up (7,003 vs 6,846 features/s). 3 cores not measured."""
    if settings.lmdb_writer != "auto":
        return settings.lmdb_writer
    return "process" if (cores or usable_cores()) >= WRITER_CHILD_CORES else "thread"


AUTO_PARTITIONS = 8


def lmdb_partitions(settings: Settings, cores: int | None = None) -> int:
    """How many LMDB environments a new data dir's cache gets (``LmdbByteStore``; a data dir
    keeps the count it was made with). ``auto``: ``AUTO_PARTITIONS`` where the engine's writes
    run in a writer child (``lmdb_writer``), which then starts a writer process a partition;
    1 with the thread, which writes them one after another (on the 2-core box 4 served the
    same new texts as 1: 18,560 and 19,347 against 19,315 and 18,838/s). Measured on
    the H200 machine's disk (docs/BENCHMARKS.md, 2026-12-03): 8 environments with a writer
    process each took 4.1-4.9x the new entries a second of one (``bench/lmdb_write_bench.py``),
    and the server served 1.78x and 1.41x the new texts with 8 (68,768 and 56,522 against
    38,678 and 40,061/s, in turns), 2-3% of its engine calls waiting for the store against
    22-24%; a warm-up job the same (11,524-11,863 features/s both: the store does not bound
    it). Reads pay a read transaction a partition: +2% on lookups of 1,000 texts from LMDB
    (``bench/cache_bench.py``, 2-core box)."""
    if settings.lmdb_partitions != "auto":
        return settings.lmdb_partitions
    return AUTO_PARTITIONS if lmdb_writer(settings, cores) == "process" else 1


# How far below the engine process's other threads its LMDB commits run: the thread that
# commits them where it writes them itself (``lmdb_writer`` = thread, fewer than 4 cores), or
# the writer child and its partitions' writers (4 cores or more). They are write-backs, which
# no answer waits for but a warm-up job's and a fleet write's; a job's took about a third of a
# core on the 2-core box and 1.6-1.9 cores on the H100 machine, and new texts' competed with
# the batcher and the event loop. Measured (docs/BENCHMARKS.md): the thread, 2-core box
# (``bench/serve_bench.py --workers 2 --skip-hits --warmup 30000``, six runs in turns,
# 2026-12-05): new texts 17,322-19,936/s against 12,989-18,698 (p99 87-115 ms against
# 94-147), written back 0.7 s after the run against 0.1-0.3; cached lookups' p99 beside a job
# 9.9 ms against 11.2 (medians), the job alone as fast. The child, NVIDIA H100, 8 workers,
# a job of 200,000 drivers, two rounds in turns (2026-12-06): cached lookups' p99 beside the
# job 1.4-1.5x alone against 1.8-2.0x (each of four rounds within 1.5x, against none), new
# texts 67,248-77,245/s against 61,661-68,253, the job alone 44,541-45,226 features/s
# against 34,944-45,470.
STORE_WRITE_NICE = 10


@contextlib.asynccontextmanager
async def shared_tier(
    settings: Settings, writer_cpus: Sequence[int] = ()
) -> AsyncIterator[TieredByteStore]:
    """The shared tier alone (no memory tier): what the engine process writes rows to; LMDB's
    writes through a writer child (``proxy.lmdb_writer``, on ``writer_cpus``) where
    ``lmdb_writer`` says so, else committed by a thread of this process below its others
    (``STORE_WRITE_NICE``)."""
    from cache import stores

    map_size = int(settings.lmdb_map_size_gb * 2**30)

    def below_the_others() -> None:
        name_thread("store-write")
        lower(threading.get_native_id(), STORE_WRITE_NICE)

    committer = ThreadPoolExecutor(
        max_workers=1, thread_name_prefix="store-write", initializer=below_the_others
    )
    if settings.store == "lmdb" and lmdb_writer(settings) == "process":
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        writer = LmdbWriterStore(
            settings.lmdb_path,
            map_size,
            fsync_every_s=settings.lmdb_fsync_every_s,
            partitions=lmdb_partitions(settings),
            log_level=level,
            nice=STORE_WRITE_NICE,
            cpus=writer_cpus,
        )
        tier = stores.TieredByteStore(stores.MemoryByteStore(0), await writer.start())
    else:
        tier = stores.build_store(
            settings.store,
            memory_bytes=0,
            data_dir=settings.data_dir,
            map_size=map_size,
            lmdb_fsync_every_s=settings.lmdb_fsync_every_s,
            lmdb_partitions=lmdb_partitions(settings),
            redis_url=settings.redis_url,
            lmdb_write_executor=committer,
        )
    try:
        yield tier
    finally:
        await tier.aclose()
        committer.shutdown(wait=False)


# -- over IPC ------------------------------------------------------------------------------


def tokenized(message: Msg, blobs: Frames, tokenizer: FastTokenizer | None) -> list[str]:
    """An embed call's texts, with their token ids when the worker sent ids of ``tokenizer``
    (``RemoteEngine._token_ids``: a ``TokenizedTexts``, no object a text); plain otherwise."""
    texts: list[str] = message["texts"]
    if len(blobs) < 2 or tokenizer is None or message.get("tokenizer") != tokenizer.digest:
        return texts
    flat, bounds = np.frombuffer(blobs[0].buffer, "<i4"), np.frombuffer(blobs[1].buffer, "<i8")
    if len(bounds) != len(texts) + 1 or bounds[0] != 0 or bounds[-1] != len(flat):
        raise ValueError(f"token ids cut at {len(bounds)} bounds for {len(texts)} texts")
    return TokenizedTexts(texts, flat, bounds)


def engine_handlers(host: EngineHost, server: RpcServer) -> dict[str, Handler]:
    """The ops of ``RemoteEngine``, served by the engine process."""

    async def ping(message: Msg, blobs: Frames) -> Out:
        return host.facts(), ()

    async def embed(message: Msg, blobs: Frames) -> Out:
        started = time.perf_counter()
        flown = await host.embed(
            tokenized(message, blobs, host.tokenizer),
            lane=message["lane"],
            caller=message["caller"],
            ttl_s=message["ttl"],
            since=message.get("since"),
            links=[tuple(link) for link in message.get("links") or ()],
            durable=bool(message.get("durable", True)),
            keys=message.get("keys"),
        )
        host.board.observe(REQUEST_STAGES, ("engine_embed",), time.perf_counter() - started)
        return {"coalesced": bytes(flown.coalesced)}, [rows_frame(flown.rows)]

    async def reembed(message: Msg, blobs: Frames) -> Out:
        return {}, [rows_frame(await host.reembed(message["texts"]))]

    async def hit_texts(message: Msg, blobs: Frames) -> Out:
        """Every worker's hit reservoir (a worker that does not answer adds nothing)."""
        answers = await server.call_peers("hits", b"worker-", 5.0)
        texts = [t for answer in answers.values() if answer for t in answer["texts"]]
        return {"texts": texts, "workers": len(answers)}, ()

    async def invalidate(message: Msg, blobs: Frames) -> Out:
        """Drop keys from every worker's memory tier; answers once each worker has."""
        answers = await server.call_peers("drop", b"worker-", 5.0, keys=message["keys"])
        silent = [peer.decode() for peer, answer in answers.items() if answer is None]
        return {"workers": len(answers), "silent": silent}, ()

    return {
        "ping": ping,
        "embed": embed,
        "invalidate": invalidate,
        "reembed": reembed,
        "hit_texts": hit_texts,
    }


MERGED_TEXTS = 256  # a worker's merged engine call holds at most this many texts (default)


class _Part(NamedTuple):
    """One caller's share of a merged call: its texts (from ``start`` in the call) and its
    own arguments."""

    waiter: asyncio.Future[Flown]
    start: int
    texts: Sequence[str]
    keys: Sequence[str] | None
    ttl: Mapping[str, float]
    since: float | None
    links: Sequence[tuple[str, str, str]]


class _Merged:
    """The misses of a worker's ``embed`` calls made in one turn of its loop, with the same
    lane, caller and durability: one engine call. Each caller waits on a future of its own
    for its slice of the answer."""

    __slots__ = ("caller", "durable", "lane", "parts", "size")

    def __init__(self, lane: str, caller: str, durable: bool) -> None:
        self.lane, self.caller, self.durable = lane, caller, durable
        self.parts: list[_Part] = []
        self.size = 0  # texts

    def add(
        self,
        texts: Sequence[str],
        ttl_s: Mapping[str, float],
        since: float | None,
        links: Sequence[tuple[str, str, str]],
        keys: Sequence[str] | None,
    ) -> asyncio.Future[Flown]:
        """A caller's texts; the future of its slice of the answer."""
        waiter: asyncio.Future[Flown] = asyncio.get_running_loop().create_future()
        self.parts.append(_Part(waiter, self.size, texts, keys, ttl_s, since, links))
        self.size += len(texts)
        return waiter


def _call_arguments(parts: Sequence[_Part]) -> dict[str, Any]:
    """The engine call of ``parts``: their texts, keys and links one after the other; a
    text's ttl its first caller's (as if it computed alone); ``since`` each caller's, for its
    own texts (``cache.flight.Since``): a text written back between two callers' lookups is
    joined by the caller whose lookup began before (it could not have found it), computed
    again for one whose lookup began after (it missed it: expired, dropped or failed). With
    the latest of them for the whole call, the first caller's text was computed twice (once
    in 80 calls of 8 texts through two engines, tests/test_devices.py)."""
    ttl: dict[str, float] = {}
    for part in reversed(parts):
        ttl.update(part.ttl)
    return {
        "texts": [text for part in parts for text in part.texts],
        "keys": None if parts[0].keys is None else [k for p in parts for k in p.keys or ()],
        "ttl": ttl,
        "since": parts[0].since
        if len(parts) == 1
        else [[len(part.texts), part.since] for part in parts],
        "links": [link for part in parts for link in part.links],  # tuples: msgpack arrays
    }


def _answer(part: _Part, outcome: Flown | BaseException, offset: int = 0) -> None:
    """A caller's outcome: its slice of the call's rows (which begin at its text ``offset``
    of the merged call), or the error."""
    waiter = part.waiter
    if waiter.done():  # its caller went away
        return
    if isinstance(outcome, asyncio.CancelledError):  # the worker is stopping
        waiter.cancel()
    elif isinstance(outcome, BaseException):
        waiter.set_exception(outcome)
    else:
        start, stop = part.start - offset, part.start - offset + len(part.texts)
        waiter.set_result(Flown(outcome.rows[start:stop], outcome.coalesced[start:stop]))


class RemoteEngine:
    """The engine process, as the workers see it: a ``Flight`` for their caches, its health
    and identity from the last ping (no round trip for /readyz).

    ``embed`` calls made in one turn of the worker's loop go as one engine call (up to
    ``merged_texts`` texts; per lane, caller, durability and keys given or not): the engine
    process's loop pays for each call besides each text, and under load a worker's loop
    finishes several requests' lookups in one turn (on the 2-core box 2.5-2.9 of them a call
    at 16 connections, and the engine's loop 24% less CPU a new text: docs/BENCHMARKS.md).
    A text in two of them is computed once (the later one coalesced, as across two calls);
    each caller gets its own slice. A merged call that fails by what it held (``BatchError``:
    the batcher ran it alone as one request) is sent again one caller's part at a time, so
    that only the caller whose texts fail gets the error, as without merging."""

    def __init__(
        self,
        client: RpcClient,
        info: EngineInfo,
        on_call: Callable[[float], None] | None = None,
        merged_texts: int = MERGED_TEXTS,
    ) -> None:
        """``on_call(seconds)``: each engine call's time from sent to answered (the
        ``engine_call`` stage; the worker's own tokenizing not in it). ``merged_texts``: at
        most this many texts in a merged call (no more than the engine's ``max_queue``, or
        calls that fit alone would be refused together as too large); a call of more goes
        alone."""
        self.client = client
        self.info = info
        self._on_call = on_call
        self._merged_texts = merged_texts
        self._tokenizer: FastTokenizer | None = None
        self._open: dict[tuple[str, str, bool, bool], _Merged] = {}  # filling this turn
        self._calls: set[asyncio.Task[None]] = set()

    def _token_ids(self, texts: Sequence[str]) -> tuple[dict[str, Any], Blobs]:
        """The texts' token ids when the engine pads ids of a tokenizer this process has: one
        int32 frame of them all, and one int64 frame of where each text's begin (and the last
        ends): tokenizing here, on the worker's core, leaves the engine process's one
        interpreter only the padding."""
        wanted = self.facts().get("tokenizer")
        if not wanted or not texts:
            return {}, ()
        tokenizer = self._tokenizer
        if tokenizer is None or tokenizer.digest != wanted["digest"]:
            tokenizer = FastTokenizer(Path(wanted["path"]), wanted["max_seq_length"])
            if tokenizer.digest != wanted["digest"]:
                return {}, ()  # another file by now: the engine tokenizes
            self._tokenizer = tokenizer
        sent = TokenizedTexts.of(texts, tokenizer.ids(texts))
        return {"tokenizer": tokenizer.digest}, [sent.flat.data, sent.bounds.data]

    async def embed(
        self,
        texts: Sequence[str],
        *,
        lane: str,
        caller: str,
        ttl_s: Mapping[str, float],
        since: float | None = None,
        links: Sequence[tuple[str, str, str]] = (),
        durable: bool = True,
        keys: Sequence[str] | None = None,
    ) -> Flown:
        group = (lane, caller, durable, keys is not None)
        merged = self._open.get(group)
        if merged is None or merged.size + len(texts) > self._merged_texts:
            merged = self._open[group] = _Merged(lane, caller, durable)
            task = asyncio.create_task(self._call(group, merged))  # it starts next turn
            self._calls.add(task)
            task.add_done_callback(self._calls.discard)
        return await merged.add(texts, ttl_s, since, links, keys)

    async def _call(self, group: tuple[str, str, bool, bool], merged: _Merged) -> None:
        if self._open.get(group) is merged:  # it holds every call of the turn it was opened in
            del self._open[group]
        outcome: Flown | BaseException
        try:
            outcome = await self._send(merged, merged.parts)
        except BatchError as exc:  # failed by what it held: each caller's part alone (as
            if len(merged.parts) > 1:  # the batcher does), only those whose texts fail fail
                await asyncio.gather(*(self._alone(merged, part) for part in merged.parts))
                return
            outcome = exc
        except BaseException as exc:  # every caller gets the call's error
            outcome = exc
        for part in merged.parts:
            _answer(part, outcome)
        if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
            raise outcome

    async def _alone(self, merged: _Merged, part: _Part) -> None:
        try:
            outcome = await self._send(merged, [part])
        except BaseException as exc:
            _answer(part, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            _answer(part, outcome, offset=part.start)

    async def _send(self, merged: _Merged, parts: Sequence[_Part]) -> Flown:
        """One engine call of ``parts`` of ``merged`` (its lane, caller and durability)."""
        arguments = _call_arguments(parts)
        tokens, blobs = self._token_ids(arguments["texts"])
        started = time.perf_counter()
        reply, frames = await self.client.call(
            "embed",
            blobs,
            **tokens,
            **arguments,
            lane=merged.lane,
            caller=merged.caller,
            durable=merged.durable,
        )
        if self._on_call is not None:
            self._on_call(time.perf_counter() - started)
        return Flown(frame_rows(frames[0], self.info.dim), [bool(c) for c in reply["coalesced"]])

    def health(self) -> EngineHealth:
        if not self.client.up:
            return EngineHealth(False, "the engine process is not answering", "none")
        return EngineHealth(**self.client.facts["health"])

    def facts(self) -> dict[str, Any]:
        return self.client.facts if self.client.up else {}

    async def invalidate(self, keys: Sequence[str]) -> dict[str, Any]:
        reply, _ = await self.client.call("invalidate", keys=list(keys), timeout_s=10.0)
        return reply

    async def reembed(self, texts: Sequence[str]) -> Vectors:
        # no timeout, as for embed: a large sample behind a warm-up job may take minutes
        _, frames = await self.client.call("reembed", texts=list(texts))
        return frame_rows(frames[0], self.info.dim)

    async def hit_texts(self, own: Sequence[str]) -> list[str]:
        """Every worker's reservoir, this one's included (the engine process asks each)."""
        reply, _ = await self.client.call("hit_texts", timeout_s=10.0)
        return list(reply["texts"])
