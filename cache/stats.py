"""Exact lookup counters of the embedding cache (totals, per caller, sliding windows).

Each text looked up is exactly one ``hit`` (found in a cache tier), ``coalesced`` (an
identical text was already being computed) or ``miss`` (sent to the engine by this call).
A call is recorded once, when it returns its vectors; a call that raises only increments
``failed_calls`` (its misses may never have reached the engine).

Where a section has only ``hits`` and ``misses`` (``by_caller`` and the ``1m`` / ``5m``
windows, as in API.md), ``hits`` means *not sent to the engine* (hits + coalesced), the same
sense as ``X-Cache-Hits`` and ``hit_ratio``, so that ``hits + misses`` is every lookup;
``by_caller`` also carries ``coalesced`` for the split. Callers beyond the first
``MAX_CALLERS`` distinct names are counted under ``"other"``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar


def _ratio(avoided: int, misses: int) -> float:
    total = avoided + misses
    return avoided / total if total else 0.0


class _Windows:
    """Per-second buckets in a ring of ``span_s`` slots: bounded memory, O(span) reads."""

    def __init__(self, span_s: int) -> None:
        self._span = span_s
        self._sec = [-1] * span_s
        self._hits = [0] * span_s
        self._misses = [0] * span_s

    def add(self, now: float, hits: int, misses: int) -> None:
        sec = int(now)
        slot = sec % self._span
        if self._sec[slot] != sec:
            self._sec[slot], self._hits[slot], self._misses[slot] = sec, 0, 0
        self._hits[slot] += hits
        self._misses[slot] += misses

    def window(self, now: float, seconds: int) -> dict[str, Any]:
        sec = int(now)
        hits = misses = 0
        for s, h, m in zip(self._sec, self._hits, self._misses, strict=True):
            if sec - seconds < s <= sec:
                hits += h
                misses += m
        return {"hits": hits, "misses": misses, "hit_ratio": _ratio(hits, misses)}


class CacheStats:
    """Thread-safe counters; ``clock`` (seconds, monotonic) is injectable for tests."""

    WINDOWS: ClassVar[Mapping[str, int]] = {"1m": 60, "5m": 300}
    MAX_CALLERS: ClassVar[int] = 64  # X-Caller is client-controlled: bound the label set

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.hits = 0
        self.coalesced = 0
        self.misses = 0
        self.failed_calls = 0
        self.ms_saved = 0.0
        self.dispatch_lookups = 0  # lookups by every caller but warm-up (its pacing reads it)
        self._callers: dict[str, list[int]] = {}  # caller -> [hits, coalesced, misses]
        self._windows = _Windows(max(self.WINDOWS.values()))

    def record(
        self, caller: str, hits: int, coalesced: int, misses: int, per_item_ms: float
    ) -> None:
        now = self._clock()
        with self._lock:
            self.hits += hits
            self.coalesced += coalesced
            self.misses += misses
            self.ms_saved += (hits + coalesced) * per_item_ms
            if caller not in self._callers and len(self._callers) >= self.MAX_CALLERS:
                caller = "other"
            c = self._callers.setdefault(caller, [0, 0, 0])
            c[0] += hits
            c[1] += coalesced
            c[2] += misses
            if caller != "warmup":
                self.dispatch_lookups += hits + coalesced + misses
            self._windows.add(now, hits + coalesced, misses)

    def record_failure(self) -> None:
        with self._lock:
            self.failed_calls += 1

    @property
    def calls_avoided(self) -> int:
        return self.hits + self.coalesced

    def totals(self) -> dict[str, Any]:
        with self._lock:
            return {
                "hits": self.hits,
                "misses": self.misses,
                "coalesced": self.coalesced,
                "hit_ratio": _ratio(self.hits + self.coalesced, self.misses),
            }

    def windows(self) -> dict[str, dict[str, Any]]:
        now = self._clock()
        with self._lock:
            return {name: self._windows.window(now, s) for name, s in self.WINDOWS.items()}

    def savings(self) -> dict[str, Any]:
        with self._lock:
            return {"calls_avoided": self.hits + self.coalesced, "ms_saved": self.ms_saved}

    def by_caller(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                caller: {"hits": h + c, "misses": m, "coalesced": c}
                for caller, (h, c, m) in self._callers.items()
            }
