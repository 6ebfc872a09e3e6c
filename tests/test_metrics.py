"""``/metrics`` after a known workload equals ``/v1/stats`` and the API.md counting rules;
GPU health through a fake NVML (no GPU here) and without one."""

from __future__ import annotations

from collections import defaultdict
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from proxy import gpu_health, stats
from proxy.gpu_health import GpuMonitor

Samples = dict[str, list[tuple[dict[str, str], float]]]


def scrape(client: TestClient) -> Samples:
    response = client.get("/metrics")
    assert response.status_code == 200
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def total(samples: Samples, metric: str, **labels: str) -> float:
    assert metric in samples, f"{metric} not exported"
    return sum(v for lab, v in samples[metric] if all(lab.get(k) == x for k, x in labels.items()))


def post(client: TestClient, texts: list[str], caller: str = "dispatch") -> tuple[int, int]:
    response = client.post("/v1/embeddings", json={"input": texts}, headers={"X-Caller": caller})
    assert response.status_code == 200, response.text
    return int(response.headers["X-Cache-Hits"]), int(response.headers["X-Cache-Misses"])


def run_workload(client: TestClient) -> None:
    assert post(client, ["a", "b", "c"]) == (0, 3)
    assert post(client, ["a", "b", "d"], caller="warmup") == (2, 1)
    assert post(client, ["x", "x", "y"]) == (1, 2)  # the second "x" coalesces
    assert post(client, ["a", "c"]) == (2, 0)  # an all-hit request


def test_counters_equal_stats_and_counting_rules(client: TestClient) -> None:
    run_workload(client)
    m = scrape(client)
    s = client.get("/v1/stats").json()
    cache, inference = s["cache"], s["inference"]

    # the workload by hand: 6 hits, 1 coalesced, 6 misses
    assert (cache["hits"], cache["coalesced"], cache["misses"]) == (4, 1, 6)
    lookups = "fleetcache_cache_lookups_total"
    assert total(m, lookups, result="hit") == cache["hits"]
    assert total(m, lookups, result="coalesced") == cache["coalesced"]
    assert total(m, lookups, result="miss") == cache["misses"] == inference["items"]
    for caller, counts in s["by_caller"].items():
        not_sent = total(m, lookups, caller=caller, result="hit") + total(
            m, lookups, caller=caller, result="coalesced"
        )
        assert not_sent == counts["hits"]  # by_caller hits = hits + coalesced, like X-Cache-Hits
        assert total(m, lookups, caller=caller, result="miss") == counts["misses"]
    assert s["by_caller"]["warmup"] == {"hits": 2, "misses": 1, "coalesced": 0}
    assert total(m, "fleetcache_cache_tier_hits_total") == cache["hits"]

    avoided = total(m, "fleetcache_engine_calls_avoided_total")
    assert avoided == inference["calls_avoided"] == cache["hits"] + cache["coalesced"] == 5
    saved_ms = total(m, "fleetcache_engine_saved_seconds_total") * 1000
    assert saved_ms == pytest.approx(inference["ms_saved"], rel=1e-9)
    assert saved_ms > 0
    ratio = (cache["hits"] + cache["coalesced"]) / (cache["hits"] + cache["coalesced"] + 6)
    assert cache["hit_ratio"] == pytest.approx(ratio)
    assert total(m, "fleetcache_cache_hit_ratio", window="1m") == pytest.approx(ratio)

    assert total(m, "fleetcache_engine_items_total") == inference["items"]
    assert total(m, "fleetcache_engine_batches_total") == inference["batches"]
    assert total(m, "fleetcache_engine_batch_size_texts_sum") == inference["items"]
    assert total(m, "fleetcache_engine_batch_size_texts_count") == inference["batches"]
    assert total(m, "fleetcache_engine_batch_duration_seconds_count") == inference["batches"]
    for stage in ("tokenize", "forward", "postprocess"):
        count = total(m, "fleetcache_engine_stage_duration_seconds_count", stage=stage)
        assert count == inference["batches"]
    assert total(m, "fleetcache_batcher_queue_depth_texts") == s["queue"]["depth"] == 0

    requests = "fleetcache_request_duration_seconds_count"
    assert total(m, requests, route="embeddings", outcome="miss") == 3
    assert total(m, requests, route="embeddings", outcome="hit") == 1
    assert s["latency"]["hit_requests"]["p99_ms"] > 0

    (labels, value), *_ = m["fleetcache_engine_info"]
    assert value == 1
    assert {k: labels[k] for k in ("kind", "model", "fingerprint")} == {
        k: inference["engine"][k] for k in ("kind", "model", "fingerprint")
    }
    assert total(m, "fleetcache_ready") == 1


