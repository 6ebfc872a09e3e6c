"""The batcher, through its public surface, on the fake engine.

No test asserts a wall-clock duration. Where the order of batches matters, the engine holds its
first batch until the test has queued what it needs, so the outcome does not depend on timing.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from cache.flight import SingleFlight
from engines.base import (
    Batch,
    BatchError,
    DeadlineExceededError,
    EngineError,
    QueueFullError,
    Vectors,
)
from engines.batcher import Batcher, deadline_after
from engines.fake import FakeEngine
from engines.tokenization import TokenizedTexts


class RecordingEngine(FakeEngine):
    """Records every batch's texts; with ``hold=True`` the first batch waits for ``release``."""

    def __init__(self, *, hold: bool = False, **options: Any) -> None:
        super().__init__(dim=8, **options)
        self.batches: list[list[str]] = []
        self.entered = threading.Event()
        self._forwarded = threading.Condition()
        self._gate = threading.Event()
        if not hold:
            self._gate.set()

    def release(self) -> None:
        self._gate.set()

    def ran(self, batches: int, timeout: float) -> bool:
        """Block this thread until the engine has started ``batches`` batches."""
        with self._forwarded:
            return self._forwarded.wait_for(lambda: len(self.batches) >= batches, timeout)

    def forward(self, batch: Batch) -> Vectors:
        with self._forwarded:
            self.batches.append(list(batch.data["texts"]))
            self._forwarded.notify_all()
        self.entered.set()
        if not self._gate.wait(timeout=30):
            raise AssertionError("the test never released the engine")
        return super().forward(batch)

    def expected(self, texts: list[str]) -> Vectors:
        return np.stack([self.vector(text) for text in texts])


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(test())


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition`` holds (bounded, no sleeping on a clock)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


async def engine_busy(engine: RecordingEngine) -> None:
    assert await asyncio.to_thread(engine.entered.wait, 30)


def spawn(coro: Coroutine[Any, Any, Vectors]) -> asyncio.Task[Vectors]:
    return asyncio.create_task(coro)


def test_concurrent_submits_coalesce_into_fewer_batches() -> None:
    async def test() -> None:
        engine = RecordingEngine(delay_s=0.02)
        texts = [f"driver {i}" for i in range(40)]
        async with Batcher(engine, max_batch_size=64) as batcher:
            results = await asyncio.gather(*(batcher.submit([text]) for text in texts))
        assert engine.calls < len(texts)
        for text, vectors in zip(texts, results, strict=True):
            np.testing.assert_array_equal(vectors, engine.expected([text]))

    run(test)


def test_results_keep_input_order_and_equal_engine_embed() -> None:
    async def test() -> None:
        engine = RecordingEngine()
        requests = [["b", "a", "c"], ["same", "same"], ["z"], [f"t{i}" for i in range(30)]]
        async with Batcher(engine, max_batch_size=8) as batcher:
            results = await asyncio.gather(*(batcher.submit(texts) for texts in requests))
        reference = FakeEngine(dim=8)
        for texts, vectors in zip(requests, results, strict=True):
            assert vectors.dtype == np.float32
            np.testing.assert_array_equal(vectors, reference.embed(texts))

    run(test)


def test_oversized_submission_is_split_across_batches() -> None:
    async def test() -> None:
        engine = RecordingEngine()
        texts = [f"t{i}" for i in range(10)]
        async with Batcher(engine, max_batch_size=4) as batcher:
            vectors = await batcher.submit(texts)
        assert [len(batch) for batch in engine.batches] == [4, 4, 2]
        assert [text for batch in engine.batches for text in batch] == texts
        np.testing.assert_array_equal(vectors, engine.expected(texts))

    run(test)


def test_dispatch_lane_is_served_before_warmup_lane() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=3) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            warm = spawn(batcher.submit(["w1", "w2"], lane="warmup"))
            d1 = spawn(batcher.submit(["d1"]))
            d2 = spawn(batcher.submit(["d2"], lane="dispatch"))
            await until(lambda: batcher.queued == 4)
            engine.release()
            await asyncio.gather(first, warm, d1, d2)
        assert engine.batches == [["first"], ["d1", "d2", "w1"], ["w2"]]
        np.testing.assert_array_equal(warm.result(), engine.expected(["w1", "w2"]))

    run(test)


def test_engine_error_fails_only_that_batch_and_serving_continues() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True, fail_on="boom")
        async with Batcher(engine, max_batch_size=2) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            bad = spawn(batcher.submit(["ok-1", "boom"]))
            good = spawn(batcher.submit(["ok-2"]))
            await until(lambda: batcher.queued == 3)
            engine.release()
            results = await asyncio.gather(first, bad, good, return_exceptions=True)
            assert engine.batches == [["first"], ["ok-1", "boom"], ["ok-2"]]
            assert isinstance(results[1], EngineError)
            np.testing.assert_array_equal(results[0], engine.expected(["first"]))
            np.testing.assert_array_equal(results[2], engine.expected(["ok-2"]))
            assert batcher.healthy
            stats = batcher.stats()
            assert (stats.batches, stats.failed_batches, stats.items) == (3, 1, 4)
            assert stats.last_error is not None and "boom" in stats.last_error
            assert stats.items == engine.items

    run(test)


