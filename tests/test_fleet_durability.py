"""Durable fleet writes (API.md v1.1, "Durability"; issue 12, defect 2): a change the index
owner acknowledged survives a kill -9, through its change log (``indexes.changelog``).

In process, a crash is the index directory copied while the owner runs, after its last
acknowledged change: what a kill -9 leaves on disk. The last test kills a real ``fleetcache
serve`` tree with SIGKILL and starts another on the same data dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from features.models import Position
from features.synthetic import generate_fleet
from indexes import FleetTable, Prepared, Recommendation
from indexes.changelog import recover, segment_names, segment_path
from indexes.changes import (
    Delete,
    Move,
    Positions,
    Update,
    Upsert,
    apply,
    decode,
    encode,
    frames,
)
from indexes.errors import ChangeLogError
from proxy.board import Board
from proxy.index_host import LOG_DIR, IndexHost, open_index_host
from tests.conftest import make_settings
from tests.serve_process import FleetcacheServer, crash
from tests.test_index import DIM, SHANGHAI, driver, gaussian_unit, order

State = tuple[dict[str, tuple[Any, bytes]], list[Recommendation]]
ORDERS = [order(radius_km=r, k=50, constraints=c) for r in (3, 20) for c in ([], ["electric_only"])]
QUERY = gaussian_unit(np.random.default_rng(99), 1)[0]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def host_on(data_dir: Path) -> AsyncIterator[IndexHost]:
    board = Board("worker")
    try:
        async with open_index_host(make_settings(data_dir), board, DIM) as host:
            yield host
    finally:
        board.close()


def state(table: FleetTable) -> State:
    """Every driver's record and vector bytes, and the answers to ``ORDERS``."""
    drivers = {}
    for driver_id in table.driver_ids():
        vector = table.get_vector(driver_id)
        assert vector is not None
        drivers[driver_id] = (table.get_driver(driver_id), vector.tobytes())
    return drivers, [table.recommend(o, QUERY) for o in ORDERS]


def crash_copy(data_dir: Path, to: Path) -> Path:
    """The index directory as a kill -9 now would leave it (acknowledged = on disk)."""
    shutil.copytree(data_dir / "index", to / "index")
    return to


def log_dir(data_dir: Path) -> Path:
    return data_dir / "index" / LOG_DIR


def last_segment(data_dir: Path) -> Path:
    return segment_path(log_dir(data_dir), segment_names(log_dir(data_dir))[-1])


def moved(lat: float, lng: float) -> Position:
    return Position(lat=lat, lng=lng, ts=datetime(2026, 12, 1, 10, 0, tzinfo=UTC))


async def history(host: IndexHost) -> None:
    """30 drivers and a snapshot, then every kind of change after it."""
    rng = np.random.default_rng(5)
    near = [
        (SHANGHAI[0] + rng.normal(0, 0.02), SHANGHAI[1] + rng.normal(0, 0.02)) for _ in range(40)
    ]
    energies = ["electric", "diesel"]
    records = [driver(i, *near[i], energy=energies[i % 2]) for i in range(40)]
    await host.upsert_drivers(records[:30], gaussian_unit(rng, 30))
    await host.snapshot()
    await host.upsert_drivers(records[30:], gaussian_unit(rng, 10))  # new, with vectors
    await host.update_driver("D001", position=moved(31.30, 121.50), status=None)
    await host.update_driver("D002", position=None, status="busy")
    await host.update_driver("D031", position=moved(31.20, 121.40), status="offline")
    assert await host.delete_driver("D003")
    assert await host.delete_driver("D032")
    assert not await host.delete_driver("D404")  # unknown: nothing logged
    again = driver(4, *near[4], energy="electric", capacity=300.0)
    await host.upsert_drivers([again], gaussian_unit(rng, 1))  # upserted again: replaced
    await host.upsert_drivers([driver(3, *near[3])], gaussian_unit(rng, 1))  # back after delete
    await host.update_driver("D004", position=moved(31.25, 121.45), status="available")


@pytest.mark.anyio
async def test_changes_after_the_last_snapshot_are_replayed_on_reopen(tmp_path: Path) -> None:
    async with host_on(tmp_path / "data") as host:
        await history(host)
        before = state(host.table)
        crashed = crash_copy(tmp_path / "data", tmp_path / "crashed")
        assert host.changelog.records == 9 + 1  # the first upsert, then nine changes
        assert host.table.seq == 10
    async with host_on(crashed) as reopened:
        assert reopened.table.seq == 10
        assert state(reopened.table) == before
        assert "D003" in reopened.table and "D032" not in reopened.table
        # and it goes on numbering and logging from there
        await reopened.update_driver("D005", position=None, status="offline")
        assert reopened.table.seq == 11


