"""What the routes work with: a worker's services, built once and torn down in reverse order.

    Services
      embedder   CachedEmbedder: this process's memory tier -> the shared tier (LMDB | Redis);
                 its misses go to the engine (hits never leave the process)
      engine     EngineHost (everything in this process) | EngineRouter (the engine processes,
                 one per device: proxy.routing)
      index      IndexHost (everything in this process)  | RemoteIndex (the index owner)
      board      this process's counters; boards: every process's, for /v1/stats and /metrics
      latency    request timings, onto the board
      reservoir  the texts this process's lookups found lately (the drift check samples them)

``open_local_services``: one process does everything (tests, ``create_app`` with an injected
engine, the direct-mode warm-up). ``open_worker_services``: an HTTP worker (or a warm-up job
process) of ``fleetcache serve``, a client of the engine process and of the index owner.
Either way the routes see the same ``Services``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from cache import stores
from cache.embedder import CachedEmbedder, EmbedResult
from cache.flight import Flight, Vectors
from cache.links import Entity
from cache.stores import TieredByteStore
from engines.base import Engine, EngineInfo
from engines.batcher import EngineHealth
from features.models import DriverRecord, Position, Status
from features.text import driver_text
from proxy.board import Board, Boards
from proxy.drift import HitReservoir
from proxy.engine_host import (
    MERGED_TEXTS,
    RemoteEngine,
    cache_namespace,
    engine_name,
    lmdb_partitions,
    open_engine_host,
)
from proxy.index_host import IndexService, RemoteIndex, open_index_host
from proxy.ipc import RpcClient, ServiceUnavailableError, address
from proxy.routing import EngineRouter
from proxy.settings import Settings
from proxy.telemetry import BoardCacheStats, RequestLatency

log = logging.getLogger("fleetcache.proxy")

Progress = Callable[[int, int], None]  # (done, total)


class EngineService(Flight, Protocol):
    """The engine as a worker sees it: ``EngineHost`` or ``EngineRouter``."""

    info: EngineInfo

    def health(self) -> EngineHealth: ...

    def device_health(self) -> list[dict[str, Any]]: ...

    def facts(self) -> dict[str, Any]: ...

    async def invalidate(self, keys: Sequence[str]) -> dict[str, Any]: ...

    async def reembed(self, texts: Sequence[str]) -> Vectors: ...

    async def hit_texts(self, own: Sequence[str]) -> list[str]: ...


def lane_for(caller: str) -> str:
    """Warm-up jobs ride the low-priority lane so they never starve dispatch."""
    return "warmup" if caller == "warmup" else "dispatch"


@dataclass
class Services:
    settings: Settings
    embedder: CachedEmbedder
    engine: EngineService
    index: IndexService
    tiers: TieredByteStore
    board: Board
    boards: Boards
    run_dir: Path | None = None  # the server's shared directory (None: one process)
    reservoir: HitReservoir = field(default_factory=HitReservoir)  # fed by the embedder
    started: float = field(default_factory=time.monotonic)
    latency: RequestLatency = field(init=False)

    def __post_init__(self) -> None:
        self.latency = RequestLatency(self.board)
        self._shared: dict[str, dict[str, Any]] = {}

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    @property
    def ready(self) -> tuple[bool, str]:
        """What /readyz answers and /v1/stats shows: the engine's own reason first (primary
        failed, batch p99 over its limit, fallback serving, process down), then the index."""
        health = self.engine.health()
        if not health.healthy:
            return False, str(health.reason)
        if not self.index.up:
            return False, "the fleet index process is not answering"
        if not self.index.ready:
            return False, "fleet index loading"
        return True, "ready"

    async def wait_answering(self, timeout_s: float) -> list[str]:
        """Until an engine process and the index process answer (at most ``timeout_s``):
        the names of those that did not (none in one process)."""
        waits: dict[str, Awaitable[bool]] = {}
        if isinstance(self.engine, EngineRouter):
            waits["engine"] = self.engine.wait_up(timeout_s)
        if isinstance(self.index, RemoteIndex):
            waits["index"] = self.index.client.wait_up(timeout_s)
        answered = await asyncio.gather(*waits.values())
        return [name for name, up in zip(waits, answered, strict=True) if not up]

    def per_item_ms(self) -> float:
        return float(self.engine.facts().get("per_item_ms") or 0.0)

    async def embed(
        self, texts: Sequence[str], caller: str, lane: str | None = None
    ) -> EmbedResult:
        """Plain texts: no entity, so no TTL and no link. Answered as soon as the misses are
        computed: their write-back to the shared tier follows (they stay in flight until it
        lands), off the request's latency. ``lane``: the key's (None: the caller's)."""
        lane = lane or lane_for(caller)
        return await self.embedder.aembed(texts, caller=caller, lane=lane, durable=False)

    async def embed_entities(
        self, entities: Sequence[Entity], caller: str, lane: str | None = None
    ) -> EmbedResult:
        """Driver and vehicle records: their kind's TTL, and each linked to its vector."""
        settings = self.settings
        return await self.embedder.aembed_entities(
            entities,
            caller=caller,
            lane=lane or lane_for(caller),
            ttl_s={"driver": settings.cache_ttl_driver_s, "vehicle": settings.cache_ttl_vehicle_s},
        )

    async def forget_entity(self, kind: str, entity_id: str) -> int | None:
        """Drop an entity's cached vector from every tier of every worker (None: never
        embedded). The other workers' memory tiers have dropped it when this returns; they
        are reached through the engine process (``ServiceUnavailableError`` while it is
        down, or while a worker did not confirm its drop: ``workers_unavailable``), and the
        entity's link goes last, so that a retry finds the entity again."""
        dropped = await self.embedder.links.drop(kind, entity_id)
        if dropped is None:
            return None
        reply = await self.engine.invalidate(dropped[1])
        if silent := reply.get("silent"):
            raise ServiceUnavailableError(
                f"{len(silent)} of {reply['workers']} workers did not confirm the drop in time",
                "workers",
            )
        await self.embedder.links.unlink(kind, entity_id)
        return dropped[0]

    def drop_keys(self, keys: Sequence[str]) -> None:
        """This process's memory tier forgets ``keys`` (another worker invalidated them)."""
        self.tiers.memory.mdelete(keys)

    async def upsert_drivers(
        self,
        records: Sequence[DriverRecord],
        caller: str,
        texts: Sequence[str] | None = None,
        lane: str | None = None,
    ) -> tuple[int, EmbedResult]:
        """Embed (through the cache) and index; the index changes only if every text embedded.
        ``texts``: the records' driver texts when the caller rendered them already. A driver
        given twice counts once, as its last record (the one the index keeps): the ones before
        it are not embedded (they were: a GPU call each, and a vector cached that no driver
        was linked to, never dropped)."""
        texts = texts if texts is not None else [driver_text(r) for r in records]
        last = {r.driver_id: i for i, r in enumerate(records)}
        if len(last) < len(records):
            kept = sorted(last.values())
            records, texts = [records[i] for i in kept], [texts[i] for i in kept]
        entities = [Entity("driver", r.driver_id, t) for r, t in zip(records, texts, strict=True)]
        result = await self.embed_entities(entities, caller, lane)
        started = time.perf_counter()
        try:
            await self.index.upsert_drivers(records, result.vectors)
        finally:
            self.latency.observe_stage("fleet_write", time.perf_counter() - started)
        return len(records), result

    async def update_driver(
        self, driver_id: str, *, position: Position | None, status: Status | None
    ) -> DriverRecord:
        """Move a driver or change its status: no inference. KeyError for an unknown id."""
        return await self.index.update_driver(driver_id, position=position, status=status)

    async def delete_driver(self, driver_id: str) -> bool:
        return await self.index.delete_driver(driver_id)

    def publish(self) -> None:
        """Mirror this process's tier counters onto its board (after every request)."""
        tiers, board = self.tiers, self.board
        board.put("cache.memory_hits", tiers.memory_hits)
        board.put("cache.store_hits", tiers.store_hits)
        board.put("cache.store_skipped", tiers.store_skipped)
        board.put("cache.store_errors", self.embedder.store_errors)
        board.put("cache.corrupt_entries", self.embedder.corrupt_entries)
        board.put("cache.expired_entries", self.embedder.expired_entries)
        memory = tiers.memory
        board.gauge("cache.memory_entries", memory.entries)
        board.gauge("cache.memory_bytes", memory.bytes)
        board.gauge("cache.memory_max_bytes", memory.max_bytes)
        board.gauge("cache.store_degraded", float(tiers.store_degraded))

    def save_coverage(self, result: dict[str, Any]) -> None:
        """The latest roster coverage check, for /v1/stats through any worker."""
        self.save_shared("coverage", result)

    def last_coverage(self) -> dict[str, Any] | None:
        return self.last_shared("coverage")

    def save_shared(self, name: str, result: dict[str, Any]) -> None:
        """The latest result of some check (coverage, drift), for /v1/stats through any
        worker: a file of the run directory (one process: this object)."""
        self._shared[name] = result
        if self.run_dir is not None:
            tmp = self.run_dir / f"{name}.json.{os.getpid()}.tmp"
            tmp.write_bytes(orjson.dumps(result))
            tmp.replace(self.run_dir / f"{name}.json")

    def last_shared(self, name: str) -> dict[str, Any] | None:
        if self.run_dir is not None:
            with contextlib.suppress(OSError, ValueError):
                return dict(orjson.loads((self.run_dir / f"{name}.json").read_bytes()))
            return None
        return self._shared.get(name)


def build_tiers(settings: Settings) -> TieredByteStore:
    if settings.store == "lmdb":
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return stores.build_store(
        settings.store,
        memory_bytes=int(settings.memory_cache_mb * 2**20),
        data_dir=settings.data_dir,
        map_size=int(settings.lmdb_map_size_gb * 2**30),
        lmdb_fsync_every_s=settings.lmdb_fsync_every_s,
        lmdb_partitions=lmdb_partitions(settings),
        redis_url=settings.redis_url,
    )


def _embedder(
    settings: Settings,
    flight: Flight,
    tiers: TieredByteStore,
    namespace: str,
    dim: int,
    stats: BoardCacheStats,
    per_item_ms: Callable[[], float],
    board: Board,
    reservoir: HitReservoir,
) -> CachedEmbedder:
    def lookup(seconds: float) -> None:
        board.observe("fleetcache_request_stage_duration_seconds", ("cache_lookup",), seconds)

    return CachedEmbedder(
        flight,
        tiers,
        namespace=namespace,
        dim=dim,
        per_item_ms=per_item_ms,
        on_lookup=lookup,
        stats=stats,
        on_hits=reservoir.add,
    )


@contextlib.asynccontextmanager
async def open_local_services(
    settings: Settings, engine: Engine | None = None
) -> AsyncIterator[Services]:
    """Every component in this process; an injected ``engine`` (tests) replaces the
    configured one. The index loads from its snapshot and is saved on the way out."""
    async with contextlib.AsyncExitStack() as stack:
        board = Board("worker")
        stack.callback(board.close)
        tiers = build_tiers(settings)
        stack.push_async_callback(tiers.aclose)  # the last to go: after every write-back
        # one CacheStats for both halves: each mirrors its totals onto the same board
        stats = BoardCacheStats(board)
        host = await stack.enter_async_context(
            open_engine_host(settings, board, engine, tiers, stats)
        )
        index = await stack.enter_async_context(open_index_host(settings, board, host.info.dim))
        reservoir = HitReservoir()
        embedder = _embedder(
            settings,
            host,
            tiers,
            host.namespace,
            host.info.dim,
            stats,
            host.per_item_ms,
            board,
            reservoir,
        )
        yield Services(
            settings, embedder, host, index, tiers, board, Boards(own=board), reservoir=reservoir
        )


@dataclass(frozen=True)
class Cluster:
    """What a worker of ``fleetcache serve`` is told by its supervisor."""

    run_dir: Path
    info: EngineInfo  # the engine's identity (fingerprint, dim), read without loading it
    role: str = "worker"
    devices: tuple[str, ...] = ("auto",)  # one engine process each, in this order
    # Start serving only once the engine and the index answer (at most this long): a worker
    # (re)started beside serving ones must not answer 503 for work they could do. 0: serve at
    # once (the first worker of a fresh server, so that /readyz can say why it is not ready).
    serve_after_ready_s: float = 0.0
    # Whether this worker was told to stop (SIGTERM) before it serves: uvicorn acts on that
    # only once started, so the wait above ends on it instead.
    stopping: Callable[[], bool] = field(default=lambda: False, compare=False)

    @property
    def boards_dir(self) -> Path:
        return self.run_dir / "boards"


@contextlib.asynccontextmanager
async def open_worker_services(
    settings: Settings, cluster: Cluster, on_drop: Callable[[Sequence[str]], None] | None = None
) -> AsyncIterator[Services]:
    """A worker's services: its own tiers and board, clients of the engine and the index.
    ``on_drop(keys)`` is how the engine process reaches this worker's memory tier."""
    async with contextlib.AsyncExitStack() as stack:
        board = Board(cluster.role, cluster.boards_dir)
        stack.callback(board.close)
        reservoir = HitReservoir()

        async def answer(message: dict[str, Any]) -> dict[str, Any]:
            """The engine process asks: drop keys from the memory tier, or the hit texts."""
            if message.get("op") == "hits":
                return {"texts": reservoir.texts()}
            if message.get("op") != "drop" or on_drop is None:
                raise ValueError(f"unknown op {message.get('op')!r}")
            on_drop(message["keys"])
            return {"dropped": len(message["keys"])}

        engine_clients = [
            RpcClient(
                address(cluster.run_dir, engine_name(k)),
                role=cluster.role,
                on_request=answer,
                service="engine",
            )
            for k in range(len(cluster.devices))
        ]
        index_client = RpcClient(address(cluster.run_dir, "index"), role=cluster.role)
        for client in (*engine_clients, index_client):
            await client.start()
            stack.push_async_callback(client.close)
        engine_call = functools.partial(RequestLatency(board).observe_stage, "engine_call")
        merged = min(MERGED_TEXTS, settings.max_queue)  # a merged call must fit the queue
        remotes = [RemoteEngine(c, cluster.info, engine_call, merged) for c in engine_clients]
        engine = EngineRouter(remotes, cluster.devices, settings.engine_routing)
        index = RemoteIndex(index_client)
        tiers = build_tiers(settings)
        stack.push_async_callback(tiers.aclose)  # the last to go: after every write-back
        stats = BoardCacheStats(board)
        info = cluster.info

        def per_item_ms() -> float:
            return float(engine.facts().get("per_item_ms") or 0.0)

        embedder = _embedder(
            settings,
            engine,
            tiers,
            cache_namespace(info),
            info.dim,
            stats,
            per_item_ms,
            board,
            reservoir,
        )
        yield Services(
            settings,
            embedder,
            engine,
            index,
            tiers,
            board,
            Boards(cluster.boards_dir),
            run_dir=cluster.run_dir,
            reservoir=reservoir,
        )