class BlamingEngine(RecordingEngine):
    """Raises ``BatchError`` (the engine answers, the batch is to blame) on "boom"."""

    def forward(self, batch: Batch) -> Vectors:
        try:
            return super().forward(batch)
        except EngineError as exc:
            raise BatchError(str(exc)) from exc


def test_a_batch_failed_by_what_it_held_fails_only_the_request_that_held_it() -> None:
    """A batch of three requests, one holding a text the engine refuses: each request runs
    alone after it, only the culprit gets the error, and the batcher stays healthy."""

    async def test() -> None:
        engine = BlamingEngine(hold=True, fail_on="boom")
        async with Batcher(engine, max_batch_size=8) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            before = spawn(batcher.submit(["ok-1", "ok-2"]))
            bad = spawn(batcher.submit(["ok-3", "boom"]))
            after = spawn(batcher.submit(["ok-4"]))
            await until(lambda: batcher.queued == 5)
            engine.release()
            results = await asyncio.gather(first, before, bad, after, return_exceptions=True)
            assert engine.batches == [
                ["first"],
                ["ok-1", "ok-2", "ok-3", "boom", "ok-4"],
                ["ok-1", "ok-2"],
                ["ok-3", "boom"],
                ["ok-4"],
            ]
            assert isinstance(results[2], BatchError) and "boom" in str(results[2])
            np.testing.assert_array_equal(results[1], engine.expected(["ok-1", "ok-2"]))
            np.testing.assert_array_equal(results[3], engine.expected(["ok-4"]))
            assert batcher.healthy
            stats = batcher.stats()
            assert (stats.failed_batches, stats.items) == (2, 6)  # items: texts sent, once

    run(test)


def test_healthy_is_false_only_while_the_last_batch_failed() -> None:
    async def test() -> None:
        engine = RecordingEngine(fail_on="boom")
        batcher = Batcher(engine)
        assert not batcher.healthy  # not started
        async with batcher:
            assert batcher.healthy
            with pytest.raises(EngineError):
                await batcher.submit(["boom"])
            assert not batcher.healthy
            await batcher.submit(["fine"])
            assert batcher.healthy
        assert not batcher.healthy  # closed

    run(test)


class BrokenEngine(RecordingEngine):
    def forward(self, batch: Batch) -> Vectors:
        if "bad" in batch.data["texts"]:
            raise ValueError("tensor shapes do not match")
        return super().forward(batch)


def test_non_engine_errors_are_wrapped_with_their_cause() -> None:
    async def test() -> None:
        engine = BrokenEngine()
        async with Batcher(engine) as batcher:
            with pytest.raises(EngineError, match="tensor shapes") as info:
                await batcher.submit(["bad"])
            assert isinstance(info.value.__cause__, ValueError)
            np.testing.assert_array_equal(await batcher.submit(["good"]), engine.expected(["good"]))

    run(test)


def test_queue_full_raises_at_once_and_queues_nothing() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=8, max_queue=5) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            waiting = spawn(batcher.submit([f"q{i}" for i in range(4)]))
            await until(lambda: batcher.queued == 4)
            with pytest.raises(QueueFullError):
                await batcher.submit(["x", "y"])
            assert batcher.queued == 4
            last = await asyncio.wait_for(_submit_when_released(batcher, engine, ["fits"]), 30)
            await asyncio.gather(first, waiting)
        np.testing.assert_array_equal(last, engine.expected(["fits"]))
        assert all("x" not in batch and "y" not in batch for batch in engine.batches)
        assert batcher.stats().items == engine.items == 6

    run(test)


async def _submit_when_released(
    batcher: Batcher, engine: RecordingEngine, texts: list[str]
) -> Vectors:
    pending = spawn(batcher.submit(texts))  # exactly fills the queue (5 of 5)
    await until(lambda: batcher.queued == 5)
    engine.release()
    return await pending


def test_cancelled_submitter_items_never_reach_the_engine() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            doomed = spawn(batcher.submit(["cancel-me", "me-too"]))
            await until(lambda: batcher.queued == 2)
            doomed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await doomed
            assert batcher.queued == 0
            engine.release()
            await first
            await batcher.submit(["after"])
        assert engine.batches == [["first"], ["after"]]
        assert batcher.stats().items == engine.items == 2

    run(test)


