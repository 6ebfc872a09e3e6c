"""``/v1/stats`` for the whole server, from every process's board (``proxy.board``).

Counters are summed over every process (a worker that died still counts), latency percentiles
come from merged five-minute histograms, and what no board holds (the engine's identity, its
health and last error, the store's state, GPU readings) comes from its owner: the engine's
last answer to a ping, this worker's own tiers. Shape and counting rules: API.md,
"GET /v1/stats"; ``/metrics`` is made from the same ``Snapshot``, so the two agree.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from proxy.board import Totals
from proxy.gpu_health import default_monitor
from proxy.services import Services

# API.md's two callers, shown from the start (zeros) so that a reader may index them
EVERY_CALLER: dict[str, tuple[int, int, int]] = {"dispatch": (0, 0, 0), "warmup": (0, 0, 0)}


def _ratio(avoided: float, misses: float) -> float:
    total = avoided + misses
    return avoided / total if total else 0.0


@dataclass(frozen=True)
class Snapshot:
    """One read of everything: the stats dict and the totals it was made from."""

    stats: dict[str, Any]
    totals: Totals


def cache_section(services: Services, totals: Totals) -> dict[str, Any]:
    s, g = totals.scalars, totals.gauges
    hits, coalesced, misses = (int(s[f"cache.{k}"]) for k in ("hits", "coalesced", "misses"))
    seen = services.tiers.store_health()  # kind, last error: this worker's view of the store
    written = services.engine.facts().get("store")  # the engine process's, writing back
    if written and (written["last_error_at"] or 0) > (seen["last_error_at"] or 0):
        seen = {
            **seen,
            "last_error": written["last_error"],
            "last_error_at": written["last_error_at"],
        }
    store = {
        **seen,
        "hits": int(s["cache.store_hits"]),
        "errors": int(s["cache.store_errors"]),
        "skipped": int(s["cache.store_skipped"]),
        "degraded": g["cache.store_degraded"] > 0,  # any live process sees it failing
    }
    memory = {
        "hits": int(s["cache.memory_hits"]),
        "entries": int(g["cache.memory_entries"]),
        "bytes": int(g["cache.memory_bytes"]),
        "max_bytes": int(g["cache.memory_max_bytes"]),
    }
    return {
        "hits": hits,
        "misses": misses,
        "coalesced": coalesced,
        "hit_ratio": _ratio(hits + coalesced, misses),
        "tiers": {"memory": memory, "store": store},
        "windows": {
            name: {"hits": avoided, "misses": missed, "hit_ratio": _ratio(avoided, missed)}
            for name, (avoided, missed) in totals.windows.items()
        },
        "store_errors": int(s["cache.store_errors"]),
        "corrupt_entries": int(s["cache.corrupt_entries"]),
        "expired_entries": int(s["cache.expired_entries"]),
        "failed_calls": int(s["cache.failed_calls"]),
        "in_flight": int(g["cache.in_flight"]),
        "unwritten": int(g["cache.unwritten"]),
        "store_waits": int(s["cache.store_waits"]),
        "drift": services.last_shared("drift"),  # the last drift check (proxy.drift), or null
    }


def inference_section(
    services: Services, totals: Totals, hits: int, coalesced: int
) -> dict[str, Any]:
    s = totals.scalars
    facts = services.engine.facts()
    health = services.engine.health()
    items, batches = int(s["inference.items"]), int(s["inference.batches"])
    ok_items = s["inference.ok_items"]
    p50, p99 = totals.percentiles("batch")
    wait_p50, wait_p99 = totals.percentiles("queue_wait")
    info = services.info
    return {
        "items": items,
        "batches": batches,
        "mean_batch": items / batches if batches else 0.0,
        "per_item_ms": s["inference.engine_ms"] / ok_items if ok_items else 0.0,
        "p50_batch_ms": p50,
        "p99_batch_ms": p99,
        "calls_avoided": hits + coalesced,
        "ms_saved": s["cache.ms_saved"],
        "failed_batches": int(s["inference.failed_batches"]),
        "last_error": facts.get("last_error"),
        "healthy": health.healthy,
        "engine_health": {
            "healthy": health.healthy,
            "degraded": health.degraded,  # a soft GPU reading holds (reason says which)
            "reason": health.reason,
            "serving": health.serving,
        },
        "device_process": facts.get("device_process"),
        "expired_items": int(s["inference.expired_items"]),
        "drift_items": int(s["inference.drift_items"]),
        "devices": devices_section(services, totals),
        "queue_wait_p50_ms": wait_p50,
        "queue_wait_p99_ms": wait_p99,
        "engine": {
            "kind": info.kind,
            "device": info.device,
            "precision": info.precision,
            "model": info.model,
            "fingerprint": info.fingerprint,
            "dim": info.dim,
            "max_seq_length": info.max_seq_length,
        },
    }


def devices_section(services: Services, totals: Totals) -> list[dict[str, Any]]:
    """Each engine process of FLEETCACHE_DEVICE's list: its device, whether its process
    answers, its health and what it computed (a restarted process's counts included)."""
    devices = services.engine.device_health()
    counts = totals.per_engine(len(devices))
    return [
        {
            **device,
            "items": int(c["inference.items"]),
            "batches": int(c["inference.batches"]),
            "failed_batches": int(c["inference.failed_batches"]),
            "queue_depth": int(c["queue.depth"]),
            "in_flight": int(c["cache.in_flight"]),
        }
        for device, c in zip(devices, counts, strict=True)
    ]


def snapshot(services: Services) -> Snapshot:
    services.publish()  # this worker's own counters as of now
    totals = services.boards.read()
    ready, reason = services.ready
    cache = cache_section(services, totals)
    hit_p50, hit_p99 = totals.percentiles("hit_requests")
    miss_p50, miss_p99 = totals.percentiles("miss_requests")
    stats = {
        "uptime_s": time.monotonic() - services.started,
        "ready": ready,
        "status": reason,
        "auth": "off" if services.settings.api_keys_file is None else "on",
        "cache": cache,
        "inference": inference_section(services, totals, cache["hits"], cache["coalesced"]),
        "latency": {
            "hit_requests": {"p50_ms": hit_p50, "p99_ms": hit_p99},
            "miss_requests": {"p50_ms": miss_p50, "p99_ms": miss_p99},
        },
        "by_caller": {
            caller: {"hits": h + c, "misses": m, "coalesced": c}
            for caller, (h, c, m) in sorted((EVERY_CALLER | totals.callers).items())
        },
        "fleet": fleet_section(services, totals),
        "coverage": services.last_coverage(),
        "queue": {
            "depth": int(totals.gauges["queue.depth"]),
            "rejected": {  # 429s: this worker held too many requests; the engine queue was full
                "worker_full": int(totals.scalars["requests.rejected"]),
                "queue_full": int(totals.scalars["requests.queue_full"]),
            },
        },
        "processes": totals.processes([d["device"] for d in services.engine.device_health()]),
        "gpu": default_monitor().read(),
        "settings": {
            "store": services.settings.store,
            "max_batch_size": services.settings.max_batch_size,
            "max_delay_ms": services.settings.max_delay_ms,
            "max_batch_tokens": services.settings.max_batch_tokens,
        },
    }
    return Snapshot(stats, totals)


def fleet_section(services: Services, totals: Totals) -> dict[str, Any]:
    """Drivers, the number of the last fleet change applied, and whether the shared fleet
    log (``FLEETCACHE_FLEET_LOG_URL``) is followed (null without one)."""
    following = None
    if services.settings.fleet_log_url is not None:
        following = bool(totals.gauges["fleet.log_following"])
    return {
        "drivers": int(totals.gauges["fleet.drivers"]),
        "seq": int(totals.gauges["fleet.seq"]),
        "log_following": following,
    }


def build_stats(services: Services) -> dict[str, Any]:
    return snapshot(services).stats
