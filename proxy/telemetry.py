"""Request latency by outcome, for ``/v1/stats`` (p50/p99) and ``/metrics`` (histograms).

A request that looked up texts is a *hit request* when the engine was not needed for any of
them, otherwise a *miss request*. Percentiles come from a bounded ring of recent requests so
that they describe the service now, not since start-up.
"""

from __future__ import annotations

from collections import deque

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

# geometric buckets from 0.25 ms to ~16 s (STYLE.md rule 10)
LATENCY_BUCKETS = tuple(0.00025 * 2**i for i in range(17))


class RequestLatency:
    def __init__(self, registry: CollectorRegistry, window: int) -> None:
        self._recent: dict[str, deque[float]] = {
            "hit": deque(maxlen=window),
            "miss": deque(maxlen=window),
        }
        self.histogram = Histogram(
            "fleetcache_request_duration_seconds",
            "Latency of requests that look up embeddings, by route and outcome "
            "(hit: no text went to the engine; miss: at least one did).",
            ["route", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, route: str, misses: int, seconds: float) -> None:
        outcome = "miss" if misses else "hit"
        self._recent[outcome].append(seconds * 1000.0)
        self.histogram.labels(route=route, outcome=outcome).observe(seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for outcome, values in self._recent.items():
            arr = np.fromiter(values, dtype=np.float64, count=len(values))
            p50, p99 = np.percentile(arr, [50, 99]) if arr.size else (0.0, 0.0)
            out[f"{outcome}_requests"] = {"p50_ms": float(p50), "p99_ms": float(p99)}
        return out