def test_cancelling_a_split_submission_drops_its_remaining_slices() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=2) as batcher:
            big = spawn(batcher.submit([f"t{i}" for i in range(6)]))
            await engine_busy(engine)  # slice t0, t1 is in the engine, t2..t5 queued
            await until(lambda: batcher.queued == 4)
            big.cancel()
            with pytest.raises(asyncio.CancelledError):
                await big
            engine.release()
            np.testing.assert_array_equal(await batcher.submit(["next"]), engine.expected(["next"]))
        assert engine.batches == [["t0", "t1"], ["next"]]

    run(test)


def test_aclose_fails_queued_waiters_and_finishes_the_batch_in_flight() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        batcher = Batcher(engine)
        await batcher.start()
        in_flight = spawn(batcher.submit(["in-flight"]))
        await engine_busy(engine)
        queued = spawn(batcher.submit(["queued"], lane="warmup"))
        await until(lambda: batcher.queued == 1)
        closing = asyncio.ensure_future(batcher.aclose())
        with pytest.raises(EngineError, match="batcher closed"):
            await queued  # failed at once, while the engine is still busy
        engine.release()
        await closing
        np.testing.assert_array_equal(await in_flight, engine.expected(["in-flight"]))
        with pytest.raises(EngineError, match="closed"):
            await batcher.submit(["late"])
        await batcher.aclose()  # idempotent
        assert engine.batches == [["in-flight"]]

    run(test)


def test_submit_checks_state_lane_and_empty_input() -> None:
    async def test() -> None:
        batcher = Batcher(FakeEngine(dim=8))
        with pytest.raises(EngineError, match="not started"):
            await batcher.submit(["x"])
        async with batcher:
            with pytest.raises(ValueError, match="lane"):
                await batcher.submit(["x"], lane="bulk")
            empty = await batcher.submit([])
            assert empty.shape == (0, 8)
            assert empty.dtype == np.float32
        with pytest.raises(EngineError, match="closed"):
            await batcher.start()

    run(test)


def test_stats_count_exactly_what_reached_the_engine() -> None:
    async def test() -> None:
        engine = RecordingEngine()
        async with Batcher(engine, max_batch_size=4) as batcher:
            before = batcher.stats()
            assert (before.items, before.batches, before.mean_batch, before.per_item_ms) == (
                0,
                0,
                0.0,
                0.0,
            )
            assert (before.p50_batch_ms, before.p99_batch_ms, before.last_error) == (0.0, 0.0, None)
            await asyncio.gather(*(batcher.submit([f"t{i}", f"u{i}", f"v{i}"]) for i in range(7)))
            stats = batcher.stats()
        assert stats.items == engine.items == 21
        assert stats.batches == engine.calls
        assert stats.mean_batch == pytest.approx(21 / engine.calls)
        assert stats.per_item_ms == batcher.per_item_ms >= 0.0
        assert 0.0 <= stats.p50_batch_ms <= stats.p99_batch_ms
        assert stats.last_error is None
        assert all(len(batch) <= 4 for batch in engine.batches)

    run(test)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("known, budget", [(False, None), (True, 40), (True, 100)])
def test_random_mix_of_lanes_sizes_failures_and_cancellations_resolves_everything(
    known: bool, budget: int | None
) -> None:
    """Without a token budget, and with one and lengths known when queued (batches formed
    within it: each one forward, so the engine counts what the batcher took; at 100 most
    warm-up batches are of the shortest texts waiting, at 40 few fit)."""

    async def test() -> None:
        rng = random.Random(7)
        engine = budget_engine(known, fail_on="boom")
        outcomes: dict[str, int] = {"ok": 0, "error": 0, "cancelled": 0}

        async def client(i: int) -> None:
            texts = [f"c{i}-{j}" + " x" * rng.randint(0, 7) for j in range(rng.randint(1, 40))]
            if rng.random() < 0.1:
                texts[rng.randrange(len(texts))] = "boom"
            task = spawn(batcher.submit(texts, lane=rng.choice(["dispatch", "warmup"])))
            if rng.random() < 0.2:
                await asyncio.sleep(0)
                task.cancel()
            try:
                vectors = await task
            except asyncio.CancelledError:
                outcomes["cancelled"] += 1
            except EngineError:
                outcomes["error"] += 1
            else:
                np.testing.assert_array_equal(vectors, engine.expected(texts))
                outcomes["ok"] += 1

        async with Batcher(
            engine, max_batch_size=16, max_delay_ms=0.5, max_batch_tokens=budget
        ) as batcher:
            await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(200))), 60)
            assert batcher.queued == 0
            assert batcher.stats().items == engine.items
        assert sum(outcomes.values()) == 200
        assert outcomes["ok"] > 0 and outcomes["error"] > 0 and outcomes["cancelled"] > 0
        if budget is not None:
            assert all(batch_cost(batch) <= budget for batch in engine.batches)

    run(test)


