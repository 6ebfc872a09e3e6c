"""Single-flight: each distinct text is computed once, however many callers want it at once.

``SingleFlight`` is the in-flight map. It lives where misses meet the engine: in the engine
process of a server (one map across every HTTP worker), or inside a ``CachedEmbedder`` built
over a plain compute function (one process)::

    embed(texts, lane, caller, ttl_s)
      text in flight (another caller's, or earlier in these texts)  -> coalesced: await it
      otherwise                                                     -> miss: one new flight
      all new misses of the call -> ONE compute(texts, lane) in a task of its own:
          rows computed -> rows future resolved (callers answered)
          -> written back (write_back, awaited; with the entity links of its texts)
          -> marked written (``durable`` callers answered) -> entries dropped

An entry lives until its rows are written back, so a caller arriving later finds the text in
flight or in the store, never neither (API.md v1.1). One window remains: a caller whose store
lookup read just before a write-back landed reaches the map just after the entry left it (seen
as one text embedded twice in 12,000 by the kill-and-resume warm-up test). So the last
``recent // 2`` to ``recent`` texts written (two generations) stay joinable, with when they
were written, and a caller that says when its lookup began (``since``) joins those written
after that, as coalesced. Texts written before its lookup began were in the store for it:
missing them there means they expired, were dropped or the store failed, and they are
computed again.

Backpressure (``max_unwritten``): rows computed and not yet written back wait in memory for
the store, and a store slower than the device (LMDB's fsync'd commits on a virtual disk:
11-21k new vectors a second on the H200 machine, where the batcher alone computes 75-108k)
would let them pile up without bound under sustained new texts (measured there: during 2 s
of 40k new texts a second, a write-back ended 1.2 s after its rows on average; after 15 s,
the store was 5 s behind, docs/BENCHMARKS.md). So while ``max_unwritten`` rows wait for the
store, a call with new texts waits before it starts computing, a warm-up call from half of
it (a job slows to the store's pace first, and dispatch keeps the other half). The store frees
room a transaction at a time (``LmdbByteStore.max_group``), so a dispatch call waits at most
about one; a worker's admission (``max_inflight_requests``) turns longer queues into 429s.
Texts only in flight (coalesced) are never held back.
(Refusing dispatch at once with a 429 instead was measured on the H200: closed-loop clients
then retried into a storm of 429s, 51,517 in 30 s, and the texts served fell to 15,616/s.)

The computation runs in its own task: a caller that goes away does not cancel it, the callers
coalesced on it still get their rows, and the write-back still happens. A compute error
reaches every waiter of that flight and nothing is written; the next caller computes again.

Counting (``stats``, a ``CacheStats``): ``coalesced`` when a text joins a flight; ``misses``
when a flight starts, unless ``count_misses`` is False because the engine counts them itself
at the moment it takes them (the engine process: ``misses`` then always equals
``inference.items``, whatever fails later).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from cache.stats import CacheStats
from engines.base import EngineError

log = logging.getLogger("fleetcache.cache")

Vectors = npt.NDArray[np.float32]
Row = npt.NDArray[np.float32]
ComputeFn = Callable[[Sequence[str], str], Awaitable[Vectors]]
"""``async compute(texts, lane) -> (len(texts), dim) float32``; production: Batcher.submit."""
Ttls = Mapping[str, float]  # text -> seconds, for the texts written with a TTL
Links = Sequence[tuple[str, str, str]]  # (kind, id, text): entities whose texts these are
Since = float | Sequence[Sequence[float | None]] | None
"""When the caller's store lookup began (``time.monotonic``); for a call that merges several
callers' texts, ``[[count, since], ...]`` in text order, so that each text joins a write-back
later than its own caller's lookup (None: joins none)."""
WriteBackFn = Callable[[list[str], Vectors, Ttls, list[str] | None, Links], Awaitable[bool]]
"""``write_back(texts, rows, ttl_s, keys, links)`` writes computed rows to the store, under
``keys`` when the callers hashed them (else None); False when the store failed (absorbed)."""


class Flown(NamedTuple):
    """The rows of one ``embed`` call, in input order (read-only: shared with every caller
    coalesced on them), and which texts joined a computation already in flight."""

    rows: Vectors
    coalesced: list[bool]


