"""The engine's device work in a child process (``proxy.device_process``): the same vectors as
the engine in process, the ids a worker sent are what runs, and a child that dies fails only
the batch it held while another is started."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engines.base import Batch, EngineError, EngineUnavailableError, Vectors
from engines.batcher import Batcher
from engines.fake import FakeEngine
from engines.tokenization import TokenizedTexts
from features.readers import write_records
from features.synthetic import generate_fleet
from proxy import cores
from proxy.device_process import DeviceProcessEngine, use_device_process
from proxy.engine_host import build_engine
from proxy.jobs import STARTER_NAME
from proxy.settings import Settings
from tests.serve_process import FleetcacheServer, cpus_of, descendants
from tests.test_processes import embed, job_ended, start_job
from tests.test_tokenization import as_sent, real_fleet

TEXTS = [f"driver {i} | van | lisbon" for i in range(300)]


def wait_until(check: Callable[[], bool], seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds:g} s"
        time.sleep(0.1)


@pytest.fixture
def fake() -> Iterator[DeviceProcessEngine]:
    engine = DeviceProcessEngine("fake", {"device": "cpu", "fail_on": "poison"})
    engine.load()
    yield engine
    engine.close()


def test_auto_runs_the_device_in_a_child_on_a_gpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert use_device_process("auto", "cuda:0", "torch") and use_device_process("on", "cpu", "fake")
    assert not use_device_process("auto", "cpu", "torch")
    assert not use_device_process("off", "cuda", "torch")
    # One GPU: the device stays ``auto`` and the engine picks CUDA (it used to stay in process).
    assert use_device_process("auto", "auto", "torch", gpus=lambda: 1)
    assert use_device_process("auto", "auto", "tensorrt", gpus=lambda: 1)
    assert not use_device_process("auto", "auto", "torch", gpus=lambda: 0)
    assert not use_device_process("auto", "auto", "onnxruntime", gpus=lambda: 1)  # a CPU engine
    assert not use_device_process("auto", "auto", "fake", gpus=lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # what the default settings meet on a GPU
    assert isinstance(build_engine(Settings(engine="torch")).primary, DeviceProcessEngine)
    on = Settings(engine="fake", device_process="on")
    assert isinstance(build_engine(on).primary, DeviceProcessEngine)
    assert isinstance(build_engine(Settings(engine="fake")).primary, FakeEngine)  # on a CPU


def test_a_device_child_embeds_as_the_engine_in_process(fake: DeviceProcessEngine) -> None:
    local = FakeEngine(device="cpu")
    assert fake.info == local.info and fake.pid not in (None, os.getpid())
    assert np.array_equal(fake.embed(TEXTS), local.embed(TEXTS))
    assert fake.embed([]).shape == (0, local.dim)
    with pytest.raises(EngineError, match="poison") as failed:  # the batch's own error
        fake.embed(["ok", "poison pill"])
    assert type(failed.value) is EngineError
    assert np.array_equal(fake.embed(TEXTS[:2]), local.embed(TEXTS[:2]))  # the child lives on
    assert fake.starts == 1


def test_batches_sent_ahead_are_answered_to_whoever_waits(fake: DeviceProcessEngine) -> None:
    """A batch goes to the child when it is tokenized (the batcher tokenizes the next one
    while the device runs this one): each forward gets its own batch's rows, whatever the
    order, with batches never forwarded (dropped meanwhile) and two threads at once."""
    local = FakeEngine()
    parts = [TEXTS[i : i + 7] for i in range(0, 280, 7)]
    sent = [fake.tokenize(part) for part in parts[:4]]
    assert np.array_equal(fake.forward(sent[1]), local.embed(parts[1]))
    assert np.array_equal(fake.forward(sent[0]), local.embed(parts[0]))  # filed meanwhile
    dropped = [fake.tokenize(part) for part in parts[4:30]]  # never forwarded
    assert np.array_equal(fake.forward(sent[3]), local.embed(parts[3]))
    assert len(dropped) == 26

    def embed_each(own: list[list[str]]) -> list[bool]:
        return [np.array_equal(fake.embed(part), local.embed(part)) for part in own]

    results: list[list[bool]] = []
    threads = [
        threading.Thread(target=lambda own=own: results.append(embed_each(own)))
        for own in (parts[30:35] * 10, parts[35:40] * 10)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [len(r) for r in results] == [50, 50] and all(map(all, results))


def test_a_batch_over_the_token_budget_is_not_sent_ahead() -> None:
    """The batcher cuts it into groups and runs those: sent whole, the child would run it
    as well (and over the budget)."""
    engine = DeviceProcessEngine("fake", {"device": "cpu"}, max_batch_tokens=256 * 3)
    engine.load()  # the fake has no tokenizer: each text counts max_seq_length (256)
    try:
        whole, over = engine.tokenize(TEXTS[:3]), engine.tokenize(TEXTS[:4])
        assert "ticket" in whole.data and "ticket" not in over.data
        local = FakeEngine()
        assert np.array_equal(engine.forward(over), local.embed(TEXTS[:4]))  # sent now
        assert np.array_equal(engine.forward(whole), local.embed(TEXTS[:3]))
    finally:
        engine.close()


def test_batches_form_within_the_token_budget_and_reach_the_child_ahead(tmp_path: Path) -> None:
    """The engine process (its batcher, timing and fallback around the child): without a
    tokenizer every text counts ``max_seq_length`` (256), known before the child tokenizes
    it, so the batcher forms batches of 128 within a budget of 32,768, each sent while the
    one before runs: the child's loop never waits after the first. (Batches of 256 were cut
    in two on the engine thread, each half sent when its forward began: the loop waited for
    every one of them.)"""
    from proxy.board import Board
    from proxy.engine_host import open_engine_host

    settings = Settings(
        engine="fake",
        device_process="on",
        fake_delay_ms=100,  # the time to send the next one ahead: 50 was short once on 2 busy cores
        max_batch_size=256,
        data_dir=tmp_path,
        store="lmdb",
        gpu_health_interval_s=0,
    )
    assert settings.max_batch_tokens == 32_768

    async def scenario() -> dict[str, Any]:
        async with open_engine_host(settings, Board("engine")) as host:
            parts = [TEXTS[i : i + 128] for i in range(0, 256, 128)]
            parts += [[f"{text} {n}" for text in part] for part in parts for n in range(3)]
            flown = await asyncio.gather(
                *(host.embed(p, lane="warmup", caller="warmup", ttl_s={}) for p in parts)
            )
            assert np.array_equal(flown[0].rows, FakeEngine().embed(TEXTS[:128]))
            return host.facts()["device_process"]

    child = asyncio.run(scenario())
    assert child["batches"] == 8 and child["starved_batches"] <= 2


def test_the_child_says_whether_its_device_loop_waited_for_batches_or_they_for_it() -> None:
    """What tells a starved device child from a late one (``health()``, /v1/stats): one batch
    at a time, its loop waits for each; three sent ahead, the second and third wait, padded,
    behind the forward before them."""
    engine = DeviceProcessEngine("fake", {"device": "cpu", "delay_s": 0.1})
    engine.load()
    try:
        for i in range(2):
            engine.embed(TEXTS[i : i + 5])
            time.sleep(0.2)  # the loop waits, starved
        alone = engine.health()
        assert alone["batches"] == alone["starved_batches"] == 2
        assert alone["seconds"]["waiting"] >= 0.2 and alone["seconds"]["queued"] < 0.05
        assert 0.2 <= alone["seconds"]["forward"] < 1.0
        # each was sent at the end of its wait: the engine process's lateness, not the child's
        assert 0.2 <= alone["seconds"]["late"] <= alone["seconds"]["waiting"]
        assert alone["seconds"]["transit"] < 0.05 and alone["seconds"]["pickup"] < 0.05

        sent = [engine.tokenize(TEXTS[i : i + 5]) for i in range(0, 15, 5)]
        for batch in sent:
            engine.forward(batch)
        ahead = engine.health()
        assert ahead["batches"] == 5 and ahead["starved_batches"] == 3  # 2, then the first of 3
        queued = ahead["seconds"]["queued"] - alone["seconds"]["queued"]
        assert queued >= 0.1 + 0.2 - 0.05  # ~0.1 s behind one forward, ~0.2 behind two
        assert ahead["seconds"]["forward"] >= 0.5 and ahead["seconds"]["padding"] < 0.5
        # the first of three, sent 0.2 s after the loop went idle; the others were waiting
        assert 0.2 <= ahead["seconds"]["late"] - alone["seconds"]["late"] < 0.25
    finally:
        engine.close()


def test_the_engine_process_times_its_hand_over_of_a_batch_formed_ahead() -> None:
    """``forming``: the engine thread starting on a batch -> another thread starting to
    tokenize the next (the batcher's event loop and tokenizer thread); ``pickup``: an answer
    sent -> the thread that waits for it holding it."""
    engine = DeviceProcessEngine("fake", {"device": "cpu", "delay_s": 0.05})
    engine.load()
    try:
        first = engine.tokenize(TEXTS[:5])
        ahead: list[Batch] = []

        def form_late() -> None:
            time.sleep(0.2)
            ahead.append(engine.tokenize(TEXTS[5:10]))

        former = threading.Thread(target=form_late)
        former.start()
        engine.forward(first)  # the engine thread starts on it; the next one forms 0.2 s later
        former.join()
        time.sleep(0.2)  # its answer (at ~0.25 s) waits ~0.15 s to be picked up
        engine.forward(ahead[0])
        seconds = engine.health()["seconds"]
        # the former's 0.2 s began just before forward() started the engine thread on its
        # batch: CI measured 0.19999 once, so the bound allows that head start
        assert 0.18 <= seconds["forming"] < 0.4
        assert 0.1 <= seconds["pickup"] < 0.3
        assert seconds["tokenizing"] < 0.05
    finally:
        engine.close()


def test_a_killed_device_child_fails_its_batch_and_another_serves() -> None:
    engine = DeviceProcessEngine("fake", {"device": "cpu", "delay_s": 1.0})
    engine.load()
    try:
        first = engine.pid
        assert first is not None
        outcome: list[BaseException] = []

        def held() -> None:
            try:
                engine.embed(TEXTS[:4])
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=held)
        thread.start()
        time.sleep(0.3)  # the batch is in the child's forward
        os.kill(first, signal.SIGKILL)
        thread.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], EngineUnavailableError)
        started = time.monotonic()
        with pytest.raises(EngineUnavailableError):  # at once while the next one starts
            engine.embed(TEXTS[:1])
        assert time.monotonic() - started < 2.0  # not the restart, nor the 120 s timeout
        assert not engine.health()["ok"]
        wait_until(lambda: engine.health()["ok"])
        assert engine.pid not in (None, first) and engine.starts == 2
        assert np.array_equal(engine.embed(TEXTS[:3]), FakeEngine().embed(TEXTS[:3]))
    finally:
        engine.close()
    assert engine.pid is None
    with pytest.raises(EngineError, match="closed"):
        engine.embed(TEXTS[:1])


def test_the_fallback_serves_while_the_device_child_is_replaced() -> None:
    """Through the engine process's own stack: FallbackEngine over the child, the batcher."""
    settings = Settings(engine="fake", device_process="on", fallback_engine="fake")
    engine = build_engine(settings)
    engine.load()

    async def run() -> None:
        async with Batcher(engine, max_batch_size=64) as batcher:
            assert np.array_equal(await batcher.submit(TEXTS), FakeEngine().embed(TEXTS))
            child = engine.primary.pid
            assert child is not None
            os.kill(child, signal.SIGKILL)
            await asyncio.sleep(0.2)
            rows = await batcher.submit(TEXTS[:40])  # the fallback's, same fingerprint
            assert np.array_equal(rows, FakeEngine().embed(TEXTS[:40]))
            assert engine.health()["serving"] == "fallback"
            await asyncio.to_thread(wait_until, lambda: engine.health()["serving"] == "primary")
            assert engine.primary.pid not in (None, child)

    try:
        asyncio.run(run())
    finally:
        engine.close()


@pytest.mark.model
def test_the_torch_engine_in_a_device_child_runs_the_ids_it_is_sent() -> None:
    """The fixed-shape path (the GPU's; eager on the CPU here) in a child: texts with a
    worker's ids embed as plain texts do, the ids are what the child runs (swapped ids give
    the swapped vectors), and the batcher's token-budget groups keep each text's ids."""
    options = {"device": "cpu", "static_shapes": True, "batch_buckets": (1, 8)}
    options["seq_buckets"] = (16, 64)
    engine = DeviceProcessEngine("torch", options)
    engine.load()
    try:
        tokenizer = engine.tokenizer()
        assert tokenizer is not None  # the child's file: workers send ids of the same digest
        texts = [*real_fleet()[:18], "long " * 400, "van"]
        plain = engine.embed(texts)  # tokenized in this process, run in the child
        sent = as_sent(tokenizer, texts)
        assert np.allclose(engine.embed(sent), plain, atol=1e-6)
        other = as_sent(tokenizer, texts[::-1])
        swapped = TokenizedTexts(texts, other.flat, other.bounds)
        assert np.allclose(engine.embed(swapped), plain[::-1], atol=1e-6)
        assert engine.tokenize(sent[:4]).seq_lengths is not None

        async def batched() -> Vectors:
            async with Batcher(engine, max_batch_size=64, max_batch_tokens=600) as batcher:
                parts = await asyncio.gather(batcher.submit(sent[:10]), batcher.submit(sent[10:]))
            return np.concatenate(parts)

        assert np.allclose(asyncio.run(batched()), plain, atol=1e-5)
    finally:
        engine.close()


def test_the_server_serves_on_while_its_device_child_is_replaced(tmp_path: Path) -> None:
    """``fleetcache serve`` with the device child: kill -9 of it under requests costs no
    request (the fallback computes misses meanwhile); the engine process lives on, its new
    child serves, and the counts stay exact."""
    settings = {"device_process": "on", "lmdb_writer": "thread", "fallback_engine": "fake"}
    with FleetcacheServer(tmp_path, workers=2, **settings) as server:
        assert embed(server.url, ["before"]).status_code == 200
        engine = server.pids()["engine"]["pid"]
        (child,) = descendants(engine)  # the writer is a thread here: the device child alone
        shown = server.stats()["inference"]["device_process"]
        assert {k: shown[k] for k in ("ok", "pid", "starts", "reason")} == {
            "ok": True,
            "pid": child,
            "starts": 1,
            "reason": None,
        }
        os.kill(child, signal.SIGKILL)
        statuses = [embed(server.url, [f"during {i}", "before"]).status_code for i in range(30)]
        assert statuses == [200] * 30

        def replaced() -> bool:
            serving = server.stats()["inference"]["engine_health"]["serving"]
            return serving == "primary" and descendants(engine) not in ([], [child])

        wait_until(replaced)
        assert embed(server.url, ["after"]).status_code == 200
        assert server.pids()["engine"] == {"pid": engine, "restarts": 0}
        stats = server.stats()
        shown = stats["inference"]["device_process"]
        assert shown["ok"] and shown["starts"] == 2 and shown["pid"] not in (None, child)
        assert stats["inference"]["items"] == stats["cache"]["misses"] == 32
        metrics = httpx.get(f"{server.url}/metrics").text  # how the children spent their batches
        assert re.search(r"^fleetcache_device_child_batches_total [1-9]", metrics, re.M)
        assert re.search(
            r'^fleetcache_device_child_seconds_total\{phase="forward"\} ', metrics, re.M
        )
        assert "fleetcache_device_child_starved_batches_total" in metrics


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place apart")
def test_each_process_of_the_server_runs_on_the_cpus_its_placement_gives_it(
    tmp_path: Path,
) -> None:
    """``FLEETCACHE_CPU_PLACEMENT=ENGINE/DEVICE``: every thread of the engine process on the
    first list once it serves, its device child on the second (a replacement child too), the
    workers, the index owner and the LMDB writer children on the rest; the job starter and
    a warm-up job with its readers on every CPU. (On two CPUs the engine and its child share
    one: three or more place them apart.)"""
    every = sorted(os.sched_getaffinity(0))
    own, child_own = str(every[0]), str(every[1] if len(every) >= 3 else every[0])
    rest = cores.cpu_text(tuple(c for c in every if str(c) not in (own, child_own)))
    settings = {
        "device_process": "on",
        "lmdb_writer": "process",
        "cpu_placement": f"{own}/{child_own}",
    }
    fleet = tmp_path / "fleet.jsonl"
    write_records(generate_fleet(30_000, seed=9), fleet)
    with FleetcacheServer(tmp_path / "server", workers=2, **settings) as server:
        assert embed(server.url, ["placed"]).status_code == 200
        processes = server.pids()
        engine = processes["engine"]["pid"]
        child = server.stats()["inference"]["device_process"]["pid"]
        assert (cpus_of(engine), cpus_of(child)) == ({own}, {child_own})
        writers = [pid for pid in descendants(engine) if pid != child]
        assert writers  # the writer child and its partitions' writers
        others = [w["pid"] for w in processes["workers"]] + [processes["index"]["pid"]]
        for pid in [*writers, *others]:
            assert cpus_of(pid) == {rest}, (pid, comm(pid))
        starter = [p for p in descendants(server.process.pid) if comm(p) == STARTER_NAME]
        assert starter and cpus_of(starter[0]) == {cores.cpu_text(tuple(every))}
        with httpx.Client(base_url=server.url, timeout=30) as client:
            job_id = start_job(client, fleet)
            state_file = tmp_path / "server" / "data" / "warmup" / "jobs" / f"{job_id}.json"
            wait_until(lambda: "pid" in json.loads(state_file.read_text()))
            job = json.loads(state_file.read_text())["pid"]
            assert cpus_of(job) == {cores.cpu_text(tuple(every))}
            assert job_ended(client, job_id, 120)["state"] == "done"
        os.kill(child, signal.SIGKILL)

        new: list[int] = []

        def replaced() -> bool:  # a batch finds it gone (503 until the next one serves)
            embed(server.url, [f"after {time.monotonic()}"])
            shown = server.stats()["inference"]["device_process"]  # (one worker's view)
            new[:] = [shown["pid"]] if shown["ok"] and shown["pid"] not in (None, child) else []
            return bool(new)

        wait_until(replaced)
        assert cpus_of(new[0]) == {child_own}


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def test_a_placement_naming_cpus_the_server_may_not_use_stops_its_start(tmp_path: Path) -> None:
    server = FleetcacheServer(tmp_path, device_process="on", cpu_placement="0/4095")
    with pytest.raises(AssertionError, match="fleetcache serve exited"):
        server.start(timeout_s=60)
    assert server.process is not None and server.process.wait(timeout=30) == 2
    assert "FLEETCACHE_CPU_PLACEMENT=0/4095: the CPUs named must be among" in server.log.read_text()
