"""Warm-up pacing: a job yields to live dispatch traffic and runs at full speed without it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from features.readers import write_records
from features.synthetic import generate_fleet
from proxy import warmup
from proxy.board import Board, Boards
from proxy.jobs import DispatchTraffic
from proxy.services import Services, open_local_services
from proxy.telemetry import BoardCacheStats
from proxy.warmup import LocalSink, WarmupProgress, run_warmup
from tests.conftest import make_settings

N = 2_000


def count_concurrent_upserts(services: Services, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Wrap the services' upsert: [in flight now, most ever in flight at once]."""
    seen = [0, 0]
    upsert = services.upsert_drivers

    async def counted(*args: Any, **kwargs: Any) -> Any:
        seen[0] += 1
        seen[1] = max(seen)
        try:
            return await upsert(*args, **kwargs)
        finally:
            seen[0] -= 1

    monkeypatch.setattr(services, "upsert_drivers", counted)
    return seen


async def warm_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, dispatch: bool) -> None:
    source = tmp_path / "fleet.jsonl"
    drivers = generate_fleet(N, seed=3)
    write_records(drivers, source)
    async with open_local_services(make_settings(tmp_path / "data")) as services:
        await services.embed(["cached order text"], "dispatch")  # before the job: not traffic
        seen = count_concurrent_upserts(services, monkeypatch)
        # A frozen clock: once a dispatch lookup is seen, traffic stays live for the whole job.
        sink = LocalSink(services, slice_size=16, clock=lambda: 0.0)
        assert not sink.dispatch_live()
        if dispatch:  # traffic already live when the job starts
            await services.embed(["cached order text"], "dispatch")
            assert sink.dispatch_live()
        progress = WarmupProgress(source=str(source))
        job = asyncio.create_task(run_warmup(source, sink, progress, chunk_size=200))
        lookups = 0
        while dispatch and not job.done():
            result = await services.embed(["cached order text"], "dispatch")
            assert result.misses == 0
            lookups += 1
            await asyncio.sleep(0.005)  # steady traffic that leaves the loop some idle time
        await job
        assert progress.state == "done"
        assert (progress.indexed, progress.embedded + progress.cached) == (N, N)
        assert await services.index.count() == N
        for d in drivers[::97]:
            assert await services.index.get_driver(d.driver_id) == d
        if dispatch:
            assert lookups > 0 and sink.paced > 0
            assert seen[1] <= sink.paced_slices  # never more slices at once than the bound
        else:
            assert sink.paced == 0
            assert seen[1] > sink.paced_slices  # a whole chunk's slices at once


def test_warmup_paces_itself_while_dispatch_traffic_is_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(warm_up(tmp_path, monkeypatch, dispatch=True))


def test_warmup_runs_unpaced_without_dispatch_traffic(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asyncio.run(warm_up(tmp_path, monkeypatch, dispatch=False))


@pytest.mark.timeout(120)
def test_paced_warmup_still_progresses_when_the_loop_is_never_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # e.g. a CPU engine keeping every core busy: the lag check never passes, and each slice
    # waits at most max_wait_s for it before it starts anyway
    async def always_late() -> float:
        return 1.0

    monkeypatch.setattr(warmup, "_loop_lag", always_late)
    asyncio.run(warm_up(tmp_path, monkeypatch, dispatch=True))


def test_a_job_process_sees_the_whole_server_s_dispatch_lookups(tmp_path: Path) -> None:
    """A job in its own process paces on ``DispatchTraffic``: the lookups of every caller
    but warm-up, from every process's board (a worker's hits, the engine's misses), one
    counter; a warm-up lookup does not move it."""
    boards_dir = tmp_path / "boards"
    worker = BoardCacheStats(Board("worker", boards_dir))
    engine = BoardCacheStats(Board("engine", boards_dir))
    traffic = DispatchTraffic(Boards(boards_dir), every_s=0.0)
    assert traffic.lookups() == 0
    worker.record("dispatch", 30, 1, 0, 0.0)
    worker.record("ops-console", 2, 0, 0, 0.0)
    engine.record("dispatch", 0, 0, 5, 0.0)
    assert traffic.lookups() == 38
    worker.record("warmup", 100, 0, 0, 0.0)
    engine.record("warmup", 0, 0, 256, 0.0)
    assert traffic.lookups() == 38
    # the 16 bytes it reads of each board say what the whole boards say; a board of another
    # layout, or one not written yet, adds nothing
    (boards_dir / "old-layout.board").write_bytes(np.full(4096, 7.0).tobytes())
    (boards_dir / "new.board").write_bytes(b"")
    boards = Boards(boards_dir)
    assert boards.scalar("cache.dispatch_lookups") == 38
    assert boards.read().scalars["cache.dispatch_lookups"] == 38
    own = Board("worker")  # one process: its own board, in memory
    BoardCacheStats(own).record("dispatch", 4, 0, 0, 0.0)
    assert Boards(own=own).scalar("cache.dispatch_lookups") == 4
    assert Boards(own=own).read().scalars["cache.dispatch_lookups"] == 4
