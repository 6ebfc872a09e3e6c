"""The dynamic batcher: concurrent submissions become engine batches, dispatch lane first.

Threading model::

    event loop (all queue state, all futures)          engine thread (exactly one)
    -----------------------------------------          ---------------------------
    submit(): bounded check, queue the request in
              its lane (a warm-up one sorted by
              length), await the request's future
    worker task, the single owner of the lanes:
      wait for work, then up to max_delay_ms for a
      full batch; take up to max_batch_size items,
      dispatch lane before warmup lane (its
      shortest first), dropping requests whose
      future is already done or whose deadline
      passed                                 ------->  take the slices still wanted,
                                                       tokenize, then forward in groups
                                                       within max_batch_tokens
      (sleeps on a future of its own:        <-------  (n, dim) float32 or an exception,
      submit, close and each step of the               straight to a callback on the loop
      engine thread resolve it directly)               that copies each request's rows and
                                                       resolves their futures

    tokenizer thread (exactly one): while a batch is in the engine and the queue already
    fills the next batch, the worker takes that batch at once (dispatch items first, as
    always) and hands it here; this thread tokenizes it and hands it on to the engine thread
    itself, where it waits behind the batch running. Neither hand-off waits for a turn of the
    event loop, so the engine thread goes from one forward to the next while the loop is busy
    (on the H200, under 8 workers' load, the loop's turns between a forward's end and the
    next batch's hand-off left the GPU idle while full batches queued). At most ``AHEAD``
    batches are handed over that the engine has not started, and only one of them may hold
    warm-up items: a dispatch item that arrives after a warm-up batch was formed early waits
    for at most one more forward (that batch's), as without the overlap. Only full batches
    are formed early, so max_delay behaves as without it. The engine thread starting on a
    batch wakes the worker (a slot ahead is free), and its outcome resolves the requests in
    the loop's next turn: no task or wrapped future between (each layer cost a turn, and a
    turn of the engine process's loop under 8 workers' load lasts milliseconds).

    The engine thread takes a batch's slices when it starts on it, under a lock that the
    deadline timer takes too: a request that went away or expired before that moment is not
    computed (the rest is re-tokenized; a request is either failed at its deadline or
    computed, never both), and ``items``, the queue wait and ``on_sent`` count what it
    took, on the event loop, before the batch's result arrives there.

Every future is resolved on every path: with its rows; with the batch's ``EngineError`` (only
the requests in that batch; the worker keeps serving; when the engine says the batch failed by
what it held, ``BatchError``, each of its requests is run alone and only those whose own texts
fail get it); with ``EngineError("batcher closed")``
on ``aclose``; with ``DeadlineExceededError`` when its deadline passes while some of its items
have not reached the engine yet (a timer fails it at the deadline, even while the engine is
busy; items already in the engine finish, their rows are discarded); with
``EngineUnavailableError`` at once when the engine's health says nothing can serve; or by the
submitter's own cancellation. Items of a failed, expired or cancelled request that are still
queued (or tokenized ahead) are dropped before reaching the engine. A request larger than
``max_batch_size`` is split across batches and resolved when its last slice returns.

Token budget: a batch costs ``size x padded sequence length`` (``Batch.seq_lengths``, the
engine's own tokenization and buckets). Where the lengths are known on admission (texts that
come with the engine's token ids, a worker's: ``Engine.padded_lengths``), a batch is formed
within ``max_batch_tokens`` (a text over it alone), so it is tokenized once and, ahead of the
forward before it, reaches a device child at once. Other texts' lengths are known only once
tokenized, and tokenizing twice would halve what the tokenizer (the bottleneck next to a
GPU) can feed, so for them the budget is enforced on the engine thread: a batch over it is
run as several forwards, contiguous groups within the budget (each tokenized again); a text
over the budget on its own runs alone. Batches tokenized ahead go through the same check. A
batch is formed early (``_take_ahead``) when ``max_batch_size`` items wait, whatever the
budget leaves of them. Size the budget so that normal traffic never reaches it: it is a
guard against long texts.

Warm-up texts by length: with their lengths known, a warm-up request is sorted by length as
it is queued, and a batch of its lane takes the shortest texts of the lane's first requests
(``_take_shortest``; each request still gets its rows in the order it sent its texts). A
forward costs its size x its longest text, and a fleet's driver texts pad to 64 or 96
columns: in submission order nearly every batch of 256 holds one of 96. The oldest request
is passed over ``PASSES`` times at most. Dispatch items are never reordered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import numpy.typing as npt

from engines.base import (
    Batch,
    BatchError,
    DeadlineExceededError,
    Engine,
    EngineError,
    EngineUnavailableError,
    QueueFullError,
    TooLargeError,
    Vectors,
)
from engines.tokenization import TokenizedTexts, owned

logger = logging.getLogger(__name__)

LANES = ("dispatch", "warmup")  # priority order: a batch takes dispatch items first
AHEAD = 2  # batches handed over that the engine has not started on yet, at most
# Warm-up texts of like length go together (``Batcher._take_shortest``): a batch takes the
# shortest among the warm-up lane's first requests holding this many batches of texts, ...
SHORTEST_WINDOW = 2
# ... until the oldest of them has been passed over this many times (then it goes first)
PASSES = 4


@dataclass(frozen=True)
class InferenceStats:
    """What the engine did, for /v1/stats ``inference`` (durations in milliseconds)."""

    items: int  # texts the engine thread took (as it starts a batch), failed batches included
    batches: int  # batches handed to the engine, failed ones included
    mean_batch: float
    per_item_ms: float  # engine time of successful batches / their items; 0.0 before any
    p50_batch_ms: float  # over the last ``window`` successful batches
    p99_batch_ms: float
    last_error: str | None
    failed_batches: int
    expired_items: int  # dropped because their deadline passed before the engine saw them
    queue_wait_p50_ms: float  # submit -> the engine starts on it, last ``window`` slices
    queue_wait_p99_ms: float
    ok_items: int  # texts of successful batches
    engine_ms: float  # engine time of successful batches (per_item_ms = engine_ms / ok_items)


@dataclass(frozen=True)
class EngineHealth:
    """Whether misses can be computed now, and by what (/readyz, /v1/stats)."""

    healthy: bool
    reason: str | None  # why not healthy, or why degraded
    serving: str  # primary | fallback | none (misses are refused at once)
    degraded: bool = False  # healthy, but a soft reading of its device holds (FallbackEngine)


QueueWaitObserver = Callable[[str, float], None]  # (lane, seconds), once per request slice
SentObserver = Callable[[str, int], None]  # (the submission's tag, texts handed to the engine)


class _Request:
    """One submission: its texts, the rows filled so far and the future its caller awaits."""

    __slots__ = (
        "counted",
        "deadline",
        "filled",
        "future",
        "lane",
        "lengths",
        "longest",
        "order",
        "passed",
        "rows",
        "sent",
        "submitted",
        "tag",
        "taken",
        "texts",
    )

    def __init__(
        self,
        texts: list[str],
        future: asyncio.Future[Vectors],
        dim: int,
        lane: str,
        deadline: float | None,
        tag: str,
        counted: bool = True,
        lengths: npt.NDArray[np.int64] | None = None,
        order: npt.NDArray[np.int64] | None = None,
    ) -> None:
        self.texts = texts
        self.lengths = lengths  # each text's padded length, when known before tokenizing
        self.order = order  # each text's place in the submission, when sorted by length
        self.passed = 0  # batches formed of shorter texts while this one waited oldest
        self.longest = 0 if lengths is None else int(lengths.max(initial=0))
        self.lane = lane
        self.tag = tag
        self.counted = counted
        self.future = future
        self.deadline = deadline  # time.monotonic() after which queued items are dropped
        self.submitted = time.monotonic()
        self.rows: Vectors = np.empty((len(texts), dim), dtype=np.float32)
        self.taken = 0  # items handed to a batch or dropped; the rest are still queued
        self.sent = 0  # items the engine thread took (under Batcher._claim)
        self.filled = 0  # rows written back

    @property
    def waiting(self) -> int:
        return len(self.texts) - self.taken


_Slice = tuple[_Request, int, int]  # request, start, stop
_Result = tuple[Vectors, list[float]] | Exception  # rows and forward durations, or the error
_Outcome = tuple[list[_Slice], _Result]  # what the engine thread took, and its result
_Ahead = tuple[list[str], Batch]  # a batch's texts and tokens, made by the tokenizer thread


def _report(
    loop: asyncio.AbstractEventLoop,
    complete: Callable[[int, list[_Slice], _Result], None],
    key: int,
    batch: list[_Slice],
    outcome: _Result,
) -> None:
    """From a thread: a batch's outcome to ``complete`` on the loop."""
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is left waiting
        loop.call_soon_threadsafe(complete, key, batch, outcome)


