"""The drift check (API.md v1.1, "Drift check"): do the vectors the cache serves still match
what the engine computes now?

A driver, CUDA or TensorRT rebuild can change an engine's output without changing its
fingerprint (the cache namespace), and the cache would keep serving the old vectors. So:

    each worker: HitReservoir, the last ``capacity`` texts its lookups found (memory only,
        never on disk; texts over ``MAX_TEXT_CHARS`` are left out, which bounds it to 4 MB)
    check (POST /v1/cache/drift, or every FLEETCACHE_DRIFT_INTERVAL_S in the background):
        the texts of every worker's reservoir (through the engine process, which asks each
        worker) -> a random sample of distinct texts -> the vector each has in the cache
        now -> re-embedded on the warm-up lane (not lookups: ``inference.drift_items``, not
        ``items`` nor ``misses``) -> cosine of each pair
        -> {"sampled", "min_cosine", "mean_cosine", "below_threshold", "threshold"}

A sampled text that left the cache since it was hit is skipped (not sampled). With nothing to
sample, ``sampled`` is 0 and both cosines are null. The last result is ``/v1/stats``
``cache.drift`` (with ``at``, its wall-clock time) and the metric
``fleetcache_cache_drift_min_cosine``. In the background, every worker wakes once per interval
but only the one that takes the run directory's lock, and finds the last result older than
the interval, runs the check: one check per interval for the whole server.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import random
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from proxy.services import Services

log = logging.getLogger("fleetcache.drift")

RESERVOIR = 1024  # hit texts a worker keeps
MAX_TEXT_CHARS = 4096  # feature texts are ~200 characters; longer ones are not kept
DEFAULT_SAMPLE = 256
MAX_SAMPLE = 4096


class HitReservoir:
    """The last ``capacity`` texts found in the cache by this process's lookups."""

    def __init__(self, capacity: int = RESERVOIR) -> None:
        self._texts: deque[str] = deque(maxlen=capacity)

    def add(self, texts: Sequence[str]) -> None:
        """On every lookup with hits: one C-level extend, nothing else on the hit path."""
        self._texts.extend(t for t in texts if len(t) <= MAX_TEXT_CHARS)

    def texts(self) -> list[str]:
        """Distinct, most recent last."""
        return list(dict.fromkeys(self._texts))


def cosines(stored: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two ``(n, dim)`` arrays."""
    norms = np.linalg.norm(stored, axis=1) * np.linalg.norm(fresh, axis=1)
    dots = np.einsum("ij,ij->i", stored.astype(np.float64), fresh.astype(np.float64))
    return np.asarray(dots / np.maximum(norms, 1e-12))


def summary(values: np.ndarray, threshold: float) -> dict[str, Any]:
    """The answer of API.md for the cosines of one check."""
    if len(values) == 0:
        return {
            "sampled": 0,
            "min_cosine": None,
            "mean_cosine": None,
            "below_threshold": 0,
            "threshold": threshold,
        }
    return {
        "sampled": len(values),
        "min_cosine": float(values.min()),
        "mean_cosine": float(values.mean()),
        "below_threshold": int((values < threshold).sum()),
        "threshold": threshold,
    }


async def check_drift(
    services: Services, sample: int = DEFAULT_SAMPLE, rng: random.Random | None = None
) -> dict[str, Any]:
    """One check (see the module docstring); the result is saved for ``/v1/stats``. Raises
    what the engine raises (``EngineError``, ``ServiceUnavailableError``)."""
    texts = await services.engine.hit_texts(services.reservoir.texts())
    distinct = list(dict.fromkeys(texts))
    chosen = (rng or random.Random()).sample(distinct, min(sample, len(distinct)))
    stored = await services.embedder.stored(chosen)
    kept = [(text, row) for text, row in zip(chosen, stored, strict=True) if row is not None]
    values = np.empty(0)
    if kept:
        fresh = await services.engine.reembed([text for text, _ in kept])
        values = cosines(np.stack([row for _, row in kept]), fresh)
    result = summary(values, services.settings.drift_threshold)
    services.save_shared("drift", {**result, "at": time.time()})
    if result["below_threshold"]:
        log.warning(
            "drift: %d of %d sampled cache hits below cosine %g (min %.6f): the engine's "
            "output changed under the same fingerprint",
            result["below_threshold"],
            result["sampled"],
            result["threshold"],
            result["min_cosine"],
        )
    return result


@contextlib.contextmanager
def _run_lock(run_dir: Path | None) -> Iterator[bool]:
    """Whether this process may run the background check now (one process at a time)."""
    if run_dir is None:
        yield True
        return
    fd = os.open(run_dir / "drift.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


async def background_once(services: Services, interval_s: float) -> dict[str, Any] | None:
    """The background check, if this process takes the lock and the last result is older
    than ``interval_s``; None when it left the check to another process or to later."""
    with _run_lock(services.run_dir) as mine:
        last = services.last_shared("drift")
        if not mine or (last is not None and time.time() - last["at"] < interval_s * 0.9):
            return None
        try:
            return await check_drift(services)
        except Exception as exc:  # the loop outlives any one failure (engine down, ...)
            log.warning("background drift check failed: %s: %s", type(exc).__name__, exc)
            return None


@contextlib.asynccontextmanager
async def background_checks(services: Services, interval_s: float) -> AsyncIterator[None]:
    """Runs ``background_once`` about every ``interval_s`` (0: never) while the block runs."""
    if interval_s <= 0:
        yield
        return

    async def loop() -> None:
        rng = random.Random()
        while True:  # a little jitter: workers started together do not wake together
            await asyncio.sleep(interval_s * rng.uniform(1.0, 1.1))
            await background_once(services, interval_s)

    task = asyncio.create_task(loop(), name="drift-checks")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
