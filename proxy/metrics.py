"""Prometheus exposition: counters and gauges read at scrape time from ``build_stats``.

Latency histograms are observed per request (proxy.telemetry); everything else is derived
from the same snapshot as ``/v1/stats`` so the two always agree. Names carry their units.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from proxy.services import Services
from proxy.stats import build_stats, engine_info_labels


class StatsCollector(Collector):
    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        stats = build_stats(self.services)
        cache, inference = stats["cache"], stats["inference"]

        lookups = CounterMetricFamily(
            "fleetcache_cache_lookups",
            "Texts looked up, by caller and result "
            "(hit: found in a tier; coalesced: joined an identical computation; miss: sent "
            "to the engine).",
            labels=["caller", "result"],
        )
        for caller, counts in stats["by_caller"].items():
            lookups.add_metric([caller, "hit"], counts["hits"] - counts["coalesced"])
            lookups.add_metric([caller, "coalesced"], counts["coalesced"])
            lookups.add_metric([caller, "miss"], counts["misses"])
        yield lookups

        tiers = CounterMetricFamily(
            "fleetcache_cache_tier_hits", "Hits by cache tier.", labels=["tier"]
        )
        for tier, values in cache["tiers"].items():
            tiers.add_metric([tier], values["hits"])
        yield tiers
        yield CounterMetricFamily(
            "fleetcache_cache_store_errors",
            "Cache store failures (the request was served anyway).",
            value=cache["store_errors"],
        )
        yield GaugeMetricFamily(
            "fleetcache_cache_memory_entries",
            "Entries in the memory tier.",
            value=cache["tiers"]["memory"]["entries"],
        )
        yield GaugeMetricFamily(
            "fleetcache_cache_memory_bytes",
            "Bytes in the memory tier.",
            value=cache["tiers"]["memory"].get("bytes", 0),
        )

        yield CounterMetricFamily(
            "fleetcache_engine_calls_avoided",
            "Texts not sent to the engine (hits + coalesced).",
            value=inference["calls_avoided"],
        )
        yield CounterMetricFamily(
            "fleetcache_engine_saved_seconds",
            "Engine time saved: avoided calls x per-item engine time at the time of each.",
            value=inference["ms_saved"] / 1000.0,
        )
        yield CounterMetricFamily(
            "fleetcache_engine_items", "Texts sent to the engine.", value=inference["items"]
        )
        yield CounterMetricFamily(
            "fleetcache_engine_batches", "Batches run by the engine.", value=inference["batches"]
        )
        yield CounterMetricFamily(
            "fleetcache_engine_failed_batches",
            "Batches that failed.",
            value=inference["failed_batches"],
        )
        yield GaugeMetricFamily(
            "fleetcache_engine_item_seconds",
            "Mean engine time per text.",
            value=inference["per_item_ms"] / 1000.0,
        )
        for q in ("p50", "p99"):
            yield GaugeMetricFamily(
                f"fleetcache_engine_batch_{q}_seconds",
                f"{q} of recent batch durations.",
                value=inference[f"{q}_batch_ms"] / 1000.0,
            )
        yield GaugeMetricFamily(
            "fleetcache_ready", "1 when /readyz answers 200.", value=1.0 if stats["ready"] else 0.0
        )
        yield GaugeMetricFamily(
            "fleetcache_fleet_drivers",
            "Drivers in the fleet index.",
            value=stats["fleet"]["drivers"],
        )
        yield GaugeMetricFamily(
            "fleetcache_uptime_seconds", "Seconds since start.", value=stats["uptime_s"]
        )
        info = InfoMetricFamily("fleetcache_engine", "The engine serving misses.")
        info.add_metric([], engine_info_labels(self.services))
        yield info