class Batcher:
    """Coalesces ``submit`` calls into batches of ``engine.embed`` on one engine thread.

    Use from one event loop: ``async with Batcher(engine) as batcher: await
    batcher.submit(texts)``. The engine must already be loaded and warmed; the batcher only
    runs it. ``max_batch_tokens`` (None: no budget) bounds each forward's size x padded
    sequence length. ``by_length``: warm-up texts of like padded length batched together
    (``_take_shortest``); off, in submission order as before 2026-12-06 (the baseline of
    ``bench/warmup_batch_bench.py``). Observers, called on the event loop:
    ``on_queue_wait(lane, seconds)`` for every request slice the engine starts on;
    ``on_sent(tag, count)`` with the submission's ``tag`` as the engine thread starts on its
    texts (where ``items`` counts them); ``on_batch_done()`` after every batch, failed or
    not (``stats()`` changed).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch_size: int = 64,
        max_delay_ms: float = 2.0,
        max_queue: int = 100_000,
        max_batch_tokens: int | None = None,
        by_length: bool = True,
        window: int = 1024,
        on_queue_wait: QueueWaitObserver | None = None,
        on_sent: SentObserver | None = None,
        on_batch_done: Callable[[], None] | None = None,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or window < 1 or max_delay_ms < 0:
            raise ValueError("max_batch_size, max_queue, window >= 1 and max_delay_ms >= 0")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be positive or None, got {max_batch_tokens}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000
        self.max_queue = max_queue
        self.max_batch_tokens = max_batch_tokens
        self.by_length = by_length
        self.on_queue_wait = on_queue_wait
        self.on_sent = on_sent
        self.on_batch_done = on_batch_done
        self._lanes: dict[str, deque[_Request]] = {lane: deque() for lane in LANES}
        self._queued = 0  # items waiting in the lanes (not yet in a batch, not dropped)
        self._lane_waiting = dict.fromkeys(LANES, 0)  # the same, per lane
        self._wake: asyncio.Future[None] | None = None  # the worker's, while it sleeps
        self._worker: asyncio.Task[None] | None = None
        self._outstanding = 0  # batches handed over whose outcome the loop has not taken
        self._reruns: set[asyncio.Task[None]] = set()  # failed batches' requests run alone
        self._waiting_engine: dict[int, int] = {}  # batch -> its items, until the engine starts
        self._handed = 0  # batches handed to the engine thread so far (their keys)
        self._claim = threading.Lock()  # the engine thread taking slices | _expire
        self._executor: ThreadPoolExecutor | None = None
        self._tokenizer: ThreadPoolExecutor | None = None
        self._closed = False
        self._items = 0
        self._uncounted_items = 0
        self._batches = 0
        self._failed_batches = 0
        self._ok_items = 0
        self._engine_ms = 0.0
        self._batch_ms: deque[float] = deque(maxlen=window)
        self._wait_ms: deque[float] = deque(maxlen=window)
        self._expired_items = 0
        self._last_error: str | None = None
        self._last_batch_failed = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and the worker task (idempotent)."""
        if self._closed:
            raise EngineError("batcher closed")
        if self._worker is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="engine",
                initializer=name_thread,
                initargs=("batch-engine",),
            )
            self._tokenizer = ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="tokenizer",
                initializer=name_thread,
                initargs=("batch-tokenize",),
            )
            self._worker = asyncio.create_task(self._run(), name="batcher-worker")

    async def aclose(self) -> None:
        """Fail every queued request, let the batch in flight finish, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._fail_queued(EngineError("batcher closed"))
        self._poke()
        if self._worker is not None:
            await asyncio.wait({self._worker})  # never raises the worker's own outcome
        for executor in (self._executor, self._tokenizer):
            if executor is not None:
                executor.shutdown(wait=False)

    async def __aenter__(self) -> Batcher:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the public surface ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._worker is not None and not self._worker.done() and not self._closed

    @property
    def healthy(self) -> bool:
        """Running, the engine says ok, and the most recent batch did not fail (a later
        success restores it)."""
        return self.engine_health().healthy

    def engine_health(self) -> EngineHealth:
        """Healthy, or the reason not; ``serving`` from the engine's own health when it
        judges it (``FallbackEngine``), else ``primary`` while running."""
        if not self.running:
            state = "not started" if self._worker is None else "stopped"
            return EngineHealth(False, f"batcher {'closed' if self._closed else state}", "none")
        health = self.engine.health()
        serving = str(health.get("serving", "primary"))
        if not health.get("ok", True):
            return EngineHealth(False, str(health.get("reason") or "engine not ok"), serving)
        if self._last_batch_failed:
            return EngineHealth(False, f"engine failing: {self._last_error}", serving)
        if health.get("degraded"):
            return EngineHealth(True, str(health.get("reason")), serving, degraded=True)
        return EngineHealth(True, None, serving)

    @property
    def queued(self) -> int:
        """Items the engine has not started on (queue depth): queued, or handed over (to the
        tokenizer thread or the engine thread, behind the batch it is running)."""
        return self._queued + self.waiting_engine

    @property
    def waiting_engine(self) -> int:
        """Items handed over that the engine thread has not started on yet."""
        return sum(list(self._waiting_engine.values()))  # a copy: the engine thread pops

    @property
    def last_error(self) -> str | None:
        """The last failed batch's error (``stats`` has it too, with percentiles to compute)."""
        return self._last_error

    @property
    def per_item_ms(self) -> float:
        """Mean engine time per text so far; the cache prices an avoided call with it."""
        return self._engine_ms / self._ok_items if self._ok_items else 0.0

    async def submit(
        self,
        texts: Sequence[str],
        lane: str = "dispatch",
        deadline: float | None = None,
        tag: str = "",
        counted: bool = True,
    ) -> Vectors:
        """The ``(len(texts), dim)`` float32 vectors of ``texts``, in input order.

        ``deadline`` is a ``time.monotonic()`` instant (None: wait as long as it takes; see
        ``deadline_after``); ``tag`` is handed to ``on_sent`` (the caller, for counting).
        ``counted=False``: no lookup's misses (a drift check's re-embeds): their texts count
        in ``uncounted_items``, not in ``items``, and are never handed to ``on_sent``.
        Raises ``QueueFullError`` at once (nothing queued) when the queue cannot take all of
        ``texts``; ``DeadlineExceededError`` when the deadline passes before all of
        ``texts`` reached the engine; ``EngineUnavailableError`` at once while the engine's
        health says nothing can serve; ``EngineError`` when the batch failed or the batcher
        is closed or not started; ``ValueError`` for an unknown lane.
        """
        if lane not in self._lanes:
            raise ValueError(f"unknown lane {lane!r}; lanes: {', '.join(LANES)}")
        health = self.engine_health()
        if not self.running:
            raise EngineError(str(health.reason))
        if health.serving == "none":
            raise EngineUnavailableError(f"no engine can serve: {health.reason}")
        if not texts:
            return np.empty((0, self.engine.dim), dtype=np.float32)
        if deadline is not None and deadline <= time.monotonic():
            raise DeadlineExceededError(f"deadline passed before {len(texts)} texts were queued")
        if len(texts) > self.max_queue:
            raise TooLargeError(
                f"{len(texts)} new texts at once can never enter a queue of max_queue="
                f"{self.max_queue}: send fewer"
            )
        if (waiting := self.queued) + len(texts) > self.max_queue:  # handed over included
            raise QueueFullError(
                f"batcher queue full: {waiting} items waiting, {len(texts)} more "
                f"would exceed max_queue={self.max_queue}"
            )
        loop = asyncio.get_running_loop()
        texts = owned(texts)
        lengths = None if self.max_batch_tokens is None else self.engine.padded_lengths(texts)
        order = None
        if (
            self.by_length
            and lane == "warmup"
            and lengths is not None
            and (np.diff(lengths) < 0).any()
        ):
            order = np.argsort(lengths, kind="stable")  # shortest first (_take_shortest)
            lengths = lengths[order]
            positions = order.tolist()
            if isinstance(texts, TokenizedTexts):
                texts = texts.take(positions)
            else:
                texts = [texts[i] for i in positions]
        request = _Request(
            texts,
            loop.create_future(),
            self.engine.dim,
            lane,
            deadline,
            tag,
            counted,
            lengths,
            order,
        )
        self._lanes[lane].append(request)
        self._queued += len(texts)
        self._lane_waiting[lane] += len(texts)
        self._poke()
        timer = None
        if deadline is not None:
            timer = loop.call_later(deadline - time.monotonic(), self._expire, request)
        try:
            return await request.future
        finally:
            self._drop(request)  # cancelled or failed: what is still queued never runs
            if timer is not None:
                timer.cancel()

    def totals(self) -> tuple[int, int, int, int, int, float, int]:
        """``(items, batches, failed_batches, expired_items, ok_items, engine_ms,
        uncounted_items)``: the counters of ``stats()`` without its percentiles (cheap enough
        to read every batch)."""
        return (
            self._items,
            self._batches,
            self._failed_batches,
            self._expired_items,
            self._ok_items,
            self._engine_ms,
            self._uncounted_items,
        )

    def stats(self) -> InferenceStats:
        p50, p99 = _percentiles(self._batch_ms)
        wait_p50, wait_p99 = _percentiles(self._wait_ms)
        return InferenceStats(
            items=self._items,
            batches=self._batches,
            mean_batch=self._items / self._batches if self._batches else 0.0,
            per_item_ms=self.per_item_ms,
            p50_batch_ms=float(p50),
            p99_batch_ms=float(p99),
            last_error=self._last_error,
            failed_batches=self._failed_batches,
            expired_items=self._expired_items,
            queue_wait_p50_ms=wait_p50,
            queue_wait_p99_ms=wait_p99,
            ok_items=self._ok_items,
            engine_ms=self._engine_ms,
        )

    # -- the worker (event loop) -----------------------------------------------------------

    async def _run(self) -> None:
        try:
            while not self._closed:
                if not self._outstanding and self._queued:
                    await self._wait_for_more()
                    if batch := self._take():
                        self._hand_off(batch)
                elif not self._hand_off_ahead():
                    # idle, or the engine has its next batches, or the next is not full yet
                    await self._sleep()
        except Exception:  # a bug here must not leave waiters hanging: fail them below
            logger.exception("batcher worker crashed")
        finally:  # closed, crashed or cancelled: nobody is left waiting
            self._fail_queued(EngineError("batcher closed" if self._closed else "batcher stopped"))
            while self._outstanding:  # the batches handed over finish normally
                await self._sleep()

    async def _sleep(self) -> None:
        """Until ``_poke``: a submission, close, the engine thread starting on a batch or a
        batch's outcome taken. Resolved directly, so the worker runs on the loop's next turn."""
        self._wake = asyncio.get_running_loop().create_future()
        await self._wake

    def _poke(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    def _hand_off_ahead(self) -> bool:
        """While the engine is busy: the next full batch to the tokenizer thread, if the engine
        has room for one more (``AHEAD``). Returns whether one went."""
        if self._closed or not self._outstanding or len(self._waiting_engine) >= AHEAD:
            return False
        batch = self._take_ahead(not self._waiting_engine)
        if batch:
            self._hand_off(batch, ahead=True)
        return bool(batch)

    def _take_ahead(self, first: bool) -> list[_Slice]:
        """The next batch to tokenize while the engine runs, if it is full: of either lane
        when it is the ``first`` the engine has not started on, else of dispatch items only
        (at most one batch formed early holds warm-up items)."""
        lanes = LANES if first else LANES[:1]
        if sum(self._lane_waiting[lane] for lane in lanes) < self.max_batch_size:
            return []
        return self._take(lanes)

    async def _wait_for_more(self) -> None:
        """While the batch is not full, wait up to max_delay for more submissions."""
        deadline = asyncio.get_running_loop().time() + self.max_delay_s
        while self._queued < self.max_batch_size and not self._closed:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            try:
                async with asyncio.timeout(remaining):
                    await self._sleep()
            except TimeoutError:
                return

    def _take(self, lanes: Sequence[str] = LANES) -> list[_Slice]:
        """Up to max_batch_size queued items of ``lanes``, dispatch lane first, in submission
        order (warm-up items by length where ``_take_shortest`` forms the batch); within
        ``max_batch_tokens`` where their padded lengths are known (``_fit``)."""
        room, budget = self.max_batch_size, self.max_batch_tokens
        batch: list[_Slice] = []
        longest = 0  # the longest known padded length in the batch
        for lane in lanes:
            queue = self._lanes[lane]
            if lane == "warmup" and room and queue and self.by_length:
                room, longest = self._take_shortest(queue, batch, room, longest)
            while room and queue:
                request = queue[0]
                if request.future.done():  # cancelled, or failed in an earlier slice
                    self._drop(request)
                if request.waiting:
                    count, full = min(room, request.waiting), False
                    if request.lengths is not None and budget is not None:
                        size = self.max_batch_size - room
                        if (size + count) * max(longest, request.longest) <= budget:
                            longest = max(longest, request.longest)  # all of it fits
                        else:
                            fits, longest = _fit(request, count, size, longest, budget)
                            count, full = fits, fits < count  # full: the budget is reached
                    room -= self._cut(batch, request, count)
                    if full:
                        room = 0
                if not request.waiting:
                    queue.popleft()
            while queue and not queue[0].waiting:  # taken whole by _take_shortest
                queue.popleft()
        return batch

    def _take_shortest(
        self, queue: deque[_Request], batch: list[_Slice], room: int, longest: int
    ) -> tuple[int, int]:
        """Into ``batch``: the ``room`` shortest texts waiting in the first warm-up requests
        of ``queue`` that hold ``SHORTEST_WINDOW`` batches of texts, request by request. A
        forward costs its size x its longest padded text, and driver texts pad to 64 or 96
        columns: in submission order nearly every batch of 256 holds one of 96. Each request
        was sorted by length at submit, so its texts up to a length are its next ones.

        Takes nothing (``_take`` then goes in submission order) when a length is unknown,
        when the batch would exceed the token budget, or once the oldest of those requests
        was passed over ``PASSES`` times. Returns the room and the longest length left."""
        if self.max_batch_tokens is None:  # lengths are known only within a budget
            return room, longest
        window: list[tuple[_Request, npt.NDArray[np.int64]]] = []  # and its lengths left
        held = 0
        for request in queue:
            if held >= SHORTEST_WINDOW * self.max_batch_size:
                break
            if request.future.done() or not request.waiting:
                continue
            if request.lengths is None or (not window and request.passed >= PASSES):
                return room, longest
            window.append((request, request.lengths[request.taken :]))
            held += request.waiting
        if not window:
            return room, longest
        lengths = np.concatenate([left for _, left in window])
        k = min(room, len(lengths)) - 1
        cap = int(np.partition(lengths, k)[k])
        if (self.max_batch_size - room + k + 1) * max(cap, longest) > self.max_batch_tokens:
            return room, longest
        for request, left in window:
            up_to_cap = int(np.searchsorted(left, cap, "right"))
            room -= self._cut(batch, request, min(room, up_to_cap))
        if window[0][0].waiting:
            window[0][0].passed += 1
        return room, max(longest, cap)

    def _cut(self, batch: list[_Slice], request: _Request, count: int) -> int:
        """The next ``count`` queued items of ``request`` into ``batch``; returns ``count``."""
        if count:
            batch.append((request, request.taken, request.taken + count))
            request.taken += count
            self._queued -= count
            self._lane_waiting[request.lane] -= count
        return count

    @staticmethod
    def _texts(batch: list[_Slice]) -> list[str]:
        """The batch's texts, with their token ids where every request has them."""
        return TokenizedTexts.join([request.texts[start:stop] for request, start, stop in batch])

    def _hand_off(self, batch: list[_Slice], ahead: bool = False) -> None:
        """Hand ``batch`` to the engine thread, or to the tokenizer thread on its way there
        (``ahead``). The engine thread drops, as it starts on the batch, what went away
        meanwhile, and hands the outcome to ``_complete`` on the loop."""
        key = self._handed = self._handed + 1
        self._waiting_engine[key] = sum(stop - start for _, start, stop in batch)
        self._batches += 1
        self._outstanding += 1
        assert self._executor is not None and self._tokenizer is not None
        loop = asyncio.get_running_loop()
        if ahead:
            self._tokenizer.submit(self._tokenize_then_start, loop, key, batch)
        else:
            self._executor.submit(self._engine_job, loop, key, batch, None)

    def _tokenize_then_start(
        self, loop: asyncio.AbstractEventLoop, key: int, batch: list[_Slice]
    ) -> None:
        """Runs on the tokenizer thread: tokenize ``batch`` and queue it on the engine thread
        (in the order taken: this thread is one)."""
        assert self._executor is not None
        ahead: _Ahead | None
        try:
            texts = self._texts(batch)
            ahead = texts, self.engine.tokenize(texts)
        except Exception:  # the engine thread tokenizes again and reports any error
            ahead = None
        try:
            self._executor.submit(self._engine_job, loop, key, batch, ahead)
        except Exception as exc:  # shut down meanwhile: the loop fails what it held
            _report(loop, self._complete, key, batch, exc)

    def _engine_job(
        self,
        loop: asyncio.AbstractEventLoop,
        key: int,
        batch: list[_Slice],
        ahead: _Ahead | None,
    ) -> None:
        """Runs on the engine thread: the batch, then its outcome straight to the loop (one
        turn of it between a forward's end and its requests resolved)."""
        try:
            live, outcome = self._start(loop, key, batch, ahead)
        except Exception as exc:  # a bug around the engine call: its error, to all it held
            live, outcome = batch, exc
        _report(loop, self._complete, key, live, outcome)

    def _start(
        self,
        loop: asyncio.AbstractEventLoop,
        key: int,
        batch: list[_Slice],
        ahead: _Ahead | None,
    ) -> _Outcome:
        """Runs on the engine thread: take the slices of ``batch`` whose request is still
        waiting and within its deadline (under ``_claim``, which ``_expire`` takes too: a
        request is either failed at its deadline or computed, never both), count them on
        the event loop, and run them (with the texts and tokens the tokenizer thread made
        ``ahead`` of it, when every slice is still live). Returns what it took, with the rows
        and durations or the engine's error."""
        with self._claim:
            now = time.monotonic()
            live = [
                (request, start, stop)
                for request, start, stop in batch
                if not request.future.done()
                and (request.deadline is None or request.deadline > now)
            ]
            for request, start, stop in live:
                request.sent += stop - start
        self._waiting_engine.pop(key, None)  # one dict operation: atomic under the GIL
        loop.call_soon_threadsafe(self._sent, live, now)  # before the result's callback
        if not live:
            return live, (np.empty((0, self.engine.dim), dtype=np.float32), [])
        try:
            if ahead is None or len(live) < len(batch):  # some expired or went away meanwhile
                return live, self._embed(self._texts(live), None)
            return live, self._embed(*ahead)
        except Exception as exc:
            return live, exc

    def _sent(self, live: list[_Slice], now: float) -> None:
        """On the event loop: the slices the engine thread started on, counted, and the next
        full batch handed over ahead here, not in the worker's turn: that turn comes after
        the callbacks of the batch before (its submitters, their write-backs and answers),
        which the engine's outcome queued first. In a warm-up that wait left the device
        without its next batch (docs/BENCHMARKS.md)."""
        self._hand_off_ahead()
        self._poke()
        for request, start, stop in live:
            self._observe_wait(request.lane, now - request.submitted)
            if request.counted:
                self._items += stop - start
                self._notify(self.on_sent, request.tag, stop - start)
            else:
                self._uncounted_items += stop - start

    def _complete(self, key: int, batch: list[_Slice], outcome: _Result) -> None:
        """On the event loop: resolve the requests of a batch handed over, with its rows or
        its error."""
        self._waiting_engine.pop(key, None)
        if isinstance(outcome, BatchError) and len(batch) > 1:
            size = sum(stop - start for _, start, stop in batch)
            self._batch_failed(outcome, size, healthy=True)
            task = asyncio.create_task(self._run_each_alone(batch))
            self._reruns.add(task)
            task.add_done_callback(self._reruns.discard)
            return
        try:
            if isinstance(outcome, Exception):
                size = sum(stop - start for _, start, stop in batch)
                error = outcome if isinstance(outcome, BatchError) else as_engine_error(outcome)
                # An engine that declines (EngineUnavailableError) reports why, and when it
                # is back, in its own health(); only a real failure marks the batcher
                # unhealthy.
                healthy = isinstance(outcome, (BatchError, EngineUnavailableError))
                self._batch_failed(outcome, size, healthy=healthy)
                self._fail([request for request, _, _ in batch], error)
            elif batch:
                vectors, durations = outcome
                self._batches += len(durations) - 1  # one per forward when the budget split it
                self._done(batch, vectors, durations)
            else:
                self._batches -= 1  # nothing of it reached the engine
        finally:  # a bug above must not leave the worker waiting for this batch forever
            self._completed()

    def _completed(self) -> None:
        self._outstanding -= 1
        self._notify(self.on_batch_done)
        self._poke()

    async def _run_each_alone(self, batch: list[_Slice]) -> None:
        """A batch that failed by what it held: each request's slice alone, so that only
        those whose own texts fail get the error."""
        try:
            for item in batch:
                await self._run_alone(item)
        except asyncio.CancelledError:  # the batcher stopped: nobody is left waiting
            self._fail([request for request, _, _ in batch], EngineError("batcher stopped"))
            raise
        finally:
            self._completed()

    async def _forward(self, texts: list[str], tokens: Batch | None) -> tuple[Vectors, list[float]]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._embed, texts, tokens)

    async def _run_alone(self, item: _Slice) -> None:
        """One request's slice of a batch that failed by what it held, run on its own."""
        request, start, stop = item
        if request.future.done():  # cancelled or expired meanwhile
            return
        self._batches += 1
        try:
            vectors, durations = await self._forward(request.texts[start:stop], None)
        except Exception as exc:
            self._batch_failed(exc, stop - start, healthy=isinstance(exc, BatchError))
            self._fail([request], as_engine_error(exc))
        else:
            self._done([item], vectors, durations)

    def _batch_failed(self, exc: Exception, size: int, *, healthy: bool) -> None:
        self._failed_batches += 1
        if not healthy:
            self._last_batch_failed = True
        self._last_error = f"{type(exc).__name__}: {exc}"
        logger.warning("batch of %d texts failed: %s", size, self._last_error)

    def _done(self, batch: list[_Slice], vectors: Vectors, durations: list[float]) -> None:
        self._ok_items += len(vectors)
        self._engine_ms += sum(durations)
        self._batch_ms.extend(durations)
        self._last_batch_failed = False
        offset = 0
        for request, start, stop in batch:
            if not request.future.done():
                rows = vectors[offset : offset + stop - start]
                if request.order is None:
                    request.rows[start:stop] = rows
                else:  # sorted at submit: each row to its text's place in the submission
                    request.rows[request.order[start:stop]] = rows
                request.filled += stop - start
                if request.filled == len(request.texts):
                    request.future.set_result(request.rows)
            offset += stop - start

    def _embed(self, texts: list[str], tokens: Batch | None) -> tuple[Vectors, list[float]]:
        """Runs on the engine thread; tokenizes here unless the batch was tokenized ahead.
        Over the token budget, runs contiguous groups within it. Returns the vectors and
        each forward's milliseconds (tokenization included)."""
        started = time.perf_counter()
        engine = self.engine
        batch = engine.tokenize(texts) if tokens is None else tokens
        lengths = batch.seq_lengths
        if lengths is None:  # unknown: assume every text is as long as the engine allows
            lengths = np.full(len(texts), engine.info.max_seq_length, dtype=np.int64)
        groups = budget_groups(lengths, self.max_batch_tokens)
        parts, durations = [], []
        for start, stop in groups:
            if len(groups) > 1:
                started = time.perf_counter()
                batch = engine.tokenize(texts[start:stop])
            parts.append(engine.postprocess(engine.forward(batch), batch))
            durations.append((time.perf_counter() - started) * 1000)
        vectors = parts[0] if len(parts) == 1 else np.concatenate(parts)
        if vectors.shape != (len(texts), self.engine.dim):
            raise EngineError(f"engine returned shape {vectors.shape} for {len(texts)} texts")
        return vectors, durations

    # -- bookkeeping -----------------------------------------------------------------------

    def _drop(self, request: _Request) -> None:
        """Forget the request's items still queued (idempotent)."""
        self._queued -= request.waiting
        self._lane_waiting[request.lane] -= request.waiting
        request.taken = len(request.texts)

    def _expire(self, request: _Request) -> None:
        """Fail ``request`` if its deadline passed before all its items reached the engine
        (a batch handed over but not started yet included: see ``_start``)."""
        with self._claim:
            if request.future.done() or request.sent == len(request.texts):
                return
            dropped = len(request.texts) - request.sent
            self._expired_items += dropped
            self._drop(request)
            waited_ms = (time.monotonic() - request.submitted) * 1000
            request.future.set_exception(
                DeadlineExceededError(
                    f"{dropped} of {len(request.texts)} texts were still queued in the "
                    f"{request.lane} lane at their deadline ({waited_ms:.0f} ms after submit)"
                )
            )

    def _observe_wait(self, lane: str, seconds: float) -> None:
        self._wait_ms.append(seconds * 1000)
        self._notify(self.on_queue_wait, lane, seconds)

    @staticmethod
    def _notify(observer: Callable[..., None] | None, *args: Any) -> None:
        if observer is not None:
            try:
                observer(*args)
            except Exception:  # a metrics bug must not fail the batch
                logger.exception("batcher observer %r failed", observer)

    def _fail(self, requests: list[_Request], error: EngineError) -> None:
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)

    def _fail_queued(self, error: EngineError) -> None:
        for queue in self._lanes.values():
            while queue:
                request = queue.popleft()
                if request.waiting:  # else every text is in a batch handed over: it finishes
                    self._drop(request)
                    self._fail([request], error)


