"""The dynamic batcher: concurrent submissions become engine batches, dispatch lane first.

Threading model::

    event loop (all queue state, all futures)          engine thread (exactly one)
    -----------------------------------------          ---------------------------
    submit(): bounded check, queue the request in
              its lane, await the request's future
    worker task, the single owner of the lanes:
      wait for work, then up to max_delay_ms for a
      full batch; take up to max_batch_size items,
      dispatch lane before warmup lane, dropping
      requests whose future is already done  ------->  engine.embed(texts)
      await the result                       <-------  (n, dim) float32 or an exception
      copy each request's rows, resolve futures

    tokenizer thread (exactly one): while a batch is in the engine and the dispatch lane
    alone already fills the next batch, the worker takes that batch at once and tokenizes
    it here, so tokenization overlaps the forward instead of following it. Only full,
    dispatch-only batches are formed early: lane priority and max_delay behave as without
    the overlap. A request cancelled meanwhile is dropped (the rest is re-tokenized).

Every future is resolved on every path: with its rows; with the batch's ``EngineError`` (only
the requests in that batch; the worker keeps serving); with ``EngineError("batcher closed")``
on ``aclose``; or by the submitter's own cancellation, whose items still queued are dropped
before reaching the engine. A request larger than ``max_batch_size`` is split across batches
and resolved when its last slice returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType

import numpy as np

from engines.base import Batch, Engine, EngineError, QueueFullError, Vectors

logger = logging.getLogger(__name__)

LANES = ("dispatch", "warmup")  # priority order: a batch takes dispatch items first


@dataclass(frozen=True)
class InferenceStats:
    """What the engine did, for /v1/stats ``inference`` (durations in milliseconds)."""

    items: int  # texts handed to the engine, failed batches included
    batches: int  # batches handed to the engine, failed ones included
    mean_batch: float
    per_item_ms: float  # engine time of successful batches / their items; 0.0 before any
    p50_batch_ms: float  # over the last ``window`` successful batches
    p99_batch_ms: float
    last_error: str | None
    failed_batches: int


class _Request:
    """One submission: its texts, the rows filled so far and the future its caller awaits."""

    __slots__ = ("filled", "future", "lane", "rows", "taken", "texts")

    def __init__(
        self, texts: list[str], future: asyncio.Future[Vectors], dim: int, lane: str
    ) -> None:
        self.texts = texts
        self.lane = lane
        self.future = future
        self.rows: Vectors = np.empty((len(texts), dim), dtype=np.float32)
        self.taken = 0  # items handed to a batch or dropped; the rest are still queued
        self.filled = 0  # rows written back

    @property
    def waiting(self) -> int:
        return len(self.texts) - self.taken


_Slice = tuple[_Request, int, int]  # request, start, stop


class Batcher:
    """Coalesces ``submit`` calls into batches of ``engine.embed`` on one engine thread.

    Use from one event loop: ``async with Batcher(engine) as batcher: await
    batcher.submit(texts)``. The engine must already be loaded and warmed; the batcher only
    runs it.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch_size: int = 64,
        max_delay_ms: float = 2.0,
        max_queue: int = 100_000,
        window: int = 1024,
    ) -> None:
        if max_batch_size < 1 or max_queue < 1 or window < 1 or max_delay_ms < 0:
            raise ValueError("max_batch_size, max_queue, window >= 1 and max_delay_ms >= 0")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000
        self.max_queue = max_queue
        self._lanes: dict[str, deque[_Request]] = {lane: deque() for lane in LANES}
        self._queued = 0  # items waiting in the lanes (not yet in a batch, not dropped)
        self._lane_waiting = dict.fromkeys(LANES, 0)  # the same, per lane
        self._wakeup = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._in_flight: list[_Request] = []  # requests with a slice in the running batch
        self._prepared: list[_Request] = []  # requests in the batch tokenized ahead
        self._prepared_items = 0
        self._executor: ThreadPoolExecutor | None = None
        self._tokenizer: ThreadPoolExecutor | None = None
        self._closed = False
        self._items = 0
        self._batches = 0
        self._failed_batches = 0
        self._ok_items = 0
        self._engine_ms = 0.0
        self._batch_ms: deque[float] = deque(maxlen=window)
        self._last_error: str | None = None
        self._last_batch_failed = False

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread and the worker task (idempotent)."""
        if self._closed:
            raise EngineError("batcher closed")
        if self._worker is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
            self._tokenizer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
            self._worker = asyncio.create_task(self._run(), name="batcher-worker")

    async def aclose(self) -> None:
        """Fail every queued request, let the batch in flight finish, stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._fail_queued(EngineError("batcher closed"))
        self._wakeup.set()
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
        """Running, and the most recent batch did not fail (a later success restores it)."""
        return self.running and not self._last_batch_failed

    @property
    def queued(self) -> int:
        """Items not yet handed to the engine (queue depth), a batch tokenized ahead included."""
        return self._queued + self._prepared_items

    @property
    def per_item_ms(self) -> float:
        """Mean engine time per text so far; the cache prices an avoided call with it."""
        return self._engine_ms / self._ok_items if self._ok_items else 0.0

    async def submit(self, texts: Sequence[str], lane: str = "dispatch") -> Vectors:
        """The ``(len(texts), dim)`` float32 vectors of ``texts``, in input order.

        Raises ``QueueFullError`` at once (nothing queued) when the queue cannot take all of
        ``texts``, ``EngineError`` when the batch failed or the batcher is closed or not
        started, ``ValueError`` for an unknown lane.
        """
        if lane not in self._lanes:
            raise ValueError(f"unknown lane {lane!r}; lanes: {', '.join(LANES)}")
        if not self.running:
            if self._worker is None:
                raise EngineError("batcher not started")
            raise EngineError("batcher closed" if self._closed else "batcher stopped")
        if not texts:
            return np.empty((0, self.engine.dim), dtype=np.float32)
        if self._queued + len(texts) > self.max_queue:
            raise QueueFullError(
                f"batcher queue full: {self._queued} items waiting, {len(texts)} more "
                f"would exceed max_queue={self.max_queue}"
            )
        future = asyncio.get_running_loop().create_future()
        request = _Request(list(texts), future, self.engine.dim, lane)
        self._lanes[lane].append(request)
        self._queued += len(texts)
        self._lane_waiting[lane] += len(texts)
        self._wakeup.set()
        try:
            return await request.future
        finally:
            self._drop(request)  # cancelled or failed: what is still queued never runs

    def stats(self) -> InferenceStats:
        durations = list(self._batch_ms)  # a snapshot, in case another thread reads stats
        p50, p99 = np.percentile(durations, [50, 99]) if durations else (0.0, 0.0)
        return InferenceStats(
            items=self._items,
            batches=self._batches,
            mean_batch=self._items / self._batches if self._batches else 0.0,
            per_item_ms=self.per_item_ms,
            p50_batch_ms=float(p50),
            p99_batch_ms=float(p99),
            last_error=self._last_error,
            failed_batches=self._failed_batches,
        )

    # -- the worker (event loop) -----------------------------------------------------------

    async def _run(self) -> None:
        forward: asyncio.Task[None] | None = None  # the batch in the engine, if any
        try:
            while not self._closed:
                if forward is not None and forward.done():
                    forward = None
                if forward is None and self._queued:
                    await self._wait_for_more()
                    batch = self._take()
                    if batch:
                        forward = asyncio.create_task(self._run_batch(batch))
                elif forward is not None and self._lane_waiting["dispatch"] >= self.max_batch_size:
                    forward = await self._tokenize_ahead(forward)
                else:  # idle, or the engine is busy and the next batch is not full yet
                    await self._wait_for_wakeup(forward)
        except Exception:  # a bug here must not leave waiters hanging: fail them below
            logger.exception("batcher worker crashed")
        finally:  # closed, crashed or cancelled: nobody is left waiting
            error = EngineError("batcher closed" if self._closed else "batcher stopped")
            self._fail(self._prepared, error)
            self._fail_queued(error)
            if forward is not None:
                await asyncio.wait({forward})  # the batch in flight finishes normally
            self._fail(self._in_flight, error)

    async def _wait_for_wakeup(self, forward: asyncio.Task[None] | None) -> None:
        """Until a submission (or close) arrives, or the batch in flight finishes."""
        self._wakeup.clear()
        if self._queued and forward is None:
            return
        wakeup = asyncio.ensure_future(self._wakeup.wait())
        try:
            await asyncio.wait(
                {wakeup} | ({forward} if forward else set()), return_when="FIRST_COMPLETED"
            )
        finally:
            wakeup.cancel()

    async def _tokenize_ahead(self, forward: asyncio.Task[None]) -> asyncio.Task[None] | None:
        """Take the next (full, dispatch-only) batch, tokenize it while ``forward`` runs,
        then start it as soon as ``forward`` is done. Returns the new batch's task."""
        batch = self._take()
        self._prepared = [request for request, _, _ in batch]
        self._prepared_items = sum(stop - start for _, start, stop in batch)
        texts = self._texts(batch)
        loop = asyncio.get_running_loop()
        try:
            tokens: Batch | None = await loop.run_in_executor(
                self._tokenizer, self.engine.tokenize, texts
            )
        except Exception:  # the engine thread tokenizes again and reports any error
            tokens = None
        await asyncio.wait({forward})
        self._prepared, self._prepared_items = [], 0
        if self._closed:
            self._fail([request for request, _, _ in batch], EngineError("batcher closed"))
            return None
        return asyncio.create_task(self._run_batch(batch, tokens))

    async def _wait_for_more(self) -> None:
        """While the batch is not full, wait up to max_delay for more submissions."""
        deadline = asyncio.get_running_loop().time() + self.max_delay_s
        while self._queued < self.max_batch_size and not self._closed:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                async with asyncio.timeout(remaining):
                    await self._wakeup.wait()
            except TimeoutError:
                return

    def _take(self) -> list[_Slice]:
        """Up to max_batch_size queued items, dispatch lane first, in submission order."""
        room = self.max_batch_size
        batch: list[_Slice] = []
        for lane in LANES:
            queue = self._lanes[lane]
            while room and queue:
                request = queue[0]
                if request.future.done():  # cancelled, or failed in an earlier slice
                    self._drop(request)
                if request.waiting:
                    count = min(room, request.waiting)
                    batch.append((request, request.taken, request.taken + count))
                    request.taken += count
                    self._queued -= count
                    self._lane_waiting[lane] -= count
                    room -= count
                if not request.waiting:
                    queue.popleft()
        return batch

    @staticmethod
    def _texts(batch: list[_Slice]) -> list[str]:
        return [text for request, start, stop in batch for text in request.texts[start:stop]]

    async def _run_batch(self, batch: list[_Slice], tokens: Batch | None = None) -> None:
        live = [item for item in batch if not item[0].future.done()]
        if len(live) < len(batch):  # a caller went away after its batch was tokenized
            batch, tokens = live, None
        if not batch:
            return
        texts = self._texts(batch)
        self._in_flight = [request for request, _, _ in batch]
        self._items += len(texts)
        self._batches += 1
        loop = asyncio.get_running_loop()
        try:
            vectors, elapsed_ms = await loop.run_in_executor(
                self._executor, self._embed, texts, tokens
            )
        except Exception as exc:
            if isinstance(exc, EngineError):
                error = exc
            else:
                error = EngineError(f"engine failed: {exc!r}")
                error.__cause__ = exc
            self._failed_batches += 1
            self._last_batch_failed = True
            self._last_error = f"{type(exc).__name__}: {exc}"
            logger.warning("batch of %d texts failed: %s", len(texts), self._last_error)
            self._fail(self._in_flight, error)
            self._in_flight = []
            return
        self._ok_items += len(texts)
        self._engine_ms += elapsed_ms
        self._batch_ms.append(elapsed_ms)
        self._last_batch_failed = False
        offset = 0
        for request, start, stop in batch:
            if not request.future.done():
                request.rows[start:stop] = vectors[offset : offset + stop - start]
                request.filled += stop - start
                if request.filled == len(request.texts):
                    request.future.set_result(request.rows)
            offset += stop - start
        self._in_flight = []

    def _embed(self, texts: list[str], tokens: Batch | None) -> tuple[Vectors, float]:
        """Runs on the engine thread; tokenizes here unless the batch was tokenized ahead."""
        started = time.perf_counter()
        engine = self.engine
        batch = engine.tokenize(texts) if tokens is None else tokens
        vectors = engine.postprocess(engine.forward(batch), batch)
        elapsed_ms = (time.perf_counter() - started) * 1000
        if vectors.shape != (len(texts), self.engine.dim):
            raise EngineError(f"engine returned shape {vectors.shape} for {len(texts)} texts")
        return vectors, elapsed_ms

    # -- bookkeeping -----------------------------------------------------------------------

    def _drop(self, request: _Request) -> None:
        """Forget the request's items still queued (idempotent)."""
        self._queued -= request.waiting
        self._lane_waiting[request.lane] -= request.waiting
        request.taken = len(request.texts)

    def _fail(self, requests: list[_Request], error: EngineError) -> None:
        for request in requests:
            if not request.future.done():
                request.future.set_exception(error)

    def _fail_queued(self, error: EngineError) -> None:
        for queue in self._lanes.values():
            while queue:
                request = queue.popleft()
                self._drop(request)
                self._fail([request], error)