def test_stats_keeps_the_api_shape(client: TestClient) -> None:
    run_workload(client)
    s = client.get("/v1/stats").json()
    assert {"uptime_s", "cache", "inference", "latency", "by_caller", "gpu"} <= set(s)
    assert {"hits", "misses", "coalesced", "hit_ratio", "tiers", "windows"} <= set(s["cache"])
    assert set(s["cache"]["windows"]) == {"1m", "5m"}
    assert {"items", "batches", "mean_batch", "per_item_ms", "p50_batch_ms", "p99_batch_ms"} <= set(
        s["inference"]
    )
    assert {"calls_avoided", "ms_saved", "engine"} <= set(s["inference"])
    assert set(s["latency"]) == {"hit_requests", "miss_requests"}


# -- GPU health ----------------------------------------------------------------------------


class FakeNVMLError(Exception):
    pass


def fake_nvml(*, devices: int = 1, ecc: bool = True) -> ModuleType:
    """The slice of pynvml that proxy.gpu_health calls, answering like a warm H200."""
    nvml = ModuleType("pynvml")

    def not_supported(*_: Any) -> Any:
        raise FakeNVMLError("Not Supported")

    def ecc_count(_: Any, error_type: int, counter: int) -> int:
        return {(0, 0): 3, (1, 0): 0, (0, 1): 12, (1, 1): 1}[(error_type, counter)]

    members: dict[str, Any] = {
        "NVMLError": FakeNVMLError,
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: devices,
        "nvmlSystemGetDriverVersion": lambda: "570.1",
        "nvmlDeviceGetHandleByIndex": lambda i: f"h{i}",
        "nvmlDeviceGetName": lambda h: b"NVIDIA H200",
        "nvmlDeviceGetUUID": lambda h: f"GPU-{h}",
        "nvmlDeviceGetTemperature": lambda h, sensor: 47,
        "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(used=2 * 2**30, total=141 * 2**30),
        "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=35, memory=12),
        "nvmlDeviceGetPowerUsage": lambda h: 250_000,
        "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
        "nvmlDeviceGetClockInfo": lambda h, clock: 1755,
        "nvmlDeviceGetMaxClockInfo": lambda h, clock: 1980,
        "nvmlDeviceGetTotalEccErrors": ecc_count if ecc else not_supported,
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 4,
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: 5,
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: 0x4 | 0x40,
    }
    for name, value in members.items():
        setattr(nvml, name, value)
    return nvml


def test_gpu_reading_shape_with_fake_nvml() -> None:
    reading = GpuMonitor(lambda: fake_nvml(devices=2)).read()
    assert reading["available"] is True
    assert reading["driver_version"] == "570.1"
    assert [d["index"] for d in reading["devices"]] == [0, 1]
    gpu = reading["devices"][0]
    assert gpu["name"] == "NVIDIA H200"
    assert gpu["temperature_c"] == 47
    assert (gpu["memory_used_bytes"], gpu["memory_total_bytes"]) == (2 * 2**30, 141 * 2**30)
    assert (gpu["utilization_gpu_pct"], gpu["power_w"], gpu["power_limit_w"]) == (35, 250, 700)
    assert gpu["ecc"] == {
        "corrected_volatile": 3,
        "corrected_aggregate": 12,
        "uncorrected_volatile": 0,
        "uncorrected_aggregate": 1,
    }
    assert gpu["pcie"] == {"gen": 4, "max_gen": 5, "width": 16, "max_width": 16, "below_max": True}
    assert gpu["throttle"] == {
        "mask": 0x44,
        "reasons": ["sw_power_cap", "hw_thermal_slowdown"],
        "slowdown": True,
    }


def test_gpu_unsupported_fields_read_null() -> None:
    nvml = fake_nvml(ecc=False)
    del nvml.nvmlDeviceGetCurrentClocksThrottleReasons  # an NVML too old or too new
    gpu = GpuMonitor(lambda: nvml).read()["devices"][0]
    assert set(gpu["ecc"].values()) == {None}
    assert gpu["throttle"] == {"mask": None, "reasons": [], "slowdown": None}


