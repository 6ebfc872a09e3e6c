"""Prometheus exposition, made at scrape time from the same ``Snapshot`` as ``/v1/stats``
(``proxy.stats``), so that the two always agree and both describe the whole server.

Scalars are a table (name, type, help, where in the stats); histograms come from the boards,
merged over every process. Names carry their units; counters get ``_total`` from
prometheus-client.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import Any

import numpy as np
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from proxy.board import HISTOGRAMS, Totals
from proxy.gpu_health import THROTTLE_REASONS
from proxy.services import Services
from proxy.stats import snapshot

Family = CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily | HistogramMetricFamily
Stats = dict[str, Any]

SCALARS: tuple[tuple[str, str, str, Callable[[Stats], float]], ...] = (
    ("fleetcache_cache_store_errors", "counter",
     "Cache store failures (the request was served anyway).",
     lambda s: s["cache"]["store_errors"]),
    ("fleetcache_cache_memory_entries", "gauge", "Entries in the memory tiers of every worker.",
     lambda s: s["cache"]["tiers"]["memory"]["entries"]),
    ("fleetcache_cache_memory_bytes", "gauge", "Bytes in the memory tiers of every worker.",
     lambda s: s["cache"]["tiers"]["memory"]["bytes"]),
    ("fleetcache_engine_calls_avoided", "counter",
     "Texts not sent to the engine (hits + coalesced).",
     lambda s: s["inference"]["calls_avoided"]),
    ("fleetcache_engine_saved_seconds", "counter",
     "Engine time saved: avoided calls x per-item engine time at the time of each.",
     lambda s: s["inference"]["ms_saved"] / 1000.0),
    ("fleetcache_engine_items", "counter", "Texts sent to the engine.",
     lambda s: s["inference"]["items"]),
    ("fleetcache_engine_batches", "counter", "Batches run by the engine.",
     lambda s: s["inference"]["batches"]),
    ("fleetcache_engine_failed_batches", "counter", "Batches that failed.",
     lambda s: s["inference"]["failed_batches"]),
    ("fleetcache_engine_drift_items", "counter",
     "Texts re-embedded by drift checks (not lookups: not in items).",
     lambda s: s["inference"]["drift_items"]),
    ("fleetcache_engine_expired_items", "counter",
     "Texts dropped before the engine because their deadline passed.",
     lambda s: s["inference"]["expired_items"]),
    ("fleetcache_cache_expired_entries", "counter",
     "Entries found past their TTL (served as misses).",
     lambda s: s["cache"]["expired_entries"]),
    ("fleetcache_engine_item_seconds", "gauge", "Mean engine time per text.",
     lambda s: s["inference"]["per_item_ms"] / 1000.0),
    ("fleetcache_engine_batch_p50_seconds", "gauge", "p50 of batch durations (last 5 minutes).",
     lambda s: s["inference"]["p50_batch_ms"] / 1000.0),
    ("fleetcache_engine_batch_p99_seconds", "gauge", "p99 of batch durations (last 5 minutes).",
     lambda s: s["inference"]["p99_batch_ms"] / 1000.0),
    ("fleetcache_batcher_queue_depth_texts", "gauge",
     "Texts waiting for a batch (a batch tokenized ahead included).",
     lambda s: s["queue"]["depth"]),
    ("fleetcache_cache_in_flight_texts", "gauge",
     "Distinct texts being computed now (others coalesce on them).",
     lambda s: s["cache"]["in_flight"]),
    ("fleetcache_cache_unwritten_texts", "gauge",
     "Computed vectors waiting to be written to the store (FLEETCACHE_MAX_UNWRITTEN bounds it).",
     lambda s: s["cache"]["unwritten"]),
    ("fleetcache_cache_store_waits", "counter",
     "Calls whose new texts waited for the store to catch up with the engine.",
     lambda s: s["cache"]["store_waits"]),
    ("fleetcache_engine_healthy", "gauge",
     "1 unless the primary engine is tripped (a failed batch, batch p99 over its limit, a GPU "
     "hard fault: lost device, uncorrected ECC errors growing).",
     lambda s: float(s["inference"]["healthy"])),
    ("fleetcache_engine_degraded", "gauge",
     "1 while a soft reading of the engine's GPU holds (hot, clocks held back, PCIe link "
     "below its maximum while busy): misses go to the fallback, or the primary still serves.",
     lambda s: float(s["inference"]["engine_health"]["degraded"])),
    ("fleetcache_ready", "gauge", "1 when /readyz answers 200.", lambda s: float(s["ready"])),
    ("fleetcache_cache_store_degraded", "gauge",
     "1 while the shared cache tier (LMDB or Redis) is failing: requests are served, misses "
     "computed, the store skipped and retried.",
     lambda s: float(s["cache"]["tiers"]["store"]["degraded"])),
    ("fleetcache_fleet_drivers", "gauge", "Drivers in the fleet index.",
     lambda s: s["fleet"]["drivers"]),
    ("fleetcache_fleet_seq", "gauge",
     "Number of the last fleet change the index applied (replicas of one fleet log converge).",
     lambda s: s["fleet"]["seq"]),
    ("fleetcache_fleet_log_following", "gauge",
     "0 while this replica cannot follow the shared fleet log (FLEETCACHE_FLEET_LOG_URL): its "
     "fleet writes are refused; 1 otherwise (also without a shared log).",
     lambda s: float(s["fleet"]["log_following"] is not False)),
    ("fleetcache_uptime_seconds", "gauge", "Seconds since this worker started.",
     lambda s: s["uptime_s"]),
)  # fmt: skip


class StatsCollector(Collector):
    def __init__(self, services: Services) -> None:
        self.services = services

    def collect(self) -> Iterator[Family]:
        snap = snapshot(self.services)
        stats = snap.stats
        for name, kind, doc, value_of in SCALARS:
            cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield cls(name, doc, value=value_of(stats))
        yield from labelled_families(stats)
        yield from device_families(stats["inference"]["devices"])
        yield from device_child_families(stats["inference"]["device_process"])
        yield from histogram_families(snap.totals)
        info = InfoMetricFamily("fleetcache_engine", "The engine serving misses.")
        info.add_metric([], {k: str(v) for k, v in asdict(self.services.info).items()})
        yield info
        yield from gpu_families(stats["gpu"])
        yield from drift_families(stats["cache"]["drift"])


def drift_families(drift: dict[str, Any] | None) -> Iterator[Family]:
    """The last drift check (proxy.drift); nothing before the first one that sampled."""
    if drift is None or drift["min_cosine"] is None:
        return
    for name, doc, value in (
        ("min_cosine", "Lowest cosine of a re-embedded cache hit vs its cached vector, "
         "last drift check.", drift["min_cosine"]),
        ("mean_cosine", "Mean of the same cosines.", drift["mean_cosine"]),
        ("threshold", "FLEETCACHE_DRIFT_THRESHOLD: a cosine below it has drifted.",
         drift["threshold"]),
        ("below_threshold", "Sampled hits below the threshold, last drift check.",
         drift["below_threshold"]),
        ("sampled", "Cache hits re-embedded by the last drift check.", drift["sampled"]),
        ("checked_timestamp_seconds", "When the last drift check ran (Unix time).", drift["at"]),
    ):  # fmt: skip
        yield GaugeMetricFamily(f"fleetcache_cache_drift_{name}", doc, value=value)


def labelled_families(stats: Stats) -> Iterator[Family]:
    lookups = CounterMetricFamily(
        "fleetcache_cache_lookups",
        "Texts looked up, by caller and result (hit: found in a tier; coalesced: joined an "
        "identical computation; miss: sent to the engine).",
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
    for tier, values in stats["cache"]["tiers"].items():
        tiers.add_metric([tier], values["hits"])
    yield tiers
    windows = GaugeMetricFamily(
        "fleetcache_cache_hit_ratio",
        "(hits + coalesced) / lookups over a recent window.",
        labels=["window"],
    )
    for name, window in stats["cache"]["windows"].items():
        windows.add_metric([name], window["hit_ratio"])
    yield windows
    serving = GaugeMetricFamily(
        "fleetcache_engine_serving",
        "1 for the engine that serves misses now: primary, fallback or none (503).",
        labels=["engine"],
    )
    now = stats["inference"]["engine_health"]["serving"]
    for name in ("primary", "fallback", "none"):
        serving.add_metric([name], 1.0 if now == name else 0.0)
    yield serving
    rejected = CounterMetricFamily(
        "fleetcache_requests_rejected",
        "Requests answered 429: worker_full (the worker held FLEETCACHE_MAX_INFLIGHT_REQUESTS), "
        "queue_full (the inference queue could not take the request's new texts).",
        labels=["reason"],
    )
    for reason, count in stats["queue"]["rejected"].items():
        rejected.add_metric([reason], count)
    yield rejected


DEVICE_FAMILIES = (  # (stats key, metric name, kind, help)
    ("up", "fleetcache_engine_device_up", "gauge",
     "1 while the engine process of this device answers."),
    ("healthy", "fleetcache_engine_device_healthy", "gauge",
     "1 unless this device's engine is tripped or its process is down."),
    ("degraded", "fleetcache_engine_device_degraded", "gauge",
     "1 while a soft reading of this device's GPU holds."),
    ("items", "fleetcache_engine_device_items", "counter", "Texts this device's engine took."),
    ("batches", "fleetcache_engine_device_batches", "counter", "Batches run on this device."),
    ("failed_batches", "fleetcache_engine_device_failed_batches", "counter",
     "Batches that failed on this device."),
    ("queue_depth", "fleetcache_engine_device_queue_depth_texts", "gauge",
     "Texts waiting for a batch on this device."),
)  # fmt: skip


def device_families(devices: list[dict[str, Any]]) -> Iterator[Family]:
    """Per engine process of FLEETCACHE_DEVICE's list, labelled ``device`` and ``index`` (its
    place in the list: one device may be listed twice)."""
    for key, name, kind, doc in DEVICE_FAMILIES:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        family = cls(name, doc, labels=["device", "index"])
        for index, device in enumerate(devices):
            family.add_metric([device["device"], str(index)], float(device[key]))
        yield family


def device_child_families(child: dict[str, Any] | None) -> Iterator[Family]:
    """How the device child (``FLEETCACHE_DEVICE_PROCESS``) spent the batches it answered;
    nothing where the device runs in the engine process. The share of the time it spent in
    forwards: ``rate(fleetcache_device_child_seconds_total{phase="forward"}[1m])``."""
    if child is None:
        return
    seconds = CounterMetricFamily(
        "fleetcache_device_child_seconds",
        "The device child's time over its batches: forward (with postprocessing), waiting "
        "(its device loop with nothing padded to run), queued (padded batches waiting for "
        "that loop), padding (its other thread), transit (sent -> received), late (of the "
        "waiting, before the engine process had sent the batch); and the engine process's "
        "side of the hand-over: pickup (an answer sent -> its engine thread holding it), "
        "forming (that thread starting a batch -> the next one's tokenizing begun), "
        "tokenizing (begun -> sent).",
        labels=["phase"],
    )
    for phase, value in child["seconds"].items():
        seconds.add_metric([phase], value)
    yield seconds
    for key, doc in (
        ("batches", "Batches the device child answered with rows."),
        ("starved_batches", "Of those, the batches its device loop found nothing padded for: "
         "the engine process sent them late."),
    ):  # fmt: skip
        yield CounterMetricFamily(f"fleetcache_device_child_{key}", doc, value=child[key])


def histogram_families(totals: Totals) -> Iterator[Family]:
    """Every Prometheus histogram of the boards, merged over the processes."""
    for spec in HISTOGRAMS:
        family = HistogramMetricFamily(spec.name, spec.help, labels=list(spec.labels))
        rows = totals.histograms[spec.name]
        bounds = [*(f"{b:g}" for b in spec.buckets), "+Inf"]
        for labels, row in zip(spec.label_sets, rows, strict=True):
            cumulative = np.cumsum(row[:-1])
            buckets = list(zip(bounds, cumulative.tolist(), strict=True))
            family.add_metric(list(labels), buckets, float(row[-1]))
        yield family


def build_registry(services: Services) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(services))
    return registry


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
