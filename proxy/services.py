"""Everything heavy, built once in ``open_services`` and torn down in reverse order.

The lifespan of the app and the direct-mode warm-up CLI both enter ``open_services`` on one
``AsyncExitStack``: engine (loaded and warmed off the event loop), batcher, cache tiers, fleet
index (loaded from its last snapshot, saved again on the way out).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from cache import stores
from cache.embedder import CachedEmbedder, EmbedResult
from cache.links import Entity
from cache.stores import TieredByteStore
from engines.base import Engine, EngineInfo, Vectors
from engines.batcher import Batcher, deadline_after
from engines.fallback import FallbackEngine
from engines.registry import create_engine
from features.models import DriverRecord, Position, Status
from features.text import TEXT_SCHEMA_VERSION, driver_text
from indexes.table import FleetTable
from proxy.settings import Settings
from proxy.telemetry import RequestLatency, StageTimingEngine

log = logging.getLogger("fleetcache.proxy")

Progress = Callable[[int, int], None]  # (done, total)


def lane_for(caller: str) -> str:
    """Warm-up jobs ride the low-priority lane so they never starve dispatch."""
    return "warmup" if caller == "warmup" else "dispatch"


@dataclass
class Services:
    settings: Settings
    engine: Engine
    batcher: Batcher
    embedder: CachedEmbedder
    index: FleetTable
    registry: CollectorRegistry
    started: float = field(default_factory=time.monotonic)
    index_ready: bool = False
    index_revision: int = 0  # bumped on every fleet change; snapshots skip when unchanged
    last_coverage: dict[str, Any] | None = None  # the latest roster coverage check
    latency: RequestLatency = field(init=False)

    def __post_init__(self) -> None:
        from proxy.metrics import StatsCollector  # metrics reads Services: import late

        self.latency = RequestLatency(self.registry, self.settings.latency_window)
        self.registry.register(StatsCollector(self))

    @property
    def ready(self) -> tuple[bool, str]:
        """What /readyz answers and /v1/stats shows: the engine's own reason first (primary
        failed, batch p99 over its limit, fallback serving), then the index."""
        health = self.batcher.engine_health()
        if not health.healthy:
            return False, str(health.reason)
        if not self.index_ready:
            return False, "fleet index loading"
        return True, "ready"

    async def embed(self, texts: Sequence[str], caller: str) -> EmbedResult:
        """Plain texts: no entity, so no TTL and no link."""
        return await self.embedder.aembed(texts, caller=caller, lane=lane_for(caller))

    async def embed_entities(self, entities: Sequence[Entity], caller: str) -> EmbedResult:
        """Driver and vehicle records: their kind's TTL, and each linked to its vector."""
        settings = self.settings
        return await self.embedder.aembed_entities(
            entities,
            caller=caller,
            lane=lane_for(caller),
            ttl_s={"driver": settings.cache_ttl_driver_s, "vehicle": settings.cache_ttl_vehicle_s},
        )

    async def forget_entity(self, kind: str, entity_id: str) -> int | None:
        """Drop an entity's cached vector from every tier (None: never embedded)."""
        return await self.embedder.links.forget(kind, entity_id)

    async def upsert_drivers(
        self, records: Sequence[DriverRecord], caller: str, texts: Sequence[str] | None = None
    ) -> tuple[int, EmbedResult]:
        """Embed (through the cache) and index; the index changes only if every text embedded.
        ``texts``: the records' driver texts when the caller rendered them already."""
        texts = texts if texts is not None else [driver_text(r) for r in records]
        entities = [Entity("driver", r.driver_id, t) for r, t in zip(records, texts, strict=True)]
        result = await self.embed_entities(entities, caller)
        self.index.upsert_drivers(records, result.vectors)
        self.index_revision += 1
        return len(records), result

    def update_driver(
        self, driver_id: str, *, position: Position | None, status: Status | None
    ) -> DriverRecord:
        """Move a driver or change its status: no inference. KeyError for an unknown id."""
        record = self.index.update_driver(driver_id, position=position, status=status)
        self.index_revision += 1
        return record

    def delete_driver(self, driver_id: str) -> bool:
        deleted = self.index.delete_driver(driver_id)
        self.index_revision += deleted
        return deleted

    def snapshot(self) -> None:
        self.index.save(self.settings.index_dir)


def build_store(settings: Settings) -> TieredByteStore:
    if settings.store == "lmdb":
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    return stores.build_store(
        settings.store,
        memory_bytes=int(settings.memory_cache_mb * 2**20),
        data_dir=settings.data_dir,
        map_size=int(settings.lmdb_map_size_gb * 2**30),
        redis_url=settings.redis_url,
    )


def cache_namespace(info: EngineInfo) -> str:
    """Vectors of another engine fingerprint or text schema never mix (ARCHITECTURE.md)."""
    return f"t{TEXT_SCHEMA_VERSION}-{info.fingerprint}"


def engine_options(
    settings: Settings, kind: str | None = None, device: str | None = None
) -> dict[str, Any]:
    """``create_engine`` options of the configured engine, or of another kind/device."""
    if (kind or settings.engine) == "fake":
        return {}
    options: dict[str, Any] = {
        "device": device or settings.device,
        "max_seq_length": settings.max_seq_length,
    }
    if settings.model_path:
        options["model_path"] = settings.model_path
    return options


def build_engine(settings: Settings) -> FallbackEngine:
    """The configured engine, watched: unhealthy on a failed batch or a batch p99 over
    ``max_batch_p99_ms``, then misses go to the fallback (same fingerprint only) or get 503."""
    primary = create_engine(settings.engine, **engine_options(settings))
    fallback = None
    if settings.fallback_engine is not None:
        kind, device = settings.fallback_engine, settings.fallback_device
        fallback = create_engine(kind, **engine_options(settings, kind, device))
    return FallbackEngine(primary, fallback, max_batch_p99_ms=settings.max_batch_p99_ms)


@contextlib.asynccontextmanager
async def open_services(
    settings: Settings, engine: Engine | None = None
) -> AsyncIterator[Services]:
    """Build every component; an injected ``engine`` (tests) replaces the configured one."""
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

        registry = CollectorRegistry()
        batcher = Batcher(
            StageTimingEngine(engine, registry),  # stage histograms for /metrics
            max_batch_size=settings.max_batch_size,
            max_delay_ms=settings.max_delay_ms,
            max_queue=settings.max_queue,
            max_batch_tokens=settings.max_batch_tokens,
        )
        await stack.enter_async_context(batcher)
        deadlines_ms = {
            "dispatch": settings.dispatch_deadline_ms,
            "warmup": settings.warmup_deadline_ms,
        }

        async def compute(texts: Sequence[str], lane: str) -> Vectors:
            return await batcher.submit(texts, lane, deadline_after(deadlines_ms[lane]))

        embedder = CachedEmbedder(
            compute,
            build_store(settings),
            namespace=cache_namespace(info),
            dim=info.dim,
            per_item_ms=lambda: batcher.per_item_ms,
            on_lookup=lambda seconds: services.latency.observe_stage("cache_lookup", seconds),
        )
        stack.push_async_callback(embedder.aclose)

        index = await asyncio.to_thread(FleetTable.load, settings.index_dir, info.dim)
        log.info("fleet index loaded: %d drivers", len(index))
        services = Services(settings, engine, batcher, embedder, index, registry)
        batcher.on_queue_wait = lambda _lane, seconds: services.latency.observe_stage(
            "queue_wait", seconds
        )  # both hooks (this one and the cache's on_lookup) are first called after this line
        stack.callback(services.snapshot)  # exit runs in reverse: saved first, engine closed last
        yield services
