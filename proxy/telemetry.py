"""Timings observed as things happen, onto this process's board (``proxy.board``).

``RequestLatency``: a request that looked up texts is a *hit request* when the engine was not
needed for any of them, otherwise a *miss request*; its duration goes to the Prometheus
histogram by route and outcome and to the five-minute histograms behind the p50/p99 of
``/v1/stats``. ``StageTimingEngine`` wraps the batcher's engine and times each stage of every
batch (tokenize, forward, postprocess), the batch's device time and its size.
``BoardCacheStats`` is the cache's counters, mirrored onto the board.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cache.stats import CacheStats
from engines.base import Batch, Engine, Vectors
from engines.tokenization import FastTokenizer, IntArray
from proxy.board import Board

REQUESTS = "fleetcache_request_duration_seconds"
REQUEST_STAGES = "fleetcache_request_stage_duration_seconds"
ENGINE_STAGES = "fleetcache_engine_stage_duration_seconds"
LANE_QUEUE_WAIT = "fleetcache_lane_queue_wait_seconds"
BATCH_DURATION = "fleetcache_engine_batch_duration_seconds"
BATCH_SIZE = "fleetcache_engine_batch_size_texts"


class RequestLatency:
    def __init__(self, board: Board) -> None:
        self.board = board

    def observe(self, route: str, misses: int, seconds: float) -> None:
        outcome = "miss" if misses else "hit"
        self.board.observe(REQUESTS, (route, outcome), seconds)
        self.board.recent(f"{outcome}_requests", seconds * 1000.0)

    def observe_stage(self, stage: str, seconds: float) -> None:
        self.board.observe(REQUEST_STAGES, (stage,), seconds)


class StageTimingEngine(Engine):
    """Wraps the batcher's engine and times each stage of every batch it runs.

    The batcher calls ``tokenize`` (engine thread, or tokenizer thread when it tokenizes
    ahead), ``forward`` and ``postprocess``; each is observed in
    ``fleetcache_engine_stage_duration_seconds{stage}``. ``forward`` also observes the batch
    size, and ``forward`` + ``postprocess`` the batch's device time.
    """

    def __init__(self, inner: Engine, board: Board) -> None:
        self.inner = inner
        self.info = inner.info
        self.board = board
        self._forward_s = threading.local()  # forward and postprocess share the engine thread

    def tokenize(self, texts: Sequence[str]) -> Batch:
        started = time.perf_counter()
        batch = self.inner.tokenize(texts)
        self.board.observe(ENGINE_STAGES, ("tokenize",), time.perf_counter() - started)
        return batch

    def forward(self, batch: Batch) -> Any:
        self.board.observe(BATCH_SIZE, (), batch.size)
        started = time.perf_counter()
        output = self.inner.forward(batch)
        elapsed = time.perf_counter() - started
        self.board.observe(ENGINE_STAGES, ("forward",), elapsed)
        self._forward_s.value = elapsed
        return output

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        started = time.perf_counter()
        vectors = self.inner.postprocess(output, batch)
        elapsed = time.perf_counter() - started
        self.board.observe(ENGINE_STAGES, ("postprocess",), elapsed)
        device_s = getattr(self._forward_s, "value", 0.0) + elapsed
        self.board.observe(BATCH_DURATION, (), device_s)
        self.board.recent("batch", device_s * 1000.0)
        return vectors

    def load(self) -> None:
        self.inner.load()

    def warmup(self) -> None:
        self.inner.warmup()

    def tokenizer(self) -> FastTokenizer | None:
        return self.inner.tokenizer()

    def padded_lengths(self, texts: Sequence[str]) -> IntArray | None:
        return self.inner.padded_lengths(texts)

    def health(self) -> dict[str, Any]:
        return self.inner.health()

    def close(self) -> None:
        self.inner.close()


class BoardCacheStats(CacheStats):
    """The cache's counters (``cache.stats.CacheStats``), written to the board as they change
    so that every process's lookups add up in ``/v1/stats``."""

    def __init__(self, board: Board, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(clock)
        self.board = board

    def record(
        self, caller: str, hits: int, coalesced: int, misses: int, per_item_ms: float
    ) -> None:
        super().record(caller, hits, coalesced, misses, per_item_ms)
        board = self.board
        board.lookups(caller, hits, coalesced, misses)
        board.put("cache.hits", self.hits)
        board.put("cache.coalesced", self.coalesced)
        board.put("cache.misses", self.misses)
        board.put("cache.ms_saved", self.ms_saved)
        board.put("cache.dispatch_lookups", self.dispatch_lookups)

    def record_failure(self) -> None:
        super().record_failure()
        self.board.put("cache.failed_calls", self.failed_calls)