class ThreadRecordingEngine(RecordingEngine):
    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.tokenized_on: list[str] = []

    def tokenize(self, texts: Any) -> Batch:
        self.tokenized_on.append(threading.current_thread().name)
        return super().tokenize(texts)


class KnownLengthsEngine(ThreadRecordingEngine):
    """Says each text's padded length (its words, at least one) before tokenizing, as an
    engine does for texts that come with its token ids."""

    def padded_lengths(self, texts: Sequence[str]) -> npt.NDArray[np.int64]:
        return np.array([max(len(text.split()), 1) for text in texts], dtype=np.int64)


def budget_engine(known: bool, **options: Any) -> ThreadRecordingEngine:
    """Lengths known when texts are queued (the batcher forms batches within the budget)
    or only once tokenized (its engine thread cuts a batch over it into groups)."""
    return KnownLengthsEngine(**options) if known else ThreadRecordingEngine(**options)


def test_full_dispatch_batch_is_tokenized_ahead_while_the_engine_is_busy() -> None:
    async def test() -> None:
        engine = ThreadRecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=4) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            full = spawn(batcher.submit([f"d{i}" for i in range(4)]))
            await until(lambda: len(engine.tokenized_on) == 2)  # tokenized before release
            assert batcher.queued == 4  # still waiting for the engine
            engine.release()
            results = await asyncio.gather(first, full)
        assert engine.tokenized_on[0].startswith("engine")
        assert engine.tokenized_on[1].startswith("tokenizer")
        assert engine.batches == [["first"], ["d0", "d1", "d2", "d3"]]
        np.testing.assert_array_equal(results[1], engine.expected([f"d{i}" for i in range(4)]))

    run(test)


def test_full_warmup_batch_is_tokenized_ahead_and_dispatch_waits_one_forward_at_most() -> None:
    async def test() -> None:
        engine = ThreadRecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=4) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            warm = spawn(batcher.submit([f"w{i}" for i in range(8)], lane="warmup"))
            await until(lambda: len(engine.tokenized_on) == 2)  # w0..w3 tokenized ahead
            late = spawn(batcher.submit(["late"]))  # dispatch, after that batch was formed
            await until(lambda: batcher.queued == 9)  # 4 tokenized ahead + 5 queued
            engine.release()
            results = await asyncio.gather(first, warm, late)
        assert engine.tokenized_on[1].startswith("tokenizer")
        # the dispatch item runs right after the batch formed early, ahead of w4..w7
        assert engine.batches == [
            ["first"],
            ["w0", "w1", "w2", "w3"],
            ["late", "w4", "w5", "w6"],
            ["w7"],
        ]
        np.testing.assert_array_equal(results[1], engine.expected([f"w{i}" for i in range(8)]))

    run(test)


