"""Prometheus exposition: counters and gauges read at scrape time from ``build_stats``.

Histograms are observed as things happen (proxy.telemetry: request latency by route and
outcome; engine stage durations, batch device time and batch sizes). Everything else is
derived from the same snapshot as ``/v1/stats`` so the two always agree. Names carry their
units; counters get ``_total`` from prometheus-client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from proxy.gpu_health import THROTTLE_REASONS
from proxy.services import Services
from proxy.stats import build_stats, engine_info_labels

Family = CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily


class StatsCollector(Collector):
    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self) -> Iterator[Family]:
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
        yield CounterMetricFamily(
            "fleetcache_engine_expired_items",
            "Texts dropped before the engine because their deadline passed.",
            value=inference["expired_items"],
        )
        yield CounterMetricFamily(
            "fleetcache_cache_expired_entries",
            "Entries found past their TTL (served as misses).",
            value=cache["expired_entries"],
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
            "fleetcache_batcher_queue_depth_texts",
            "Texts waiting for a batch (a batch tokenized ahead included).",
            value=self.services.batcher.queued,
        )
        yield GaugeMetricFamily(
            "fleetcache_cache_in_flight_texts",
            "Distinct texts being computed now (others coalesce on them).",
            value=cache.get("in_flight", 0),
        )
        windows = GaugeMetricFamily(
            "fleetcache_cache_hit_ratio",
            "(hits + coalesced) / lookups over a recent window.",
            labels=["window"],
        )
        for name, window in cache["windows"].items():
            windows.add_metric([name], window["hit_ratio"])
        yield windows
        health = inference["engine_health"]
        yield GaugeMetricFamily(
            "fleetcache_engine_healthy",
            "1 while the primary engine serves misses (no failed batch, batch p99 in limit).",
            value=1.0 if health["healthy"] else 0.0,
        )
        serving = GaugeMetricFamily(
            "fleetcache_engine_serving",
            "1 for the engine that serves misses now: primary, fallback or none (503).",
            labels=["engine"],
        )
        for name in ("primary", "fallback", "none"):
            serving.add_metric([name], 1.0 if health["serving"] == name else 0.0)
        yield serving
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
        yield from gpu_families(stats["gpu"])


GPU_GAUGES = (  # (reading key, metric name, help, scale)
    ("temperature_c", "fleetcache_gpu_temperature_celsius", "GPU core temperature.", 1.0),
    ("memory_used_bytes", "fleetcache_gpu_memory_used_bytes", "Device memory in use.", 1.0),
    ("memory_total_bytes", "fleetcache_gpu_memory_total_bytes", "Device memory in all.", 1.0),
    ("utilization_gpu_pct", "fleetcache_gpu_utilization_ratio", "Busy fraction (SMs).", 0.01),
    ("utilization_memory_pct", "fleetcache_gpu_memory_utilization_ratio",
     "Busy fraction (memory controller).", 0.01),
    ("power_w", "fleetcache_gpu_power_watts", "Power draw.", 1.0),
    ("power_limit_w", "fleetcache_gpu_power_limit_watts", "Enforced power limit.", 1.0),
    ("sm_clock_mhz", "fleetcache_gpu_sm_clock_hertz", "SM clock.", 1e6),
    ("max_sm_clock_mhz", "fleetcache_gpu_sm_clock_max_hertz", "Highest SM clock.", 1e6),
)  # fmt: skip


def gpu_families(gpu: dict[str, Any]) -> Iterator[Family]:
    """NVML readings as gauges labelled by GPU index and name; only ``available`` without one."""
    yield GaugeMetricFamily(
        "fleetcache_gpu_available", "1 when NVML answers.", value=1.0 if gpu["available"] else 0.0
    )
    if not gpu["available"]:
        return
    devices = gpu["devices"]
    labels = ["gpu", "name"]

    def gauge(name: str, doc: str, value_of: Any, extra: list[str] | None = None) -> Family:
        family = GaugeMetricFamily(name, doc, labels=labels + (extra or []))
        for device in devices:
            for suffix, value in value_of(device):
                if value is not None:
                    family.add_metric([str(device["index"]), device["name"] or "", *suffix], value)
        return family

    for key, name, doc, scale in GPU_GAUGES:
        yield gauge(name, doc, lambda d, k=key, s=scale: [((), None if d[k] is None else d[k] * s)])
    yield gauge(
        "fleetcache_gpu_ecc_errors",
        "ECC memory errors by kind (corrected/uncorrected) and counter (volatile: since the "
        "driver loaded; aggregate: lifetime).",
        lambda d: [(tuple(k.split("_")), v) for k, v in d["ecc"].items()],
        ["kind", "counter"],
    )
    yield gauge(
        "fleetcache_gpu_pcie_link_generation",
        "PCIe link generation (current vs max).",
        lambda d: [(("current",), d["pcie"]["gen"]), (("max",), d["pcie"]["max_gen"])],
        ["link"],
    )
    yield gauge(
        "fleetcache_gpu_pcie_link_width_lanes",
        "PCIe link width (current vs max).",
        lambda d: [(("current",), d["pcie"]["width"]), (("max",), d["pcie"]["max_width"])],
        ["link"],
    )
    yield gauge(
        "fleetcache_gpu_clock_throttle",
        "1 for each clock throttle reason active now (gpu_idle is harmless).",
        lambda d: (
            [
                ((reason,), 1.0 if reason in d["throttle"]["reasons"] else 0.0)
                for reason in THROTTLE_REASONS.values()
            ]
            if d["throttle"]["mask"] is not None
            else []
        ),
        ["reason"],
    )
