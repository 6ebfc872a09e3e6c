"""``/v1/stats`` assembled from its owners: the cache, the batcher, the engine, the proxy.

Every figure is read from the component that counts it, so ``/v1/stats``, ``/metrics`` and the
response headers can never disagree. Shape and counting rules: API.md, "GET /v1/stats".
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

from proxy.gpu_health import default_monitor
from proxy.services import Services


def inference_section(services: Services) -> dict[str, Any]:
    info = services.engine.info
    batcher = services.batcher.stats()
    health = services.batcher.engine_health()  # asked once: one answer for both fields
    return {
        "items": batcher.items,
        "batches": batcher.batches,
        "mean_batch": batcher.mean_batch,
        "per_item_ms": batcher.per_item_ms,
        "p50_batch_ms": batcher.p50_batch_ms,
        "p99_batch_ms": batcher.p99_batch_ms,
        **services.embedder.savings(),
        "failed_batches": batcher.failed_batches,
        "last_error": batcher.last_error,
        "healthy": health.healthy,
        "engine_health": asdict(health),
        "expired_items": batcher.expired_items,
        "queue_wait_p50_ms": batcher.queue_wait_p50_ms,
        "queue_wait_p99_ms": batcher.queue_wait_p99_ms,
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


def build_stats(services: Services) -> dict[str, Any]:
    ready, reason = services.ready
    return {
        "uptime_s": time.monotonic() - services.started,
        "ready": ready,
        "status": reason,
        "cache": services.embedder.stats(),
        "inference": inference_section(services),
        "latency": services.latency.summary(),
        "by_caller": services.embedder.by_caller(),
        "fleet": {"drivers": len(services.index)},
        "coverage": services.last_coverage,
        "queue": {"depth": services.batcher.queued},
        "gpu": default_monitor().read(),
        "settings": {
            "store": services.settings.store,
            "max_batch_size": services.settings.max_batch_size,
            "max_delay_ms": services.settings.max_delay_ms,
            "max_batch_tokens": services.settings.max_batch_tokens,
        },
    }


def engine_info_labels(services: Services) -> dict[str, str]:
    return {k: str(v) for k, v in asdict(services.engine.info).items()}