class GatedTokenizerEngine(ThreadRecordingEngine):
    """The tokenizer thread's ``tokenize`` waits for ``tokenized`` to be released."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.tokenizing = threading.Event()
        self.tokenized = threading.Event()

    def tokenize(self, texts: Any) -> Batch:
        if threading.current_thread().name.startswith("tokenizer"):
            self.tokenizing.set()
            if not self.tokenized.wait(timeout=30):
                raise AssertionError("the test never released the tokenizer")
        return super().tokenize(texts)


async def dropped(doomed: asyncio.Task[Vectors], drop: str) -> None:
    """``doomed`` goes away (``cancelled``) or its deadline passes (``expired``, set by the
    caller): either way it fails, and accordingly."""
    if drop == "cancelled":
        doomed.cancel()
    with pytest.raises(asyncio.CancelledError if drop == "cancelled" else DeadlineExceededError):
        await doomed


@pytest.mark.parametrize("drop", ["cancelled", "expired"])
def test_request_dropped_while_its_batch_is_tokenized_never_reaches_the_engine(drop: str) -> None:
    async def test() -> None:
        engine = GatedTokenizerEngine(hold=True)
        async with Batcher(engine, max_batch_size=2) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            deadline = deadline_after(300) if drop == "expired" else None
            doomed = spawn(batcher.submit(["doomed"], deadline=deadline))
            kept = spawn(batcher.submit(["kept"]))
            assert await asyncio.to_thread(engine.tokenizing.wait, 30)  # both taken ahead
            await dropped(doomed, drop)
            engine.tokenized.set()
            engine.release()
            np.testing.assert_array_equal(await kept, engine.expected(["kept"]))
            await first
            assert batcher.stats().items == 2
        assert engine.batches == [["first"], ["kept"]]

    run(test)


@pytest.mark.parametrize("drop", ["cancelled", "expired"])
def test_a_batch_handed_over_runs_next_without_a_turn_of_the_event_loop(drop: str) -> None:
    """The next full batch waits on the engine thread: while the event loop is blocked (as a
    loaded engine process's is, for milliseconds at a time), the engine goes on to it. A
    request that goes away or expires before the engine starts on it is still never run."""

    async def test() -> None:
        engine = ThreadRecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=2) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            # long enough to be handed over first even on a loaded machine
            deadline = deadline_after(300) if drop == "expired" else None
            doomed = spawn(batcher.submit(["a"], deadline=deadline))
            kept = spawn(batcher.submit(["b"]))
            await until(lambda: batcher.waiting_engine == 2)  # tokenized and handed over
            assert batcher.stats().items == 1  # counted when the engine starts on them
            await dropped(doomed, drop)  # an expiry fails it at its deadline, not after "first"
            engine.entered.clear()
            engine.release()
            # Block this loop: only the engine thread can start the second batch now.
            assert engine.entered.wait(timeout=10), "the engine waited for the event loop"
            np.testing.assert_array_equal(await kept, engine.expected(["b"]))
            await first
            stats = batcher.stats()
            assert stats.items == stats.ok_items == 2
            assert stats.expired_items == (1 if drop == "expired" else 0)
            assert batcher.queued == 0
        assert engine.batches == [["first"], ["b"]]

    run(test)


def test_two_full_batches_wait_on_the_engine_thread_and_run_with_the_loop_blocked() -> None:
    """Up to two batches are tokenized ahead and handed over: the engine thread goes through
    both while the event loop is blocked, the tokenizer thread having handed them on itself."""

    async def test() -> None:
        engine = ThreadRecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=2) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            rest = [spawn(batcher.submit([text])) for text in "abcde"]
            await until(lambda: len(engine.tokenized_on) == 3)  # a,b and c,d; e is not full
            assert batcher.waiting_engine == 4 and batcher.queued == 5
            engine.release()
            assert engine.ran(3, timeout=10), "the engine waited for the event loop"
            assert engine.batches == [["first"], ["a", "b"], ["c", "d"]]
            results = await asyncio.gather(first, *rest)
        assert engine.tokenized_on[1:3] == ["tokenizer_0", "tokenizer_0"]
        assert engine.batches[3:] == [["e"]]
        for text, vectors in zip("abcde", results[1:], strict=True):
            np.testing.assert_array_equal(vectors, engine.expected([text]))

    run(test)


class TurnsAfter:
    """The event loop's turns from the one after it is made: a callback that queues itself
    again runs once a turn, after the callbacks already queued for that turn."""

    def __init__(self) -> None:
        self.count = 0
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.count += 1
        self._loop.call_soon(self._tick)


async def outcome_turns(
    engine: ThreadRecordingEngine, batcher: Batcher, waiter: Callable[[str], Awaitable[None]]
) -> int:
    """In how many turns of the loop ``waiter("first")`` resumes after its batch's outcome
    reached the loop (queued to it while the loop was blocked: no timing in the count)."""
    turns: list[TurnsAfter] = []

    async def first() -> int:
        await waiter("first")
        return turns[0].count

    task = asyncio.create_task(first())
    await engine_busy(engine)
    second = spawn(batcher.submit(["second"]))  # behind it: its start proves "first" reported
    await until(lambda: len(engine.tokenized_on) == 2)

    def block() -> None:
        engine.release()
        assert engine.ran(2, timeout=10), "the engine thread never went on to the next batch"
        turns.append(TurnsAfter())

    asyncio.get_running_loop().call_soon(block)
    count = await task
    await second
    return count


def test_a_submitter_resumes_in_the_turn_after_its_batch_s_outcome_arrives() -> None:
    """Under 8 workers' load a turn of the engine process's loop lasts milliseconds (H200,
    docs/BENCHMARKS.md), so every turn between a forward's end and its waiter is latency:
    the outcome's one callback resolves the submitter, which runs in the next turn (a
    wrapped future and a task in between took two more)."""

    async def test() -> None:
        engine = ThreadRecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=1) as batcher:

            async def submit(text: str) -> None:
                await batcher.submit([text])

            assert await outcome_turns(engine, batcher, submit) == 1

    run(test)


def test_a_miss_s_caller_resumes_two_turns_after_its_batch_s_outcome_arrives() -> None:
    """The same through the in-flight map, a miss's path in the engine process: the outcome
    resolves the flight's compute, whose task resolves each caller's own future (through
    ``asyncio.wait`` on the flight's shared future the caller took two turns more)."""

    async def test() -> None:
        engine = ThreadRecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=1) as batcher:

            async def compute(texts: Sequence[str], lane: str) -> Vectors:
                return await batcher.submit(texts, lane)

            flight = SingleFlight(compute, engine.dim)

            async def embed(text: str) -> None:
                await flight.embed([text], lane="dispatch", caller="dispatch")

            assert await outcome_turns(engine, batcher, embed) == 2

    run(test)