def test_no_gpu_says_why_and_never_raises() -> None:
    def missing() -> ModuleType:
        raise ImportError("No module named 'pynvml'")

    reading = GpuMonitor(missing).read()
    assert reading["available"] is False
    assert "nvidia-ml-py" in reading["reason"]

    broken = fake_nvml()
    broken.nvmlInit = lambda: (_ for _ in ()).throw(FakeNVMLError("Driver Not Loaded"))
    reading = GpuMonitor(lambda: broken).read()
    assert reading == {"available": False, "reason": reading["reason"]}
    assert "Driver Not Loaded" in reading["reason"]

    assert GpuMonitor(lambda: fake_nvml(devices=0)).read()["available"] is False


def test_gpu_section_and_gauges_through_the_api(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor = GpuMonitor(lambda: fake_nvml(), min_interval_s=0.0)
    monkeypatch.setattr(stats, "default_monitor", lambda: monitor)
    section = client.get("/v1/stats").json()["gpu"]
    assert section["available"] is True
    assert section["devices"][0]["pcie"]["below_max"] is True

    m = scrape(client)
    device = {"gpu": "0", "name": "NVIDIA H200"}
    assert total(m, "fleetcache_gpu_available") == 1
    assert total(m, "fleetcache_gpu_temperature_celsius", **device) == 47
    assert total(m, "fleetcache_gpu_memory_used_bytes", **device) == 2 * 2**30
    assert total(m, "fleetcache_gpu_utilization_ratio", **device) == pytest.approx(0.35)
    assert total(m, "fleetcache_gpu_ecc_errors", kind="uncorrected", counter="aggregate") == 1
    assert total(m, "fleetcache_gpu_pcie_link_generation", link="current") == 4
    assert total(m, "fleetcache_gpu_pcie_link_generation", link="max") == 5
    assert total(m, "fleetcache_gpu_pcie_link_width_lanes", link="max") == 16
    assert total(m, "fleetcache_gpu_clock_throttle", reason="hw_thermal_slowdown") == 1
    assert total(m, "fleetcache_gpu_clock_throttle", reason="gpu_idle") == 0


def test_gpu_section_without_gpu_through_the_api(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def missing() -> ModuleType:
        raise ImportError("No module named 'pynvml'")

    monitor = GpuMonitor(missing)
    monkeypatch.setattr(stats, "default_monitor", lambda: monitor)
    section = client.get("/v1/stats").json()["gpu"]
    assert section["available"] is False and section["reason"]
    m = scrape(client)
    assert total(m, "fleetcache_gpu_available") == 0
    assert "fleetcache_gpu_temperature_celsius" not in m


def test_gpu_monitor_reads_at_most_once_per_interval() -> None:
    calls = []
    nvml = fake_nvml()
    count = nvml.nvmlDeviceGetCount
    nvml.nvmlDeviceGetCount = lambda: calls.append(1) or count()
    monitor = GpuMonitor(lambda: nvml, min_interval_s=60.0)
    assert monitor.read() is monitor.read()
    assert len(calls) == 1
    monitor.close()
    assert gpu_health.default_monitor() is gpu_health.default_monitor()


def test_request_stages_and_engine_health_families(client: TestClient) -> None:
    run_workload(client)
    order = {"order_id": "O1", "pickup": {"lat": 31.23, "lng": 121.47}}
    assert client.post("/v1/dispatch/recommend", json=order).status_code == 200
    m = scrape(client)
    stage = "fleetcache_request_stage_duration_seconds_count"
    # every request whose misses went to the engine waited in the queue once (one batch each);
    # the recommend's order text was a miss too
    miss_requests = total(m, "fleetcache_request_duration_seconds_count", outcome="miss")
    assert miss_requests == 4
    assert total(m, stage, stage="queue_wait") == miss_requests
    assert total(m, stage, stage="index") == 1  # one recommend, one index search
    assert total(m, stage, stage="cache_lookup") == 5  # every request looked its texts up once
    assert total(m, "fleetcache_engine_serving", engine="primary") == 1
    assert total(m, "fleetcache_engine_serving", engine="none") == 0
    assert total(m, "fleetcache_engine_healthy") == 1
    assert total(m, "fleetcache_engine_expired_items_total") == 0
    assert total(m, "fleetcache_cache_expired_entries_total") == 0
