"""A primary engine watched for failures and slowness, with an optional same-fingerprint stand-in.

States of the primary::

    healthy --- a batch raises and a probe right after it fails too, or the p99 of
       ^        its last ``window`` batch times exceeds ``max_batch_p99_ms``
       |        (``min_batches`` at least) -----------------------------------> unhealthy
       |                                                                          |
       +--- a probe (``probe_texts`` on the primary, within the limit) succeeds --+
            probes run on a timer thread after ``backoff_s``, doubling up to
            ``max_backoff_s`` while they fail: recovery needs no traffic (while
            /readyz is 503 a load balancer sends none)

A batch that raises while the probe right after it succeeds failed because of what it held
(a text the model cannot take, one batch too large for memory): only its waiters get the
``EngineError``, everyone else is served as before. A lost device fails the probe as well.

While the primary is unhealthy, batches go to ``fallback`` when there is one, else they are
refused with ``EngineUnavailableError`` (and ``health()["serving"]`` is ``none``, so the batcher
refuses submissions at once). Cache hits never reach an engine and are served throughout.

Readings of the primary's device (``watch``: ``proxy.gpu_health.GpuCheck``, every
``watch_interval_s`` on a thread of its own, or ``observe`` directly) act on the same states:
a ``Condition.fault`` (a lost device, uncorrected ECC errors growing) trips the primary as a
failed batch does; a ``Condition.slow`` (hot, clocks held back, a narrow PCIe link) leaves it
*healthy but degraded*: misses go to the fallback when there is one, else the primary keeps
serving, and ``health()`` says ``degraded`` with the reading as ``reason``. Either way the
probe timer runs, and the primary is healthy (and not degraded) again only when a probe
succeeds AND the last ``clean_readings`` readings were clean.

A fallback is accepted only when its fingerprint equals the primary's: its vectors then
belong to the same cache namespace. A different fingerprint is refused at construction with
``ValueError`` (a configuration error, reported at start-up, never a silent downgrade).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engines.base import Batch, BatchError, Engine, EngineError, EngineUnavailableError, Vectors
from engines.tokenization import FastTokenizer, IntArray, owned

logger = logging.getLogger(__name__)

PROBE_TEXTS = ("fleetcache health probe",) * 8


@dataclass(frozen=True)
class Condition:
    """One reading of the primary's device: ``fault`` (hard: trips the primary) and ``slow``
    (soft: degraded) are the reasons, None when the reading shows nothing of the kind."""

    fault: str | None = None
    slow: str | None = None

    @property
    def clean(self) -> bool:
        return self.fault is None and self.slow is None


# The device's condition now, or None when there is no device to watch (the watch stops).
Watch = Callable[[], Condition | None]


class FallbackEngine(Engine):
    """``primary`` while it is healthy, then ``fallback`` (or nothing) until a probe succeeds."""

    def __init__(
        self,
        primary: Engine,
        fallback: Engine | None = None,
        *,
        max_batch_p99_ms: float | None = None,
        window: int = 100,
        min_batches: int = 20,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        probe_texts: Sequence[str] = PROBE_TEXTS,
        watch: Watch | None = None,
        watch_interval_s: float = 5.0,
        clean_readings: int = 3,
    ) -> None:
        if fallback is not None and fallback.fingerprint != primary.fingerprint:
            raise ValueError(
                f"fallback engine {fallback.info.kind!r} ({fallback.info.precision}) has "
                f"fingerprint {fallback.fingerprint}, the primary {primary.info.kind!r} "
                f"({primary.info.precision}) has {primary.fingerprint}: its vectors would not "
                "match the cache namespace. Configure a fallback of the same model, kind and "
                "precision, or none."
            )
        if not 1 <= min_batches <= window or backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError("need 1 <= min_batches <= window and 0 < backoff_s <= max_backoff_s")
        if watch_interval_s <= 0 or clean_readings < 1:
            raise ValueError("need watch_interval_s > 0 and clean_readings >= 1")
        self.primary = primary
        self.fallback = fallback
        self.info = primary.info
        self.max_batch_p99_ms = max_batch_p99_ms
        self.min_batches = min_batches
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.probe_texts = list(probe_texts)
        self._batch_ms: deque[float] = deque(maxlen=window)
        self._state = threading.Lock()  # health fields: engine thread, probe timer, readers
        self._primary_lock = threading.Lock()  # the primary runs on one thread at a time
        self._healthy = True
        self._reason: str | None = None
        self._retry_at: float | None = None
        self._backoff = backoff_s
        self._timer: threading.Timer | None = None
        self._closed = False
        self._slow: str | None = None  # the soft reading that holds now (degraded)
        self._readings: deque[bool] = deque(maxlen=clean_readings)  # clean or not, newest last
        self._watch = watch
        self._watch_interval_s = watch_interval_s
        self._watcher: threading.Thread | None = None
        self._stop = threading.Event()

    # -- lifecycle (both engines) ----------------------------------------------------------

    def load(self) -> None:
        self.primary.load()
        if self.fallback is not None:
            self.fallback.load()
        self.info = self.primary.info  # load may fill in the device
        if self._watch is not None and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, name="gpu-watch", daemon=True)
            self._watcher.start()

    def warmup(self) -> None:
        self.primary.warmup()
        if self.fallback is not None:
            self.fallback.warmup()

    def close(self) -> None:
        self._stop.set()
        with self._state:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
        if self._watcher is not None:
            self._watcher.join(timeout=10.0)
        with self._primary_lock:  # not in the middle of a probe
            self.primary.close()
        if self.fallback is not None:
            self.fallback.close()

    # -- the engine interface --------------------------------------------------------------

    def tokenizer(self) -> FastTokenizer | None:
        """The one tokenizer both engines pad ids of, if they agree (an engine without one
        tokenizes every text itself, so it never disagrees)."""
        engines = (self.primary,) if self.fallback is None else (self.primary, self.fallback)
        tokenizers = [t for t in (e.tokenizer() for e in engines) if t is not None]
        if not tokenizers or len({t.digest for t in tokenizers}) > 1:
            return None
        return tokenizers[0]

    def padded_lengths(self, texts: Sequence[str]) -> IntArray | None:
        return self._expected().padded_lengths(texts)

    def tokenize(self, texts: Sequence[str]) -> Batch:
        """Tokenized by the engine expected to run it; the other one tokenizes again."""
        engine = self._expected()
        inner = engine.tokenize(texts)
        data = {"engine": engine, "batch": inner, "texts": owned(texts)}  # ids for the other
        return Batch(inner.size, inner.tokens, data, inner.seq_lengths)

    def _expected(self) -> Engine:
        """The engine expected to run the next batch."""
        return self.primary if self._use_primary() or self.fallback is None else self.fallback

    def forward(self, batch: Batch) -> Vectors:
        """Final vectors (postprocessed by the engine that ran them)."""
        if self._use_primary():
            started = time.perf_counter()
            try:
                with self._primary_lock:
                    vectors = self._run(self.primary, batch)
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
                if self._still_answers():
                    logger.warning(
                        "a batch of %d failed, the engine answers: %s", batch.size, failure
                    )
                    raise BatchError(f"this batch failed: {failure}") from exc
                self._trip(f"primary engine failed: {failure}")
                if self.fallback is None:
                    raise EngineUnavailableError(f"{self._reason}; no fallback") from exc
            else:
                self._record((time.perf_counter() - started) * 1000)
                return vectors
        if self.fallback is None:
            raise EngineUnavailableError(f"primary engine unhealthy: {self._reason}")
        return self._run(self.fallback, batch)

    def postprocess(self, output: Any, batch: Batch) -> Vectors:
        return np.ascontiguousarray(output, dtype=np.float32)

    def health(self) -> dict[str, Any]:
        with self._state:
            healthy, reason, retry_at, slow = (
                self._healthy,
                self._reason,
                self._retry_at,
                self._slow,
            )
        primary = healthy and (slow is None or self.fallback is None)
        serving = "primary" if primary else "fallback" if self.fallback is not None else "none"
        return {
            "ok": healthy,
            "reason": reason if not healthy else slow,
            "degraded": slow is not None,
            "serving": serving,
            "retry_in_s": None if retry_at is None else max(0.0, retry_at - time.monotonic()),
            "primary": self.primary.health(),
            "fallback": None if self.fallback is None else self.fallback.health(),
        }

    # -- health ----------------------------------------------------------------------------

    def _run(self, engine: Engine, batch: Batch) -> Vectors:
        inner = batch.data["batch"]
        if batch.data["engine"] is not engine:
            inner = engine.tokenize(batch.data["texts"])
        return engine.postprocess(engine.forward(inner), inner)

    def _use_primary(self) -> bool:
        with self._state:
            return self._healthy and (self._slow is None or self.fallback is None)

    # -- readings of the device ------------------------------------------------------------

    def observe(self, condition: Condition) -> None:
        """One reading of the primary's device (see the module docstring)."""
        with self._state:
            self._readings.append(condition.clean)
        if condition.fault is not None:
            self._trip(f"primary device fault: {condition.fault}")
        with self._state:
            if condition.slow is None or self._closed:
                return
            if self._slow is None:
                logger.warning(
                    "primary engine degraded (%s); misses go to %s",
                    condition.slow,
                    "the fallback" if self.fallback is not None else "the primary still",
                )
            self._slow = condition.slow
            if self._retry_at is None:
                self._schedule_probe()

    def _readings_clean(self) -> bool:
        """Called with ``_state`` held: the last ``clean_readings`` readings were clean (or
        there was none: nothing is watched)."""
        readings = self._readings
        return not readings or (len(readings) == readings.maxlen and all(readings))

    def _watch_loop(self) -> None:
        """On its own thread: a reading every ``watch_interval_s`` until closed."""
        assert self._watch is not None
        while not self._stop.is_set():
            try:
                condition = self._watch()
            except Exception as exc:  # a bug in the reader must not kill the engine
                logger.warning("reading the primary's device failed: %r", exc)
            else:
                if condition is None:
                    logger.info("no device to watch for the primary engine")
                    return
                self.observe(condition)
            self._stop.wait(self._watch_interval_s)

    def _still_answers(self) -> bool:
        """Right after a failed batch: do the probe texts still embed on the primary?"""
        try:
            with self._primary_lock:
                self.primary.embed(self.probe_texts)
        except Exception:
            return False
        return True

    def _record(self, elapsed_ms: float) -> None:
        """Track the primary's batch times; a p99 over the limit makes it unhealthy."""
        limit = self.max_batch_p99_ms
        self._batch_ms.append(elapsed_ms)
        if limit is None or len(self._batch_ms) < self.min_batches:
            return
        p99 = float(np.percentile(list(self._batch_ms), 99))
        if p99 > limit:
            self._trip(
                f"primary batch p99 {p99:.1f} ms over its last {len(self._batch_ms)} batches "
                f"exceeds max_batch_p99_ms={limit:g}"
            )

    def _trip(self, reason: str) -> None:
        with self._state:
            if not self._healthy or self._closed:
                return
            self._healthy, self._reason = False, reason
            self._batch_ms.clear()
            if self._retry_at is None:  # no probe pending yet (a soft reading may have one)
                self._schedule_probe()
        logger.warning(
            "primary engine unhealthy (%s); misses go to %s; retry in %.1f s",
            reason,
            "the fallback" if self.fallback is not None else "nothing (503)",
            self._backoff,
        )

    def _schedule_probe(self) -> None:
        """Called with ``_state`` held."""
        self._retry_at = time.monotonic() + self._backoff
        self._timer = threading.Timer(self._backoff, self._probe)
        self._timer.daemon = True
        self._timer.start()

    def _probe(self) -> None:
        """On the timer thread: embed ``probe_texts`` on the primary, within the limit; the
        primary is back once that succeeds and the last readings of its device are clean."""
        try:
            started = time.perf_counter()
            with self._primary_lock:
                self.primary.embed(self.probe_texts)
            elapsed_ms = (time.perf_counter() - started) * 1000
            if self.max_batch_p99_ms is not None and elapsed_ms > self.max_batch_p99_ms:
                raise EngineError(f"probe took {elapsed_ms:.1f} ms")
        except Exception as exc:
            with self._state:
                if self._closed:
                    return
                if self._healthy:  # degraded, and now failing too
                    self._healthy, self._reason = (
                        False,
                        f"primary engine probe failed: {type(exc).__name__}: {exc}",
                    )
                self._backoff = min(self._backoff * 2, self.max_backoff_s)
                self._schedule_probe()
            logger.info(
                "primary engine still unhealthy (%s); next retry in %.1f s", exc, self._backoff
            )
            return
        with self._state:
            if self._closed:
                return
            if not self._readings_clean():  # the primary answers: retry without backing off
                self._schedule_probe()
                return
            self._healthy, self._reason, self._retry_at, self._slow = True, None, None, None
            self._backoff, self._timer = self.backoff_s, None
        logger.warning("primary engine healthy again (probe took %.1f ms)", elapsed_ms)