@pytest.mark.anyio
async def test_concurrent_changes_share_one_fsync(tmp_path: Path) -> None:
    async with host_on(tmp_path / "data") as host:
        await history(host)
        flushes = host.changelog.flushes
        ids = [f"D{i:03d}" for i in range(5, 30)]
        await asyncio.gather(
            *(host.update_driver(i, position=moved(31.0, 121.0), status=None) for i in ids)
        )
        assert host.changelog.records == 10 + len(ids)
        # measured: 1 (all 25 are queued before the committer first runs)
        assert host.changelog.flushes - flushes < len(ids) / 2
        crashed = crash_copy(tmp_path / "data", tmp_path / "crashed")
        before = state(host.table)
    async with host_on(crashed) as reopened:
        assert state(reopened.table) == before


@pytest.mark.anyio
@pytest.mark.parametrize("damage", ["cut", "garbage"])
async def test_a_torn_tail_loses_only_the_torn_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    async with host_on(tmp_path / "data") as host:
        await history(host)
        before_last = state(host.table)
        kept = last_segment(tmp_path / "data").stat().st_size
        await host.update_driver("D006", position=moved(31.1, 121.1), status="busy")
        after_last = state(host.table)
        crashed = crash_copy(tmp_path / "data", tmp_path / "crashed")
    segment = last_segment(crashed)
    size = segment.stat().st_size
    if damage == "cut":  # the crash came in the middle of the last append
        os.truncate(segment, size - 3)
        expected, dropped = before_last, size - 3 - kept
    else:  # a frame header and part of a payload, never completed
        with segment.open("ab") as fh:
            fh.write(b"\x40\x00\x00\x00\x12\x34\x56\x78partial")
        expected, dropped = after_last, 15
    with caplog.at_level(logging.WARNING, logger="fleetcache.index"):
        async with host_on(crashed) as reopened:
            assert state(reopened.table) == expected
            await reopened.update_driver("D007", position=None, status="offline")
            expected = state(reopened.table)
    assert f"dropped {dropped} bytes" in caplog.text
    async with host_on(crashed) as again:  # the log goes on after the cut
        assert state(again.table) == expected


