"""A worker's ``RemoteEngine``: the ``embed`` calls its requests make in one turn of its loop
reach the engine process as one call, and each caller gets exactly what a call of its own
would have given it: its rows, a text it shares with another caller computed once (the later
one coalesced), and the call's error if it fails."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.base import BatchError, QueueFullError
from engines.fake import FakeEngine
from proxy.board import Board
from proxy.engine_host import MERGED_TEXTS, RemoteEngine, engine_handlers, open_engine_host
from proxy.ipc import _decode, _encode
from proxy.settings import Settings

Handler = Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], list[bytes]]]]


class Loopback:
    """The ``RpcClient`` of a ``RemoteEngine``: each call's message through msgpack to
    ``handler`` and its answer back, as over the socket; the calls kept."""

    up = True

    def __init__(self, handler: Handler) -> None:
        self.facts: dict[str, Any] = {}  # no tokenizer: the texts go as they are
        self.handler = handler
        self.calls: list[dict[str, Any]] = []

    async def call(
        self, op: str, blobs: Sequence[Any] = (), *, timeout_s: float | None = None, **args: Any
    ) -> tuple[dict[str, Any], list[bytes]]:
        message = _decode(_encode({"op": op, **args}))
        self.calls.append(message)
        reply, frames = await self.handler(message)
        return _decode(_encode(reply)), frames


def fake_rows(dim: int) -> Handler:
    """An engine that answers each text's fake vector, none coalesced."""
    engine = FakeEngine(dim=dim)

    async def handler(message: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
        texts = message["texts"]
        rows = np.stack([engine.vector(t) for t in texts]) if texts else np.empty((0, dim))
        return {"coalesced": bytes(len(texts))}, [rows.astype("<f4").tobytes()]

    return handler


def remote(handler: Handler, merged_texts: int = MERGED_TEXTS) -> tuple[RemoteEngine, Loopback]:
    client = Loopback(handler)
    return RemoteEngine(client, FakeEngine().info, None, merged_texts), client  # type: ignore[arg-type]


async def embed(engine: RemoteEngine, texts: list[str], **options: Any) -> Any:
    options = {"lane": "dispatch", "caller": "dispatch", "ttl_s": {}} | options
    return await engine.embed(texts, **options)


def test_calls_of_one_turn_go_as_one_and_a_shared_text_is_computed_once(
    tmp_path: Path,
) -> None:
    """Through the engine process's real handler: three callers, one engine call; the text
    two of them share is one miss and one coalesced, as if they had called apart."""
    settings = Settings(
        engine="fake", device="cpu", data_dir=tmp_path, store="memory", gpu_health_interval_s=0
    )

    async def scenario() -> None:
        async with open_engine_host(settings, Board("engine")) as host:
            handlers = engine_handlers(host, None)  # type: ignore[arg-type]
            engine, client = remote(lambda message: handlers["embed"](message, []))  # type: ignore[arg-type,return-value]
            a, b, c = await asyncio.gather(
                embed(engine, ["north van", "south truck"]),
                embed(engine, ["south truck", "east bike"]),
                embed(engine, ["west car"]),
            )
            assert [m["texts"] for m in client.calls] == [
                ["north van", "south truck", "south truck", "east bike", "west car"]
            ]
            assert (a.coalesced, b.coalesced, c.coalesced) == (
                [False, False],
                [True, False],
                [False],
            )
            fake = FakeEngine()
            for flown, texts in (
                (a, ["north van", "south truck"]),
                (b, ["south truck", "east bike"]),
                (c, ["west car"]),
            ):
                np.testing.assert_array_equal(flown.rows, np.stack([fake.vector(t) for t in texts]))
            inference = host.batcher.stats()
            assert inference.items == 4  # each distinct text computed once

    asyncio.run(scenario())


def test_a_merged_call_carries_every_caller_s_links_ttls_keys_and_since() -> None:
    async def scenario() -> None:
        engine, client = remote(fake_rows(FakeEngine().dim))
        link_a, link_b = ("driver", "d1", "a"), ("driver", "d2", "hit text")
        await asyncio.gather(
            embed(engine, ["a"], ttl_s={"a": 60.0}, since=10.0, links=[link_a], keys=["k:a"]),
            embed(
                engine,
                ["b", "a"],
                ttl_s={"a": 5.0},
                since=12.5,
                links=[link_b],
                keys=["k:b", "k:a"],
            ),
        )
        [call] = client.calls
        assert call["ttl"] == {"a": 60.0}  # the first caller's ttl
        assert call["since"] == [[1, 10.0], [2, 12.5]]  # each caller's, for its texts
        assert call["links"] == [list(link_a), list(link_b)]
        assert call["keys"] == ["k:a", "k:b", "k:a"]
        client.calls.clear()
        # a caller that gives no ``since`` joins nothing written before; the other still may
        await asyncio.gather(embed(engine, ["c"], since=3.0), embed(engine, ["d"], since=None))
        assert client.calls[0]["since"] == [[1, 3.0], [1, None]]

    asyncio.run(scenario())


def test_lanes_callers_durability_and_keys_go_apart_and_calls_stop_at_merged_texts() -> None:
    async def scenario() -> None:
        engine, client = remote(fake_rows(FakeEngine().dim))
        await asyncio.gather(
            embed(engine, ["d1"]),
            embed(engine, ["w1"], lane="warmup", caller="warmup"),
            embed(engine, ["d2"], durable=False),
            embed(engine, ["d3"], keys=["k:d3"]),
            embed(engine, ["d4"]),
        )
        assert sorted(m["texts"] for m in client.calls) == [["d1", "d4"], ["d2"], ["d3"], ["w1"]]
        client.calls.clear()
        size = MERGED_TEXTS // 2 + 1
        await asyncio.gather(*(embed(engine, [f"t{i}-{j}" for j in range(size)]) for i in range(3)))
        assert [len(m["texts"]) for m in client.calls] == [size, size, size]
        # an engine whose queue holds 10 texts: merged calls stay within it, a larger one alone
        small, client = remote(fake_rows(FakeEngine().dim), merged_texts=10)
        sizes = [4, 4, 4, 12]
        await asyncio.gather(
            *(embed(small, [f"q{i}-{j}" for j in range(n)]) for i, n in enumerate(sizes))
        )
        assert [len(m["texts"]) for m in client.calls] == [8, 4, 12]

    asyncio.run(scenario())


def test_a_caller_that_goes_away_leaves_the_others_their_rows() -> None:
    async def scenario() -> None:
        sent, release = asyncio.Event(), asyncio.Event()
        rows = fake_rows(FakeEngine().dim)

        async def slow(message: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
            sent.set()
            await release.wait()
            return await rows(message)

        engine, client = remote(slow)
        leaving = asyncio.create_task(embed(engine, ["a"]))
        staying = asyncio.create_task(embed(engine, ["b"]))
        await sent.wait()
        leaving.cancel()
        release.set()
        flown = await staying
        np.testing.assert_array_equal(flown.rows, FakeEngine().vector("b")[None, :])
        assert leaving.cancelled() and len(client.calls) == 1

    asyncio.run(scenario())


def test_the_engine_s_error_reaches_every_caller_of_the_merged_call() -> None:
    async def scenario() -> list[Any]:
        async def full(message: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
            raise QueueFullError("batcher queue full")

        engine, _ = remote(full)
        return await asyncio.gather(
            embed(engine, ["a"]), embed(engine, ["b"]), return_exceptions=True
        )

    outcomes = asyncio.run(scenario())
    assert [type(o) for o in outcomes] == [QueueFullError, QueueFullError]


def test_a_merged_call_failed_by_what_it_held_fails_only_the_caller_that_held_it() -> None:
    """The batcher runs each request of a batch failed by its contents alone; a merged call is
    one request there, so the worker sends each caller's part alone again, with its own
    arguments, and only the part that holds the culprit fails."""

    async def scenario() -> None:
        rows = fake_rows(FakeEngine().dim)

        async def poisoned(message: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
            if any("POISON" in text for text in message["texts"]):
                raise BatchError("this batch failed: fake engine asked to fail on 'POISON'")
            return await rows(message)

        engine, client = remote(poisoned)
        outcomes = await asyncio.gather(
            embed(engine, ["a", "b"], since=1.0, ttl_s={"a": 9.0}),
            embed(engine, ["POISON c"], since=2.0),
            embed(engine, ["d"], since=3.0, links=[("driver", "d9", "d")]),
            return_exceptions=True,
        )
        good = [o for o in outcomes if not isinstance(o, BaseException)]
        assert isinstance(outcomes[1], BatchError) and len(good) == 2
        fake = FakeEngine()
        np.testing.assert_array_equal(good[0].rows, np.stack([fake.vector(t) for t in "ab"]))
        np.testing.assert_array_equal(good[1].rows, fake.vector("d")[None, :])
        merged, *alone = client.calls
        assert merged["texts"] == ["a", "b", "POISON c", "d"]
        by_texts = {tuple(m["texts"]): m for m in alone}
        assert sorted(by_texts) == [("POISON c",), ("a", "b"), ("d",)]
        assert by_texts[("a", "b")]["since"] == 1.0 and by_texts[("a", "b")]["ttl"] == {"a": 9.0}
        assert by_texts[("d",)]["links"] == [["driver", "d9", "d"]]

    asyncio.run(scenario())


@pytest.mark.parametrize("texts", [[], ["only"]])
def test_a_lone_call_is_sent_as_it_is_on_the_loop_s_next_turn(texts: list[str]) -> None:
    """Merging costs a lone call one turn of the worker's loop, no more."""

    async def scenario() -> None:
        loop, turns, sent_at = asyncio.get_running_loop(), [0], []

        def tick() -> None:  # runs once a turn
            turns[0] += 1
            loop.call_soon(tick)

        rows = fake_rows(FakeEngine().dim)

        async def handler(message: dict[str, Any]) -> tuple[dict[str, Any], list[bytes]]:
            sent_at.append(turns[0])
            return await rows(message)

        engine, client = remote(handler)
        loop.call_soon(tick)
        flown = await embed(engine, texts)
        assert sent_at == [1]
        assert [m["texts"] for m in client.calls] == [texts]
        assert flown.rows.shape == (len(texts), FakeEngine().dim) and flown.coalesced == [
            False
        ] * len(texts)

    asyncio.run(scenario())
