"""A worker's embed calls to the engine process: gathered while its call slots are taken, and
each text's own lookup time (``since``) kept through the gathering."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from cache.flight import SingleFlight
from engines.base import EngineInfo, QueueFullError
from proxy.engine_host import RemoteEngine
from proxy.ipc import rows_frame

DIM = 4


def row(text: str) -> np.ndarray:
    return np.full(DIM, float(len(text)), np.float32)


class HeldClient:
    """An ``RpcClient`` stand-in: records each embed call, holds it until released."""

    def __init__(self) -> None:
        self.up = True
        self.facts: dict[str, Any] = {}  # no tokenizer: texts go as they are
        self.calls: list[dict[str, Any]] = []
        self.gates: list[asyncio.Event] = []
        self.fail: Exception | None = None

    async def call(self, op: str, blobs: Sequence[Any] = (), **message: Any) -> Any:
        assert op == "embed"
        self.calls.append(message)
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        if self.fail is not None:
            raise self.fail
        texts = message["texts"]
        rows = np.stack([row(t) for t in texts])
        return {"coalesced": bytes(len(texts))}, [bytes(rows_frame(rows))]


def remote(client: HeldClient, max_calls: int) -> RemoteEngine:
    info = EngineInfo(
        kind="fake",
        device="cpu",
        precision="fp32",
        model="m",
        dim=DIM,
        max_seq_length=16,
        fingerprint="fp",
    )
    return RemoteEngine(client, info, max_calls=max_calls)  # type: ignore[arg-type]


async def until(condition: Any) -> None:
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never became true")


def test_requests_wait_for_a_free_slot_and_go_together_each_with_its_own_rows() -> None:
    async def test() -> None:
        client = HeldClient()
        engine = remote(client, max_calls=1)
        embed = engine.embed
        first = asyncio.create_task(embed(["a"], lane="dispatch", caller="dispatch", ttl_s={}))
        await until(lambda: len(client.calls) == 1)
        waiting = [
            asyncio.create_task(
                embed(texts, lane="dispatch", caller="dispatch", ttl_s=ttl, since=since)
            )
            for texts, ttl, since in [
                (["bb", "ccc"], {"bb": 60.0}, 10.0),
                (["dddd"], {}, 20.0),
                (["eeeee", "bb"], {}, None),
            ]
        ]
        other_lane = asyncio.create_task(
            embed(["w"], lane="warmup", caller="warmup", ttl_s={})
        )  # a slot of its own: goes at once
        await until(lambda: len(client.calls) == 2)
        assert client.calls[1]["texts"] == ["w"]
        client.gates[0].set()
        await until(lambda: len(client.calls) == 3)  # the three waiting requests, as one call
        gathered = client.calls[2]
        assert gathered["texts"] == ["bb", "ccc", "dddd", "eeeee", "bb"]
        assert gathered["since"] == [10.0, 10.0, 20.0, None, None]
        assert gathered["ttl"] == {"bb": 60.0}
        for gate in client.gates[1:]:
            gate.set()
        results = await asyncio.gather(first, *waiting, other_lane)
        for flown, texts in zip(
            results, [["a"], ["bb", "ccc"], ["dddd"], ["eeeee", "bb"], ["w"]], strict=True
        ):
            np.testing.assert_array_equal(flown.rows, np.stack([row(t) for t in texts]))
            assert flown.coalesced == [False] * len(texts)
        assert len(client.calls) == 3

    asyncio.run(test())


def test_a_gathered_call_fails_every_request_in_it_and_a_cancelled_one_leaves_the_rest() -> None:
    async def test() -> None:
        client = HeldClient()
        engine = remote(client, max_calls=1)
        embed = engine.embed
        first = asyncio.create_task(embed(["a"], lane="dispatch", caller="dispatch", ttl_s={}))
        await until(lambda: len(client.calls) == 1)
        gone = asyncio.create_task(embed(["b"], lane="dispatch", caller="dispatch", ttl_s={}))
        kept = asyncio.create_task(embed(["c"], lane="dispatch", caller="dispatch", ttl_s={}))
        await asyncio.sleep(0)
        gone.cancel()
        client.gates[0].set()
        await first
        await until(lambda: len(client.calls) == 2)
        assert client.calls[1]["texts"] == ["b", "c"]  # already gathered when it went away
        client.fail = QueueFullError("engine queue full")
        client.gates[1].set()
        with pytest.raises(QueueFullError):
            await kept
        with pytest.raises(asyncio.CancelledError):
            await gone
        client.fail = None  # the slot is free again: the next request goes at once
        late = asyncio.create_task(embed(["d"], lane="dispatch", caller="dispatch", ttl_s={}))
        await until(lambda: len(client.calls) == 3)
        client.gates[2].set()
        np.testing.assert_array_equal((await late).rows, row("d")[None])

    asyncio.run(test())


def test_requests_with_entity_links_are_never_gathered() -> None:
    async def test() -> None:
        client = HeldClient()
        engine = remote(client, max_calls=1)
        first = asyncio.create_task(engine.embed(["a"], lane="warmup", caller="warmup", ttl_s={}))
        linked = asyncio.create_task(
            engine.embed(
                ["b"], lane="warmup", caller="warmup", ttl_s={}, links=[("driver", "d1", "b")]
            )
        )
        await until(lambda: len(client.calls) == 2)  # sent at once, slot or not
        assert client.calls[1]["links"] == [["driver", "d1", "b"]]
        for gate in client.gates:
            gate.set()
        await asyncio.gather(first, linked)

    asyncio.run(test())


def test_each_text_joins_a_recent_write_back_only_after_its_own_lookup_began() -> None:
    """A text written back after a caller's lookup began joins that computation (it was not in
    the store when looked up); one written before was there to be found, so missing it means
    it was dropped since, and it is computed again. Per text, when callers' texts go together."""

    async def test() -> None:
        computed: list[list[str]] = []

        async def compute(texts: Sequence[str], lane: str) -> np.ndarray:
            computed.append(list(texts))
            return np.stack([row(t) for t in texts])

        async def write_back(*_: Any) -> bool:
            return True

        flight = SingleFlight(compute, DIM, write_back=write_back)
        before = time.monotonic()
        await flight.embed(["a", "b"], lane="dispatch", caller="dispatch", ttl_s={})
        after = time.monotonic()
        flown = await flight.embed(
            ["a", "b"], lane="dispatch", caller="dispatch", ttl_s={}, since=[before, after]
        )
        assert flown.coalesced == [True, False]
        assert computed == [["a", "b"], ["b"]]
        np.testing.assert_array_equal(flown.rows, np.stack([row("a"), row("b")]))
        with pytest.raises(ValueError, match="2 lookup times for 1 texts"):
            await flight.embed(["c"], lane="dispatch", caller="dispatch", ttl_s={}, since=[1, 2])

    asyncio.run(test())