def test_the_next_batch_is_handed_over_before_the_last_one_s_submitters_resume() -> None:
    """The engine thread finishes batch A and starts B while the event loop is busy: the
    loop hands C to the tokenizer thread as it learns B started, before A's submitters (in
    the engine process: their write-backs and answers) take their turns."""

    async def test() -> None:
        engine = ThreadRecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=2) as batcher:
            seen: list[int] = []

            async def first() -> None:
                await batcher.submit(["first"])
                seen.append(batcher.stats().batches)  # handed over when "first" resumes

            task = asyncio.create_task(first())
            await engine_busy(engine)
            warm = spawn(batcher.submit(["w0", "w1", "w2", "w3"], lane="warmup"))
            await until(lambda: len(engine.tokenized_on) == 2)  # B = w0, w1 formed ahead
            assert batcher.stats().batches == 2  # C = w2, w3 waits: one warm-up batch ahead

            def block() -> None:  # A's outcome and B's start reach the loop in one turn
                engine.release()
                assert engine.ran(2, timeout=10), "the engine never started on B"

            asyncio.get_running_loop().call_soon(block)
            await task
            await warm
        assert seen == [3]
        assert engine.batches == [["first"], ["w0", "w1"], ["w2", "w3"]]

    run(test)


# -- per-item deadlines ------------------------------------------------------------------------


def test_expired_items_fail_at_their_deadline_and_never_reach_the_engine() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            doomed = spawn(batcher.submit(["late-1", "late-2"], deadline=deadline_after(20)))
            kept = spawn(batcher.submit(["kept"], deadline=deadline_after(60_000)))
            with pytest.raises(DeadlineExceededError, match="2 of 2 texts"):
                await doomed  # failed while the engine is still busy with "first"
            assert batcher.queued == 1
            engine.release()
            np.testing.assert_array_equal(await kept, engine.expected(["kept"]))
            await first
            assert batcher.stats().expired_items == 2
        assert engine.batches == [["first"], ["kept"]]
        assert engine.items == batcher.stats().items == 2

    run(test)


def test_deadline_already_passed_fails_at_once_and_queues_nothing() -> None:
    async def test() -> None:
        engine = RecordingEngine()
        async with Batcher(engine) as batcher:
            with pytest.raises(DeadlineExceededError):
                await batcher.submit(["x"], deadline=time.monotonic() - 1)
            assert batcher.queued == 0
            await batcher.submit(["y"], deadline=None)  # None: no deadline
        assert engine.batches == [["y"]]

    run(test)


def test_expired_split_submission_drops_its_queued_slices() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=4) as batcher:
            big = spawn(batcher.submit([f"t{i}" for i in range(6)], deadline=deadline_after(300)))
            await engine_busy(engine)  # t0..t3 are in the engine, t4, t5 queued
            with pytest.raises(DeadlineExceededError, match="2 of 6 texts"):
                await big
            assert batcher.queued == 0
            engine.release()
            np.testing.assert_array_equal(await batcher.submit(["next"]), engine.expected(["next"]))
        assert engine.batches == [["t0", "t1", "t2", "t3"], ["next"]]

    run(test)


def test_items_already_in_the_engine_finish_after_their_deadline() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine) as batcher:
            # long enough for a loaded box to reach the engine (10 ms failed in a CI run)
            deadline = deadline_after(500)
            inside = spawn(batcher.submit(["inside"], deadline=deadline))
            await engine_busy(engine)
            assert deadline is not None
            await asyncio.sleep(deadline - time.monotonic() + 0.01)
            assert time.monotonic() > deadline
            engine.release()
            np.testing.assert_array_equal(await inside, engine.expected(["inside"]))
            assert batcher.stats().expired_items == 0

    run(test)


def test_lane_priority_and_queue_limit_hold_with_deadlines() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        async with Batcher(engine, max_batch_size=3, max_queue=4) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            warm = spawn(
                batcher.submit(["w1", "w2"], lane="warmup", deadline=deadline_after(60_000))
            )
            d1 = spawn(batcher.submit(["d1", "d2"], deadline=deadline_after(60_000)))
            await until(lambda: batcher.queued == 4)
            with pytest.raises(QueueFullError):
                await batcher.submit(["over"], deadline=deadline_after(60_000))
            engine.release()
            await asyncio.gather(first, warm, d1)
        assert engine.batches == [["first"], ["d1", "d2", "w1"], ["w2"]]

    run(test)


# -- token budget ------------------------------------------------------------------------------


def batch_cost(texts: list[str]) -> int:
    """What the fake engine's batch costs: size x the longest text in words (at least 1)."""
    return len(texts) * max(max(len(text.split()), 1) for text in texts)