def name_thread(name: str) -> None:
    """The calling thread's name for the OS (``top -H``, ``/proc/<pid>/task/<tid>/comm``: at
    most 15 characters), where Python's own name stays inside the interpreter; called on the
    main thread, the process's (``ps``), which the processes it forks inherit."""
    with contextlib.suppress(OSError):  # not Linux
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])


def as_engine_error(exc: Exception) -> EngineError:
    if isinstance(exc, EngineError):
        return exc
    error = EngineError(f"engine failed: {exc!r}")
    error.__cause__ = exc
    return error


def deadline_after(ms: float | None) -> float | None:
    """The ``submit`` deadline ``ms`` milliseconds from now (None stays None)."""
    return None if ms is None else time.monotonic() + ms / 1000


def _fit(request: _Request, count: int, size: int, longest: int, budget: int) -> tuple[int, int]:
    """How many of the next ``count`` items of ``request`` (known padded lengths) a batch of
    ``size`` items whose longest is ``longest`` takes within ``budget`` (size x the longest),
    at least one into an empty batch (a text over the budget runs alone), and the longest
    then."""
    assert request.lengths is not None
    lengths = request.lengths[request.taken : request.taken + count]
    longer = np.maximum.accumulate(np.maximum(lengths, longest))
    costs = np.arange(size + 1, size + count + 1) * longer  # non-decreasing
    fits = max(int(np.searchsorted(costs, budget, side="right")), 0 if size else 1)
    return fits, int(longer[fits - 1]) if fits else longest


def budget_groups(lengths: npt.NDArray[np.int64], budget: int | None) -> list[tuple[int, int]]:
    """Contiguous ``(start, stop)`` groups of texts, each costing at most ``budget`` (group
    size x its longest padded length); a text over the budget on its own is a group alone."""
    size = len(lengths)
    if budget is None or size * int(lengths.max(initial=0)) <= budget:
        return [(0, size)]
    groups, start, longest = [], 0, 0
    for index, length in enumerate(lengths.tolist()):
        longest = max(longest, length)
        if index > start and (index - start + 1) * longest > budget:
            groups.append((start, index))
            start, longest = index, length
    groups.append((start, size))
    return groups


def _percentiles(values: deque[float]) -> tuple[float, float]:
    """p50 and p99 of a snapshot of ``values`` (0.0 when empty)."""
    snapshot = list(values)  # another thread may read stats while the loop appends
    if not snapshot:
        return 0.0, 0.0
    p50, p99 = np.percentile(snapshot, [50, 99])
    return float(p50), float(p99)