@runtime_checkable
class Flight(Protocol):
    """Where a cache sends its misses: a ``SingleFlight`` here, or the engine process."""

    async def embed(
        self,
        texts: Sequence[str],
        *,
        lane: str,
        caller: str,
        ttl_s: Ttls,
        since: float | None = None,
        links: Links = (),
        durable: bool = True,
        keys: Sequence[str] | None = None,
    ) -> Flown: ...


class _Flight:
    """One compute call: its texts with their rows, and ONE future for all their rows (not
    one per text: at warm-up sizes a future and its callbacks per text cost more than the
    cache). The maps hold the flight itself for each of its texts, not a tuple per text that
    lives until (in ``recent``, after) the write-back: the engine process's loop then spent
    7-15% less CPU per new text (``bench/engine_bench.py``, docs/BENCHMARKS.md).

    Each caller waits on a future of its own, resolved by ``wake`` as soon as the flight no
    longer holds it up: the caller resumes on the loop's next turn (``asyncio.wait`` on the
    shared futures took two: its callback's, then the caller's), and a caller that goes away
    cancels only its own future."""

    __slots__ = ("at", "future", "keys", "row", "waiters", "written", "written_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.row: dict[str, int] = {}  # text -> its row in ``future``'s result, in that order
        self.at: Sequence[int] = ()  # their places in the call that started it, in that order
        self.keys: list[str] = []  # their store keys, in that order, when the caller gave them
        self.future: asyncio.Future[Vectors] = loop.create_future()
        self.future.add_done_callback(_retrieve)
        self.waiters: list[tuple[asyncio.Future[None], bool]] = []  # (a caller's, durable)
        self.written = False  # the write-back ended (or never will: the compute failed)
        # when written back: time.monotonic, the same in every process of one machine
        self.written_at = float("-inf")

    def ready(self, durable: bool) -> bool:
        """Whether a caller (``durable``: one that waits for the write-back) may go on."""
        return self.written if durable else self.future.done()

    async def wait(self, durable: bool) -> None:
        if not self.ready(durable):
            waiter = self.future.get_loop().create_future()
            self.waiters.append((waiter, durable))
            await waiter

    def wake(self) -> None:
        """Resolve the futures of the callers that may go on now."""
        waiting = []
        for waiter, durable in self.waiters:
            if not self.ready(durable):
                waiting.append((waiter, durable))
            elif not waiter.done():  # cancelled: its caller went away
                waiter.set_result(None)
        self.waiters = waiting


def _own(texts: Sequence[str], flight: _Flight) -> list[str]:
    """The texts ``flight`` computes, in its rows' order. Texts that carry more than their
    strings (``engines.tokenization.TokenizedTexts``: their token ids, read-only) say which
    of them with ``take``, so that what they carry reaches ``compute``; others by value."""
    take = getattr(texts, "take", None)
    if take is None or not isinstance(texts, list):
        return list(flight.row)
    return texts if len(flight.at) == len(texts) else take(flight.at)


def _retrieve(fut: asyncio.Future[Vectors]) -> None:
    # Every waiter re-raises the exception; a future whose waiters all left must not log
    # "exception was never retrieved".
    if not fut.cancelled():
        fut.exception()


class SingleFlight:
    """The in-flight map over ``compute`` (see the module docstring)."""

    def __init__(
        self,
        compute: ComputeFn,
        dim: int,
        *,
        write_back: WriteBackFn | None = None,
        stats: CacheStats | None = None,
        count_misses: bool = True,
        per_item_ms: Callable[[], float] = lambda: 0.0,
        recent: int = 8192,
        on_settled: Callable[[], None] | None = None,
        max_unwritten: int | None = None,
        own_rows: bool = False,
    ) -> None:
        """``own_rows``: ``compute`` hands over the arrays it returns (never touches them
        again: the batcher's), kept as they are instead of copied (a batch's rows: 0.4 MB)."""
        if max_unwritten is not None and max_unwritten < 2:
            raise ValueError(f"max_unwritten must be at least 2, got {max_unwritten}")
        self._compute = compute
        self._dim = dim
        self._write_back = write_back
        self._stats = stats
        self._count_misses = count_misses
        self._per_item_ms = per_item_ms
        self._inflight: dict[str, _Flight] = {}  # text -> the flight computing it
        # text -> its written flight, in two generations: the newer takes each text written
        # back; holding ``recent // 2`` it becomes the older, the older dropped whole (one
        # dict operation a text on the engine's loop, no per-text eviction)
        self._recent: dict[str, _Flight] = {}
        self._older: dict[str, _Flight] = {}
        self._generation = max(1, recent // 2)
        self._on_settled = on_settled  # called when a flight's entries leave the map
        self._tasks: set[asyncio.Task[None]] = set()
        self._max_unwritten = max_unwritten
        self._keep = np.asarray if own_rows else np.array
        self.unwritten = 0  # rows computed, their write-back not ended
        self.store_waits = 0  # calls that waited for the store to catch up
        self._written = asyncio.Event()  # set whenever a write-back ends

    @property
    def in_flight(self) -> int:
        """Distinct texts being computed or written back now."""
        return len(self._inflight)

    async def embed(
        self,
        texts: Sequence[str],
        *,
        lane: str,
        caller: str,
        ttl_s: Ttls | None = None,
        since: Since = None,
        links: Links = (),
        durable: bool = True,
        keys: Sequence[str] | None = None,
    ) -> Flown:
        """Rows of ``texts``. ``since``: when the caller's store lookup began (``Since``).
        ``links``: entities of these texts, linked to their vectors in the write-back's own
        transaction, and of the caller's other texts (found in its store lookup: their vectors
        are stored), linked in the same transaction; those of texts that joined another
        computation are left to the caller. ``durable``: return once the rows are written
        back, not as soon as they are computed (a caller that links entities itself needs
        its vectors first).
        ``keys``: the texts' store keys, when the caller hashed them for its lookup (the
        write-back then does not hash them again)."""
        if keys is not None and len(keys) != len(texts):  # before the map holds any of them
            raise ValueError(f"{len(keys)} store keys for {len(texts)} texts")
        if self._max_unwritten is not None:
            await self._room_for(texts, lane)
        loop = asyncio.get_running_loop()
        flight = self._all_new(texts, keys, loop)  # this call's own computation, if it needs one
        if flight is not None:
            waits, coalesced = [flight] * len(texts), [False] * len(texts)
        else:
            flight, waits, coalesced = self._claim(texts, since, keys, loop)
        joined = sum(coalesced)
        if self._stats is not None and (joined or self._count_misses):
            misses = len(coalesced) - joined if self._count_misses else 0
            self._stats.record(caller, 0, joined, misses, self._per_item_ms() if joined else 0.0)
        if flight is not None:
            ttls = (
                {t: ttl for t in flight.row if (ttl := ttl_s.get(t)) is not None} if ttl_s else {}
            )
            # its own texts' entities, and those of the caller's hits (their vectors are in
            # the store): one transaction instead of the caller's own for the latter
            asked = set(texts) if links else set()
            linked = [link for link in links if link[2] in flight.row or link[2] not in asked]
            task = loop.create_task(self._run(flight, _own(texts, flight), lane, ttls, linked))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        for owner in set(waits):  # each flight once
            await owner.wait(durable)
        if not waits:
            return Flown(np.empty((0, self._dim), np.float32), [])
        if not joined and flight is not None and len(flight.row) == len(waits):
            return Flown(flight.future.result(), coalesced)  # all its own, in order
        rows = [f.future.result()[f.row[t]] for f, t in zip(waits, texts, strict=True)]
        return Flown(np.stack(rows), coalesced)

    def _all_new(
        self, texts: Sequence[str], keys: Sequence[str] | None, loop: asyncio.AbstractEventLoop
    ) -> _Flight | None:
        """One flight of all of ``texts`` when they are distinct and none is in flight or
        just written (the usual call under new texts), its entries made in C loops rather
        than ``_claim``'s Python step a text; else None."""
        row = dict(zip(texts, range(len(texts)), strict=True))
        if (
            not row
            or len(row) < len(texts)
            or not self._inflight.keys().isdisjoint(row)
            or not self._recent.keys().isdisjoint(row)
            or not self._older.keys().isdisjoint(row)
        ):
            return None
        flight = _Flight(loop)
        flight.row, flight.at = row, range(len(texts))
        if keys is not None:
            flight.keys = list(keys)
        self._inflight.update(dict.fromkeys(row, flight))
        return flight

    def _claim(
        self,
        texts: Sequence[str],
        since: Since,
        keys: Sequence[str] | None,
        loop: asyncio.AbstractEventLoop,
    ) -> tuple[_Flight | None, list[_Flight], list[bool]]:
        """Each text's flight: the one computing it, one that wrote it back after ``since``
        (coalesced), or a new flight of the call's own (None if it needs none); and which
        texts joined another (or came earlier in ``texts``)."""
        inflight, recent, older = self._inflight, self._recent, self._older
        flight: _Flight | None = None
        waits: list[_Flight] = []
        coalesced: list[bool] = []
        at: list[int] = []  # the flight's places in ``texts``
        joinable_after = _joinable_after(since, len(texts))
        for i, text in enumerate(texts):
            owner = inflight.get(text)
            if (
                owner is None
                and (late := recent.get(text) or older.get(text))
                and late.written_at >= joinable_after[i]
            ):
                owner = late
            coalesced.append(owner is not None)  # earlier in these texts counts too
            if owner is None:
                if flight is None:
                    flight = _Flight(loop)
                    flight.at = at = []
                owner = inflight[text] = flight
                flight.row[text] = len(flight.row)
                at.append(i)
                if keys is not None:
                    flight.keys.append(keys[i])
            waits.append(owner)
        return flight, waits, coalesced

    async def _room_for(self, texts: Sequence[str], lane: str) -> None:
        """Wait while too many computed rows wait for the store (see the module docstring),
        unless every text is in flight already."""
        limit = self._max_unwritten or 0
        limit = limit if lane == "dispatch" else limit // 2
        if self.unwritten < limit or all(t in self._inflight for t in texts):
            return
        self.store_waits += 1
        while self.unwritten >= limit:
            self._written.clear()
            await self._written.wait()

    async def _run(
        self, flight: _Flight, texts: list[str], lane: str, ttl_s: Ttls, links: Links
    ) -> None:
        """Compute ``texts`` (the flight's, in its rows' order) and write them back."""
        fut = flight.future
        stored = False  # written back: then it stays joinable a little longer (``recent``)
        computed = 0  # rows waiting for the store (``unwritten``)
        try:
            try:
                # Read-only (a copy unless handed over): every caller coalesced on them shares them.
                rows = self._keep(await self._compute(texts, lane), dtype=np.float32)
                if rows.shape != (len(texts), self._dim):
                    raise EngineError(
                        f"compute returned shape {rows.shape} for {len(texts)} texts, "
                        f"expected ({len(texts)}, {self._dim})"
                    )
                rows.flags.writeable = False
            except BaseException as exc:
                err = exc if isinstance(exc, Exception) else EngineError(f"aborted: {exc!r}")
                fut.set_exception(err)
                flight.wake()
                if err is not exc:
                    raise
                return
            fut.set_result(rows)  # answered now; the entries stay until written back
            flight.wake()
            computed = len(texts)
            self.unwritten += computed
            if self._write_back is not None:
                try:
                    stored = await self._write_back(texts, rows, ttl_s, flight.keys or None, links)
                except Exception:  # the writer absorbs store failures; this guards bugs
                    log.exception("write-back of %d texts failed", len(texts))
        finally:
            flight.written = True  # durable waiters go on, whatever happened
            flight.written_at = time.monotonic()
            flight.wake()
            self.unwritten -= computed
            self._written.set()
            inflight, recent = self._inflight, self._recent
            for text in texts:  # its own: no other flight takes a text while one holds it
                inflight.pop(text, None)
            if stored:
                recent.update(dict.fromkeys(texts, flight))
            if len(recent) >= self._generation:
                self._older, self._recent = recent, {}
            if self._on_settled is not None:
                self._on_settled()

    async def drain(self, grace_s: float) -> None:
        """Let running computations finish and write back (up to ``grace_s`` seconds)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)


def _joinable_after(since: Since, n: int) -> list[float]:
    """Each of ``n`` texts' ``since`` (infinite: it joins no write-back)."""
    if since is None or isinstance(since, int | float):
        return [float("inf") if since is None else float(since)] * n
    after: list[float] = []
    for count, at in since:
        after += [float("inf") if at is None else float(at)] * int(count or 0)
    if len(after) != n:
        raise ValueError(f"since covers {len(after)} texts of {n}")
    return after