def test_warmup_batches_take_the_shortest_texts_waiting_and_answer_in_submission_order() -> None:
    """A forward costs its size x its longest text: warm-up texts of like length go together
    (across requests), and each request still gets its rows in the order it sent them."""

    async def test() -> None:
        engine = KnownLengthsEngine(hold=True)
        async with Batcher(engine, max_batch_size=4, max_batch_tokens=1000) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            a = ["a0 x x x", "a1", "a2 x x x", "a3"]
            b = ["b0", "b1 x x x", "b2", "b3 x x x"]
            warm = [spawn(batcher.submit(texts, lane="warmup")) for texts in (a, b)]
            engine.release()
            await first
            rows = await asyncio.gather(*warm)
        assert engine.batches == [
            ["first"],
            ["a1", "a3", "b0", "b2"],
            ["a0 x x x", "a2 x x x", "b1 x x x", "b3 x x x"],
        ]  # in submission order: 4 x 4 + 4 x 4 padded tokens, here 4 x 1 + 4 x 4
        np.testing.assert_array_equal(rows[0], engine.expected(a))
        np.testing.assert_array_equal(rows[1], engine.expected(b))

    run(test)


def test_the_oldest_warmup_request_waits_for_shorter_texts_a_few_batches_at_most() -> None:
    async def test() -> None:
        engine = KnownLengthsEngine(hold=True)
        async with Batcher(engine, max_batch_size=2, max_batch_tokens=1000) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            texts = ["old x x x", *(f"s{i}" for i in range(12))]
            warm = [spawn(batcher.submit([text], lane="warmup")) for text in texts]
            engine.release()
            await first
            rows = await asyncio.gather(*warm)
        # passed over four times (PASSES), then first, in submission order
        assert engine.batches == [
            ["first"],
            ["s0", "s1"],
            ["s2", "s3"],
            ["s4", "s5"],
            ["s6", "s7"],
            ["old x x x", "s8"],
            ["s9", "s10"],
            ["s11"],
        ]
        for text, row in zip(texts, rows, strict=True):
            np.testing.assert_array_equal(row, engine.expected([text]))

    run(test)


def test_warmup_texts_sorted_by_length_keep_their_token_ids() -> None:
    class IdsEngine(KnownLengthsEngine):
        def __init__(self) -> None:
            super().__init__()
            self.ids: dict[str, list[int]] = {}

        def tokenize(self, texts: Any) -> Batch:
            assert isinstance(texts, TokenizedTexts)
            flat, counts = texts.ids()
            for text, ids in zip(texts, np.split(flat, np.cumsum(counts)[:-1]), strict=True):
                self.ids[text] = ids.tolist()
            return super().tokenize(texts)

    async def test() -> None:
        engine = IdsEngine()
        texts = ["a x x", "b", "c x", "d", "e x x x", "f"]
        ids = [[i] * len(text.split()) for i, text in enumerate(texts)]
        async with Batcher(engine, max_batch_size=2, max_batch_tokens=1000) as batcher:
            rows = await batcher.submit(TokenizedTexts.of(texts, ids), lane="warmup")
        assert engine.ids == dict(zip(texts, ids, strict=True))
        assert engine.batches[0] == ["b", "d"]  # sorted: the shortest first
        np.testing.assert_array_equal(rows, engine.expected(texts))

    run(test)


def test_the_warmup_lane_forgets_requests_taken_whole_from_its_middle() -> None:
    """Requests that ``_take_shortest`` took whole behind a request still waiting leave the
    lane once it is done (they kept their texts and rows for the whole job)."""

    async def test() -> None:
        engine = KnownLengthsEngine()
        async with Batcher(
            engine, max_batch_size=4, max_batch_tokens=1000, max_delay_ms=0
        ) as batcher:
            largest = 0

            async def client(i: int) -> None:
                nonlocal largest
                for j in range(50):
                    await batcher.submit([f"t{i}-{j}"], lane="warmup")
                    largest = max(largest, len(batcher._lanes["warmup"]))

            await asyncio.gather(*(client(i) for i in range(16)))
        assert largest <= 16 + 4  # the live requests, and a window's worth done

    run(test)


def test_close_finishes_warmup_requests_taken_whole_and_fails_those_queued() -> None:
    async def test() -> None:
        engine = KnownLengthsEngine(hold=True)
        batcher = Batcher(engine, max_batch_size=2, max_batch_tokens=1000)
        await batcher.start()
        first = spawn(batcher.submit(["first"]))
        await engine_busy(engine)
        old = spawn(batcher.submit(["old x x x"], lane="warmup"))
        short = [spawn(batcher.submit([f"s{i}"], lane="warmup")) for i in range(3)]
        await until(lambda: len(engine.tokenized_on) == 2)  # [s0, s1] formed ahead
        closing = asyncio.ensure_future(batcher.aclose())
        await asyncio.sleep(0)
        engine.release()
        await closing
        await first
        for task, text in zip(short[:2], ["s0", "s1"], strict=True):
            np.testing.assert_array_equal(await task, engine.expected([text]))
        for task in (old, short[2]):
            with pytest.raises(EngineError, match="batcher closed"):
                await task
        assert engine.batches == [["first"], ["s0", "s1"]]

    run(test)