@pytest.mark.anyio
async def test_segments_a_snapshot_holds_are_deleted(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with host_on(data) as host:
        await history(host)  # one snapshot after change 1: change 1's segment is gone
        assert segment_names(log_dir(data)) == [2]
        await host.snapshot()  # holds change 10: a new segment for 11 on
        assert segment_names(log_dir(data)) == [11]
        assert last_segment(data).stat().st_size == 0
        await host.snapshot()  # nothing changed: nothing saved, nothing rotated
        assert segment_names(log_dir(data)) == [11]
        await host.update_driver("D001", position=None, status="offline")
        before = state(host.table)
        crashed = crash_copy(data, tmp_path / "crashed")
    assert segment_names(log_dir(data)) == [12]  # the snapshot on the way out
    async with host_on(crashed) as reopened:
        assert state(reopened.table) == before


@pytest.mark.anyio
async def test_a_bad_frame_before_the_last_segment_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "log"
    table = FleetTable(DIM)
    changelog, _ = recover(table, directory)
    records = [driver(i) for i in range(4)]
    vectors = gaussian_unit(np.random.default_rng(1), 4)
    for seq, (record, vector) in enumerate(zip(records, vectors, strict=True), start=1):
        change = Upsert.of(seq, Prepared.of([record]), vector[None, :], table.vocabulary)
        apply(table, change)
        await changelog.append(change)
        if seq == 2:
            await changelog.rotate()
    await changelog.close()
    first = segment_path(directory, 1)
    data = bytearray(first.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte inside the last change of the first segment
    first.write_bytes(bytes(data))
    with pytest.raises(ChangeLogError, match="later segments follow"):
        recover(FleetTable(DIM), directory)


@pytest.mark.anyio
async def test_a_failed_fsync_refuses_every_later_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = FleetTable(DIM)
    changelog, _ = recover(table, tmp_path / "log")
    await changelog.append(Delete(1, "D001"))

    def eio(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(ChangeLogError, match="write failed"):
        await changelog.append(Delete(2, "D002"))
    monkeypatch.undo()  # even once the disk answers again: the file's state is unknown
    with pytest.raises(ChangeLogError, match="no more changes"):
        await changelog.append(Delete(3, "D003"))
    await changelog.rotate()  # upkeep is skipped quietly: the snapshot can still be saved
    await changelog.close()


@pytest.mark.anyio
async def test_one_owner_per_change_log(tmp_path: Path) -> None:
    changelog, _ = recover(FleetTable(DIM), tmp_path / "log")
    with pytest.raises(ChangeLogError, match="another process owns"):
        recover(FleetTable(DIM), tmp_path / "log")
    await changelog.close()
    second, _ = recover(FleetTable(DIM), tmp_path / "log")  # closed: the lock is free
    await second.close()


def test_every_kind_of_change_survives_a_frame() -> None:
    table = FleetTable(DIM)
    prepared = Prepared.of([driver(1), driver(2)])
    vectors = gaussian_unit(np.random.default_rng(2), 2)
    upsert = Upsert.of(1, prepared, vectors, table.vocabulary)
    update = Update(2, "D001", None, "busy")
    move = Move.of(
        3,
        Positions(
            ["D001", "D404"],
            np.array([31.2, 31.3]),
            np.array([121.4, 121.5]),
            np.array([1_796_112_000_000_000, 1_796_112_000_000_001], dtype=np.int64),
            [None, "offline"],
        ),
    )
    for change in (upsert, update, move, Delete(4, "D002")):
        [(end, payload)] = list(frames(encode(change)))
        assert end == len(encode(change))
        assert decode(payload) == change
    [(_, payload)] = list(frames(encode(upsert)))
    decoded = decode(payload)
    assert isinstance(decoded, Upsert)
    assert np.array_equal(decoded.rows(), vectors)


def test_an_upsert_made_under_another_vocabulary_is_rebuilt_from_its_json() -> None:
    records = [driver(1, status="busy"), driver(2, energy="electric")]
    vectors = gaussian_unit(np.random.default_rng(3), 2)
    prepared = Prepared.of(records)
    wrong = {name: np.zeros_like(values) for name, values in prepared.fields.items()}
    foreign = Prepared(prepared.ids, prepared.vehicle_ids, prepared.blobs, wrong)
    table, expected = FleetTable(DIM), FleetTable(DIM)
    apply(table, Upsert.of(1, foreign, vectors, table.vocabulary + 1))
    expected.upsert_drivers(records, vectors)
    assert state(table) == state(expected)


def test_a_snapshot_without_a_change_number_loads_as_change_0(tmp_path: Path) -> None:
    table = FleetTable(DIM)
    apply(
        table,
        Upsert.of(
            7,
            Prepared.of([driver(1)]),
            gaussian_unit(np.random.default_rng(4), 1),
            table.vocabulary,
        ),
    )
    assert table.save(tmp_path) == 7
    assert FleetTable.load(tmp_path, DIM).seq == 7
    meta_path = next(tmp_path.glob("snapshot-*")) / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["seq"]  # written before change numbers existed
    meta_path.write_text(json.dumps(meta))
    assert FleetTable.load(tmp_path, DIM).seq == 0


# -- the real thing: a server tree killed with SIGKILL --------------------------------------


@pytest.mark.timeout(300)
def test_every_acknowledged_change_survives_a_kill_9_of_the_whole_server(tmp_path: Path) -> None:
    fleet = generate_fleet(60, seed=11)
    ocean = {"lat": -47.5, "lng": -120.25}
    server = FleetcacheServer(tmp_path, workers=2).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for start in range(0, 60, 20):  # three requests, spread over the workers
                chunk = [json.loads(d.model_dump_json()) for d in fleet[start : start + 20]]
                assert client.put("/v1/fleet/drivers", json={"drivers": chunk}).status_code == 200
            moved_ids = [d.driver_id for d in fleet[:5]]
            for i, driver_id in enumerate(moved_ids):
                body = {
                    "position": {**ocean, "lng": ocean["lng"] + i * 0.001},
                    "status": "available",
                }
                assert client.patch(f"/v1/fleet/drivers/{driver_id}", json=body).status_code == 200
            bulk = [
                {"driver_id": d.driver_id, **ocean, "lat": ocean["lat"] + 0.002 * (i + 1)}
                | {"ts": "2026-12-01T08:00:00Z", "status": "available"}
                for i, d in enumerate(fleet[10:13])
            ]
            answer = client.patch("/v1/fleet/positions", json={"positions": bulk})
            assert answer.json() == {"updated": 3, "stale": 0, "unknown": []}
            moved_ids += [row["driver_id"] for row in bulk]
            busy = fleet[5].driver_id
            assert (
                client.patch(f"/v1/fleet/drivers/{busy}", json={"status": "busy"}).status_code
                == 200
            )
            deleted = [d.driver_id for d in fleet[6:10]]
            for driver_id in deleted:
                assert client.delete(f"/v1/fleet/drivers/{driver_id}").status_code == 200
            expected = {d.driver_id: client.get(f"/v1/fleet/drivers/{d.driver_id}") for d in fleet}
    finally:
        # a crash: the whole tree at once, no SIGTERM, no snapshot on the way out
        assert server.process is not None
        crash(server.process.pid)
        server.process.wait(10)
        server.process = None
    assert not list((tmp_path / "data" / "index").glob("snapshot-*")), "it saved a snapshot"
    again = FleetcacheServer(tmp_path, workers=2).start()
    try:
        with httpx.Client(base_url=again.url, timeout=30) as client:
            for driver_id, answer in expected.items():
                now = client.get(f"/v1/fleet/drivers/{driver_id}")
                assert now.status_code == answer.status_code, driver_id
                assert now.json() == answer.json(), driver_id
            assert {
                driver_id for driver_id in expected if expected[driver_id].status_code == 404
            } == set(deleted)
            assert expected[busy].json()["status"] == "busy"
            pickup = {"order_id": "O1", "pickup": ocean, "radius_km": 5, "k": 20}
            found = client.post("/v1/dispatch/recommend", json=pickup)
            assert found.status_code == 200, found.text
            assert sorted(c["driver_id"] for c in found.json()["candidates"]) == sorted(moved_ids)
    finally:
        again.stop()
