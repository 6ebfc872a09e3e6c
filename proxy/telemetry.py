"""Request latency by outcome, for ``/v1/stats`` (p50/p99) and ``/metrics`` (histograms),
and the engine's stage timings and batch sizes (``StageTimingEngine``).

A request that looked up texts is a *hit request* when the engine was not needed for any of
them, otherwise a *miss request*. Percentiles come from a bounded ring of recent requests so
that they describe the service now, not since start-up.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Histogram

from engines.base import Batch, Engine, Vectors

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
        self.stages = Histogram(
            "fleetcache_request_stage_duration_seconds",
            "Time one request spent in a stage: cache_lookup (tiers read), queue_wait (its "
            "misses waiting for a batch), index (the fleet index search of a recommend).",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def observe(self, route: str, misses: int, seconds: float) -> None:
        outcome = "miss" if misses else "hit"
        self._recent[outcome].append(seconds * 1000.0)
        self.histogram.labels(route=route, outcome=outcome).observe(seconds)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.stages.labels(stage=stage).observe(seconds)

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for outcome, values in self._recent.items():
            arr = np.fromiter(values, dtype=np.float64, count=len(values))
            p50, p99 = np.percentile(arr, [50, 99]) if arr.size else (0.0, 0.0)
            out[f"{outcome}_requests"] = {"p50_ms": float(p50), "p99_ms": float(p99)}
        return out


# 1, 2, 4, ... 1024 texts per batch
BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(11))


class StageTimingEngine(Engine):
    """Wraps the batcher's engine and times each stage of every batch it runs.

    The batcher calls ``tokenize`` (engine thread, or tokenizer thread when it tokenizes
    ahead), ``forward`` and ``postprocess``; each is observed in
    ``fleetcache_engine_stage_duration_seconds{stage}``. ``forward`` also observes the batch
    size, and ``forward`` + ``postprocess`` the batch's device time. Warm-up runs the engine
    directly, not through this wrapper, and is not counted (as in ``inference.items``).
    """

    def __init__(self, inner: Engine, registry: CollectorRegistry) -> None:
        self.inner = inner
        self.info = inner.info
        self.stages = Histogram(
            "fleetcache_engine_stage_duration_seconds",
            "Engine time per batch and stage (tokenize on CPU; forward and postprocess on "
            "the device).",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_duration = Histogram(
            "fleetcache_engine_batch_duration_seconds",
            "Device time per batch (forward + postprocess), failed batches excluded.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.batch_size = Histogram(
            "fleetcache_engine_batch_size_texts",
            "Texts per batch handed to the engine.",
            buckets=BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self._forward_s = threading.local()  # forward and postprocess share the engine thread

    def tokenize(self, texts: Sequence[str]) -> Batch:
        started = time.perf_counter()
        batch = self.inner.tokenize(texts)
        self.stages.labels(stage="tokenize").observe(time.perf_counter() - started)
        return batch

    def forward(self, batch: Batch) -> Any:
        self.batch_size.observe(batch.size)
        started = time.perf_counter()
        output = self.inner.forward(batch)
        elapsed = time.perf_counter() - started
        self.stages.labels(stage="forward").observe(elapsed)
        self._forward_s.value = elapsed
        return output

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        started = time.perf_counter()
        vectors = self.inner.postprocess(output, batch)
        elapsed = time.perf_counter() - started
        self.stages.labels(stage="postprocess").observe(elapsed)
        self.batch_duration.observe(getattr(self._forward_s, "value", 0.0) + elapsed)
        return vectors

    def load(self) -> None:
        self.inner.load()

    def warmup(self) -> None:
        self.inner.warmup()

    def health(self) -> dict[str, Any]:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()