@pytest.mark.parametrize("known", [False, True])
def test_no_forward_exceeds_the_token_budget_and_a_long_text_goes_alone(known: bool) -> None:
    async def test() -> None:
        engine = budget_engine(known)
        long = " ".join(f"w{i}" for i in range(20))
        texts = ["a b c", "d e f", "g h i", "j k l", "m n o", long, "p q"]
        async with Batcher(engine, max_batch_size=16, max_batch_tokens=12) as batcher:
            vectors = await batcher.submit(texts)
            stats = batcher.stats()
        assert engine.batches == [["a b c", "d e f", "g h i", "j k l"], ["m n o"], [long], ["p q"]]
        assert all(batch_cost(batch) <= 12 for batch in engine.batches if batch != [long])
        np.testing.assert_array_equal(vectors, engine.expected(texts))
        assert stats.batches == engine.calls == 4
        assert stats.items == engine.items == len(texts)
        # known: each batch tokenized once; else the whole, then each group again
        assert len(engine.tokenized_on) == (4 if known else 5)

    run(test)


@pytest.mark.parametrize("known", [False, True])
def test_concurrent_submissions_respect_the_token_budget(known: bool) -> None:
    async def test() -> None:
        rng = random.Random(5)
        engine = budget_engine(known)
        requests = [  # some larger than a batch: their slices go to several
            [" ".join(["x"] * rng.randint(1, 9)) + f" r{i}-{j}" for j in range(size)]
            for i, size in enumerate(rng.choice([1, 2, 3, 6, 20]) for _ in range(60))
        ]
        async with Batcher(engine, max_batch_size=16, max_batch_tokens=40) as batcher:
            results = await asyncio.gather(*(batcher.submit(texts) for texts in requests))
            stats = batcher.stats()
        assert all(batch_cost(batch) <= 40 for batch in engine.batches)
        assert max(len(batch) for batch in engine.batches) > 4  # batches still fill up
        assert engine.calls == stats.batches
        if known:
            assert len(engine.tokenized_on) == engine.calls  # each batch tokenized once
        for texts, vectors in zip(requests, results, strict=True):
            np.testing.assert_array_equal(vectors, engine.expected(texts))

    run(test)


@pytest.mark.parametrize("known", [False, True])
def test_a_batch_tokenized_ahead_respects_the_token_budget(known: bool) -> None:
    """Known lengths: the batch formed ahead of the forward before it is within the budget,
    tokenized there once, what a device child receives at once; else the whole batch is
    tokenized ahead and its engine thread cuts it (each group sent to a device child only
    when its forward begins)."""

    async def test() -> None:
        engine = budget_engine(known, hold=True)
        async with Batcher(engine, max_batch_size=4, max_batch_tokens=6) as batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            texts = ["a b c", "d e f", "g h i", "j k l"]  # 4 x 3 = 12 tokens: over the budget
            full = spawn(batcher.submit(texts))
            await until(lambda: len(engine.tokenized_on) == 2)  # tokenized ahead
            assert batcher.waiting_engine == (2 if known else 4) and batcher.queued == 4
            engine.release()
            np.testing.assert_array_equal(await full, engine.expected(texts))
            await first
        assert engine.tokenized_on[1].startswith("tokenizer")
        assert len(engine.tokenized_on) == (3 if known else 4)
        assert engine.batches == [["first"], ["a b c", "d e f"], ["g h i", "j k l"]]

    run(test)


# -- queue wait --------------------------------------------------------------------------------


def test_queue_wait_is_observed_per_lane_from_submit_to_engine() -> None:
    async def test() -> None:
        engine = RecordingEngine(hold=True)
        seen: list[tuple[str, float]] = []
        batcher = Batcher(engine, on_queue_wait=lambda lane, s: seen.append((lane, s)))
        async with batcher:
            first = spawn(batcher.submit(["first"]))
            await engine_busy(engine)
            warm = spawn(batcher.submit(["w"], lane="warmup"))
            await until(lambda: batcher.queued == 1)
            held = time.monotonic()
            await asyncio.sleep(0.05)  # "w" waits at least this long behind the held engine
            engine.release()
            await asyncio.gather(first, warm)
            held_s = time.monotonic() - held
            stats = batcher.stats()
        assert [lane for lane, _ in seen] == ["dispatch", "warmup"]
        assert seen[1][1] >= 0.05
        assert 0.0 <= seen[0][1] < held_s <= seen[1][1] + held_s
        assert stats.queue_wait_p99_ms >= 50.0

    run(test)
