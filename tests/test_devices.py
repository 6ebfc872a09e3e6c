"""One engine process per device of ``FLEETCACHE_DEVICE`` (issue 15): ``fleetcache serve`` with
two fake engine processes (``cpu:0,cpu:1``: the fake engine takes device names, and runs on
the CPU whatever they say), real processes and sockets.

What a client relies on: misses are spread over the devices while an identical text is still
computed once across all of them; counting stays exact; ``/v1/stats`` and ``/metrics`` show
each device; a device whose engine process dies sends its texts to the others without a failed
request, and takes its share again once it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from cache.flight import Flown
from engines.base import EngineInfo
from engines.fake import FakeEngine
from features.readers import write_records
from features.synthetic import generate_fleet
from features.text import driver_text
from proxy.cli import app as cli
from proxy.cli import stats_tables
from proxy.engine_host import RemoteEngine
from proxy.ipc import ServiceUnavailableError, rows_frame
from proxy.processes import engine_file
from proxy.routing import EngineRouter, choose, rank
from proxy.settings import Settings
from proxy.supervisor import check_identities, engine_devices
from tests.serve_process import FleetcacheServer, alive

pytestmark = pytest.mark.timeout(300)
DEVICES = "cpu:0,cpu:1"


def embed(url: str, texts: list[str]) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=30) as client:  # a new connection: any worker
        return client.post("/v1/embeddings", json={"input": texts})


def devices(server: FleetcacheServer) -> list[dict[str, Any]]:
    return list(server.stats()["inference"]["devices"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetcacheServer]:
    # each forward sleeps 0.3 s: concurrent requests of one text meet while it is computed
    with FleetcacheServer(
        tmp_path_factory.mktemp("devices"), workers=2, device=DEVICES, fake_delay_ms=300
    ) as s:
        yield s


def test_an_identical_text_is_computed_once_across_the_engines(server: FleetcacheServer) -> None:
    before = server.stats()
    texts = [f"shared new text {i}" for i in range(8)]  # hashed to both engines
    with ThreadPoolExecutor(40) as pool:
        responses = list(pool.map(lambda i: embed(server.url, [texts[i % 8]]), range(80)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    after = server.stats()
    assert after["inference"]["items"] - before["inference"]["items"] == 8
    assert after["cache"]["misses"] - before["cache"]["misses"] == 8
    avoided = {k: after["cache"][k] - before["cache"][k] for k in ("hits", "coalesced")}
    assert sum(avoided.values()) == 72 and avoided["coalesced"] > 0, avoided  # joined or cached
    per_device = [
        a["items"] - b["items"]
        for a, b in zip(after["inference"]["devices"], before["inference"]["devices"], strict=True)
    ]
    assert sum(per_device) == 8 and all(n > 0 for n in per_device), per_device


def test_misses_are_spread_over_both_engines_and_counted_exactly(
    server: FleetcacheServer,
) -> None:
    before = devices(server)
    batches = [[f"spread {i} {j}" for j in range(32)] for i in range(20)]  # 640 new texts
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda texts: embed(server.url, texts), batches))
    assert all(r.status_code == 200 for r in responses)
    assert sum(int(r.headers["X-Cache-Misses"]) for r in responses) == 640
    stats = server.stats()
    took = [
        a["items"] - b["items"] for a, b in zip(stats["inference"]["devices"], before, strict=True)
    ]
    assert sum(took) == 640
    assert min(took) >= 640 * 0.35, took  # hashed: about half each (binomial, sd 13)
    assert stats["inference"]["items"] == stats["cache"]["misses"]
    assert sum(d["items"] for d in stats["inference"]["devices"]) == stats["inference"]["items"]


def test_stats_and_metrics_show_each_device(server: FleetcacheServer) -> None:
    assert embed(server.url, [f"for the stats {i}" for i in range(32)]).status_code == 200
    stats = server.stats()
    engines = stats["processes"]["engines"]
    assert [e["device"] for e in engines] == ["cpu:0", "cpu:1"]
    assert engines[0]["pid"] == stats["processes"]["engine"]["pid"]  # the v1.1 entry stays
    assert len({e["pid"] for e in engines}) == 2 and all(alive(e["pid"]) for e in engines)
    shown = stats["inference"]["devices"]
    assert [(d["device"], d["up"], d["healthy"], d["serving"]) for d in shown] == [
        ("cpu:0", True, True, "primary"),
        ("cpu:1", True, True, "primary"),
    ]
    metrics = httpx.get(f"{server.url}/metrics").text
    for index, device in enumerate(shown):
        labels = f'{{device="{device["device"]}",index="{index}"}}'
        assert f"fleetcache_engine_device_up{labels} 1.0" in metrics
        assert f"fleetcache_engine_device_healthy{labels} 1.0" in metrics
        items = re.search(
            rf"fleetcache_engine_device_items_total{re.escape(labels)} (\S+)", metrics
        )
        assert items is not None and float(items.group(1)) >= device["items"] > 0


def test_fleetcache_stats_shows_each_device(server: FleetcacheServer) -> None:
    assert embed(server.url, [f"for the table {i}" for i in range(32)]).status_code == 200
    console = Console(record=True, width=200)
    for table in stats_tables(server.stats()):
        console.print(table)
    shown = console.export_text()
    assert re.search(r"cpu:0\s+│ healthy\s+│ [1-9]", shown), shown
    assert re.search(r"cpu:1\s+│ healthy\s+│ [1-9]", shown), shown


def test_a_killed_engine_fails_no_request_and_comes_back(tmp_path: Path) -> None:
    with FleetcacheServer(tmp_path, workers=2, device=DEVICES, fake_delay_ms=20) as server:
        victim = server.pids()["engines"][1]
        failures: list[str] = []
        served = 0
        seen_down: list[dict[str, Any]] = []
        ready_while_down: list[int] = []
        stop = threading.Event()
        counter = itertools.count()

        def load() -> None:
            nonlocal served
            with httpx.Client(base_url=server.url, timeout=30) as client:
                while not stop.is_set():
                    n = next(counter)
                    texts = [f"load {n} {j}" for j in range(16)]  # new: both engines get some
                    try:
                        response = client.post("/v1/embeddings", json={"input": texts})
                    except httpx.TransportError as exc:
                        failures.append(repr(exc))
                        continue
                    if response.status_code == 200:
                        served += 1
                    else:
                        failures.append(f"{response.status_code} {response.text}")

        threads = [threading.Thread(target=load) for _ in range(6)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(1.0)
            os.kill(victim["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 30
            back = None
            while time.monotonic() < deadline and back is None:
                stats = server.stats()
                device = stats["inference"]["devices"][1]
                if not device["up"]:
                    seen_down.append(device)
                    ready_while_down.append(httpx.get(f"{server.url}/readyz").status_code)
                engine = stats["processes"]["engines"][1]
                if engine["pid"] != victim["pid"] and device["up"] and seen_down:
                    back = (engine, device)
                time.sleep(0.1)
            assert back is not None, "engine 1 did not come back within 30 s"
            items_back = back[1]["items"]
            time.sleep(1.0)  # its share of new texts again
        finally:
            stop.set()
            for thread in threads:
                thread.join()
        assert failures == [], failures[:5]
        assert served > 50
        assert not alive(victim["pid"])
        assert seen_down[0]["healthy"] is False and seen_down[0]["serving"] == "none"
        assert set(ready_while_down) == {200}  # the other device serves every miss
        engine, _ = back
        assert engine["restarts"] == 1
        stats = server.stats()
        assert stats["inference"]["devices"][1]["items"] > items_back
        assert stats["inference"]["items"] == stats["cache"]["misses"]


def test_a_direct_warmup_over_two_engines_embeds_each_text_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fleetcache warmup FILE`` starts an engine process per device too; its three reader
    processes meet the same vehicle texts and each is still computed once."""
    for name, value in {
        "ENGINE": "fake",
        "DEVICE": DEVICES,
        "DATA_DIR": str(tmp_path / "data"),
        "LMDB_MAP_SIZE_GB": "0.25",
        "WARMUP_PROCESSES": "3",
    }.items():
        monkeypatch.setenv(f"FLEETCACHE_{name}", value)
    monkeypatch.chdir(tmp_path)
    drivers = generate_fleet(400, seed=8)
    write_records(drivers, tmp_path / "fleet.jsonl")
    result = CliRunner().invoke(cli, ["warmup", "fleet.jsonl", "--chunk-size", "32"])
    assert result.exit_code == 0, result.output
    assert "400 indexed" in result.output
    embedded = int(result.output.split(" embedded")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert embedded == len({driver_text(d) for d in drivers})


# -- routing, without processes ------------------------------------------------------------


class StubClient:
    """What ``RemoteEngine`` needs of an ``RpcClient``: a fake engine behind ``call``."""

    def __init__(self, healthy: bool = True) -> None:
        self.up = True
        self.facts: dict[str, Any] = {
            "health": {"healthy": healthy, "reason": None, "serving": "primary"}
        }
        self.engine = FakeEngine()
        self.texts: list[str] = []
        self.links: list[tuple[str, ...]] = []
        self.fail: Exception | None = None

    async def call(self, op: str, blobs: Any = (), **args: Any) -> tuple[dict[str, Any], list[Any]]:
        if self.fail is not None:
            raise self.fail
        texts = args["texts"]
        self.texts += texts
        self.links += [tuple(link) for link in args.get("links") or ()]
        rows = np.stack([self.engine.vector(t) for t in texts])
        return {"coalesced": bytes(len(texts))}, [bytes(rows_frame(rows))]


def router(*clients: StubClient, policy: str = "hash") -> EngineRouter:
    info: EngineInfo = FakeEngine().info
    remotes = [RemoteEngine(c, info) for c in clients]  # type: ignore[arg-type]
    return EngineRouter(remotes, [f"cpu:{k}" for k in range(len(clients))], policy)


def route(engines: EngineRouter, texts: list[str]) -> Flown:
    return asyncio.run(engines.embed(texts, lane="dispatch", caller="dispatch", ttl_s={}))


class StartingClient(StubClient):
    """Down until ``answer()``: its ``wait_up`` returns as its first ping's answer comes (or
    False at its timeout), as ``RpcClient``'s does."""

    def __init__(self) -> None:
        super().__init__()
        self.up = False
        self._answered = asyncio.Event()

    def answer(self) -> None:
        self.up = True
        self._answered.set()

    async def wait_up(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._answered.wait()
        return self.up


def test_the_router_is_up_as_the_first_engine_answers_not_at_its_next_poll() -> None:
    """A warm-up job's readers and the workers wait for an engine before their first call:
    the router returns in the turns after an engine's first answer (it polled every 50 ms),
    whichever engine answers, and says False when none does in time."""

    async def test() -> None:
        a, b = StartingClient(), StartingClient()
        waiting = asyncio.create_task(router(a, b).wait_up(30.0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done()
        b.answer()
        for _ in range(5):  # no clock: loop turns only
            await asyncio.sleep(0)
        assert waiting.done() and waiting.result() is True
        assert await router(StartingClient(), StartingClient()).wait_up(0.05) is False

    asyncio.run(test())


def test_rows_come_back_in_input_order_from_both_engines() -> None:
    a, b = StubClient(), StubClient()
    texts = [f"text {i}" for i in range(100)]
    flown = route(router(a, b), texts)
    expected = np.stack([FakeEngine().vector(t) for t in texts])
    np.testing.assert_array_equal(flown.rows, expected)
    assert a.texts and b.texts and sorted(a.texts + b.texts) == sorted(texts)


def test_each_link_goes_to_one_engine_the_caller_s_hits_with_its_first_text() -> None:
    """An entity of a new text is linked by the engine computing that text; one of a text the
    caller found stored (not among the texts sent) by the engine taking the first text."""
    a, b = StubClient(), StubClient()
    texts = [f"text {i}" for i in range(40)]
    links = [("driver", f"d{i}", t) for i, t in enumerate(texts)] + [("driver", "h", "stored")]
    asyncio.run(router(a, b).embed(texts, lane="warmup", caller="warmup", ttl_s={}, links=links))
    first = a if texts[0] in a.texts else b
    assert a.texts and b.texts
    assert sorted(a.links + b.links) == sorted(links)
    assert ("driver", "h", "stored") in first.links
    for client in (a, b):
        assert {link[2] for link in client.links} - {"stored"} <= set(client.texts)


def test_a_tripped_engine_gets_no_texts_while_the_other_serves() -> None:
    a, b = StubClient(), StubClient(healthy=False)
    route(router(a, b), [f"text {i}" for i in range(50)])
    assert len(a.texts) == 50 and b.texts == []


def test_a_call_to_an_engine_that_went_away_goes_to_the_next_engine() -> None:
    a, b = StubClient(), StubClient()
    b.fail = ServiceUnavailableError("the engine-1 process went away")
    engines = router(a, b)
    texts = [f"text {i}" for i in range(50)]
    flown = route(engines, texts)
    assert sorted(a.texts) == sorted(texts) and engines.reroutes > 0
    np.testing.assert_array_equal(flown.rows[0], FakeEngine().vector(texts[0]))


def test_depth_routing_sends_a_call_to_the_engine_holding_fewer_texts() -> None:
    a, b = StubClient(), StubClient()
    engines = router(a, b, policy="depth")
    engines.outstanding[0] = 5  # engine 0 holds five texts of this process
    route(engines, [f"text {i}" for i in range(50)])
    assert a.texts == [] and len(b.texts) == 50
    engines.outstanding[0] = 0
    route(engines, [f"other {i}" for i in range(50)])
    assert 0 < len(a.texts) < 50 and len(b.texts) > 50  # nothing held: a tie, split by hash
    assert engines.outstanding == [0, 0]  # every answered call gave its texts back


def test_an_engine_that_stops_serving_moves_only_its_own_texts() -> None:
    texts = [f"text {i}" for i in range(3000)]
    weights = rank(texts, 3)
    every = choose(weights, np.array([True, True, True]))
    without = choose(weights, np.array([True, False, True]))
    kept = every != 1
    assert (without[kept] == every[kept]).all()  # nobody else's text moved
    moved = without[~kept]
    assert 0.4 < float(np.mean(moved == 0)) < 0.6  # spread over both others
    assert (rank(texts, 3) == weights).all()  # the same in every process


def test_device_lists_and_auto() -> None:
    fake = Settings(engine="fake", device="cpu:0,cpu:1")
    assert engine_devices(fake) == ("cpu:0", "cpu:1")
    with pytest.raises(ValueError, match="FLEETCACHE_DEVICE"):
        Settings(engine="fake", device="cuda:0")  # names only: a fake never claims a GPU
    with pytest.raises(ValueError, match="FLEETCACHE_DEVICE"):
        Settings(engine="torch", device="cuda:0,gpu1")
    with pytest.raises(ValueError, match=r"FLEETCACHE_DEVICE: 'cuda:0'.*'onnxruntime'"):
        Settings(engine="onnxruntime", device="cuda:0")  # a CPU engine
    with pytest.raises(ValueError, match=r"FLEETCACHE_DEVICE: 'cpu'.*'tensorrt'"):
        Settings(engine="tensorrt", device="cpu")
    with pytest.raises(ValueError, match="FLEETCACHE_FALLBACK_DEVICE: 'cpu'"):
        Settings(engine="torch", fallback_engine="tensorrt")  # its device is the CPU by default
    assert engine_devices(Settings(engine="onnxruntime"), gpus=lambda: 2) == ("auto",)
    torch = Settings(engine="torch", device="auto")
    assert engine_devices(torch, gpus=lambda: 2) == ("cuda:0", "cuda:1")
    assert engine_devices(torch, gpus=lambda: 1) == ("auto",)  # one engine picks as before
    assert engine_devices(torch, gpus=lambda: 0) == ("auto",)
    two = Settings(engine="torch", device="auto", engines_per_gpu=2)  # two processes a GPU
    assert engine_devices(two, gpus=lambda: 1) == ("cuda:0", "cuda:0")
    assert engine_devices(two, gpus=lambda: 2) == ("cuda:0", "cuda:0", "cuda:1", "cuda:1")
    assert engine_devices(two, gpus=lambda: 0) == ("auto",)  # no GPU: one engine, the CPU
    assert len(engine_devices(two, gpus=lambda: 16)) == 16  # MAX_DEVICES in all
    with pytest.raises(ValueError, match="engines_per_gpu"):
        Settings(engine="torch", engines_per_gpu=0)
    assert engine_devices(Settings(engine="torch", device="cuda:0,cuda:0")) == ("cuda:0",) * 2
    assert FakeEngine(device="cpu:1").info.fingerprint == FakeEngine().info.fingerprint


def test_engines_that_would_compute_different_vectors_are_refused(tmp_path: Path) -> None:
    same, other = FakeEngine(device="cpu:0").info, FakeEngine(dim=8).info
    for k, info in enumerate((same, same, other)):
        (tmp_path / engine_file(k)).write_text(json.dumps(asdict(info)))
    assert check_identities(tmp_path, ["cpu:0", "cpu:1"]) is None
    refused = check_identities(tmp_path, ["cpu:0", "cpu:1", "cpu:2"])
    assert refused is not None and "cpu:2" in refused and other.fingerprint in refused


def test_the_engine_stores_rows_under_the_keys_a_worker_hashed_of_its_namespace_only(
    tmp_path: Path,
) -> None:
    """A worker's keys save the engine hashing its misses again; keys of another namespace
    (a worker that knew another engine) are not trusted: the engine hashes those texts."""
    from proxy.board import Board
    from proxy.engine_host import open_engine_host

    settings = Settings(
        engine="fake", device="cpu", data_dir=tmp_path, store="lmdb", gpu_health_interval_s=0
    )

    async def scenario() -> tuple[list[Any], list[Any]]:
        async with open_engine_host(settings, Board("engine")) as host:
            own, foreign = f"{host.namespace}:from-the-worker", "t0-other:from-the-worker"
            for text, key in (("first text", own), ("second text", foreign)):
                await host.embed([text], lane="dispatch", caller="dispatch", ttl_s={}, keys=[key])
            miscounted = [f"{host.namespace}:one key for two texts"]
            await host.embed(
                ["third text", "fourth text"],
                lane="dispatch",
                caller="dispatch",
                ttl_s={},
                keys=miscounted,
            )
            assert host.writer is not None and host.store is not None
            texts = ("first text", "second text", "third text", "fourth text")
            hashed = [host.writer.key(t) for t in texts]
            return host.store.mget([own, foreign, *miscounted]), host.store.mget(hashed)

    given, hashed = asyncio.run(scenario())
    assert given[0] is not None and given[1] is None  # its own namespace's key: used
    assert given[2] is None  # keys that do not match the texts one for one: not used
    assert hashed[0] is None and all(row is not None for row in hashed[1:])  # hashed again


def test_the_engine_holds_new_texts_while_its_store_is_behind(tmp_path: Path) -> None:
    """``FLEETCACHE_MAX_UNWRITTEN`` in the engine process: with LMDB's commits held, new texts
    past the bound wait to be computed until the store catches up, and its board shows how
    many vectors wait for the store and that a call waited."""
    from proxy.board import Board, Boards
    from proxy.engine_host import open_engine_host

    settings = Settings(
        engine="fake",
        device="cpu",
        data_dir=tmp_path,
        store="lmdb",
        gpu_health_interval_s=0,
        max_unwritten=2,
    )

    async def scenario() -> tuple[bool, float, float, float]:
        board = Board("engine")
        async with open_engine_host(settings, board) as host:
            assert host.store is not None and host.store.store is not None
            lmdb: Any = host.store.store
            gate, commit = asyncio.Event(), lmdb._commit

            async def held(items: Any) -> None:
                await gate.wait()
                await commit(items)

            lmdb._commit = held

            async def embed(texts: list[str]) -> Flown:
                return await host.embed(
                    texts, lane="dispatch", caller="dispatch", ttl_s={}, durable=False
                )

            await embed(["one", "two"])  # answered; their write-back held
            late = asyncio.ensure_future(embed(["three"]))
            await asyncio.sleep(0.05)
            host.publish()
            totals = Boards(own=board).read()
            waiting = late.done(), totals.gauges["cache.unwritten"]
            gate.set()
            await late
            host.publish()
            after = Boards(own=board).read()
            return (*waiting, after.scalars["cache.store_waits"], host.batcher.totals()[0])

    assert asyncio.run(scenario()) == (False, 2, 1, 3)
