"""Bulk positions with times (``FleetTable.move``, API.md "Fleet positions in bulk"): stale
updates dropped against the driver's stored time, the newest of a batch applied, unknown ids
skipped, all-or-nothing validation, and times that survive snapshots and old change logs."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.models import DriverRecord, Position
from indexes import FleetTable, Moved, Prepared, timestamp_us
from indexes import changes as changes_module
from indexes.columns import NO_TS
from tests.test_index import (
    CENTERS,
    DIM,
    SHANGHAI,
    STATUSES,
    assert_consistent,
    assert_recommendation,
    brute_force,
    driver,
    drivers,
    order,
    orders,
    positions,
    quantized_unit,
)

T0 = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
Fleet = dict[str, tuple[DriverRecord, np.ndarray]]


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def us(seconds: float) -> int:
    return timestamp_us(at(seconds))


def timed(rec: DriverRecord, seconds: float | None) -> DriverRecord:
    """``rec`` with its position stamped ``seconds`` after T0 (None: no time)."""
    ts = None if seconds is None else at(seconds)
    pos = Position(lat=rec.position.lat, lng=rec.position.lng, ts=ts)
    return rec.model_copy(update={"position": pos})


def move(
    table: FleetTable,
    rows: list[tuple[str, float, float, float]],
    statuses: list[str | None] | None = None,
) -> Moved:
    """``table.move`` of (driver_id, lat, lng, seconds after T0) rows."""
    return table.move(
        [r[0] for r in rows],
        [r[1] for r in rows],
        [r[2] for r in rows],
        np.array([us(r[3]) for r in rows], dtype=np.int64),
        statuses,
    )


def expected_moves(
    fleet: Fleet,
    rows: list[tuple[str, float, float, float]],
    statuses: list[str | None] | None,
) -> Moved:
    """API.md's rules, row by row, applied to ``fleet`` (the model): what ``move`` answers."""
    applied = np.zeros(len(rows), dtype=bool)
    unknown = [d for d in dict.fromkeys(r[0] for r in rows) if d not in fleet]
    newest: dict[str, int] = {}
    for i, (driver_id, _, _, seconds) in enumerate(rows):
        if driver_id in fleet and (
            driver_id not in newest or seconds >= rows[newest[driver_id]][3]
        ):
            newest[driver_id] = i
    for driver_id, i in newest.items():
        rec, vec = fleet[driver_id]
        _, lat, lng, seconds = rows[i]
        stored = rec.position.ts
        if stored is not None and at(seconds) < stored:
            continue
        applied[i] = True
        update: dict[str, object] = {"position": Position(lat=lat, lng=lng, ts=at(seconds))}
        if statuses is not None and statuses[i] is not None:
            update["status"] = statuses[i]
        fleet[driver_id] = (rec.model_copy(update=update), vec)
    known = sum(r[0] in fleet for r in rows)
    return Moved(applied, known - int(applied.sum()), unknown)


def assert_moved(got: Moved, expected: Moved) -> None:
    assert got.applied.dtype == np.bool_
    assert got.applied.tolist() == expected.applied.tolist()
    assert (got.stale, got.unknown) == (expected.stale, expected.unknown)


# A few distinct times, so that equal, older and newer times all happen often.
SECONDS = st.sampled_from([0.0, 1.0, 1.5, 2.0, 60.0])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_moves_follow_the_stale_rules_and_recommend_matches_brute_force(
    data: st.DataObject,
) -> None:
    center = data.draw(CENTERS, label="center")
    fleet: Fleet = {}
    batch = data.draw(st.lists(drivers(center), min_size=1, max_size=12), label="fleet")
    stamps = data.draw(st.lists(st.none() | SECONDS, min_size=len(batch), max_size=len(batch)))
    batch = [timed(rec, s) for rec, s in zip(batch, stamps, strict=True)]
    vecs = np.stack([quantized_unit(i) for i in range(len(batch))])
    table = FleetTable(DIM)
    table.upsert_drivers(batch, vecs)
    for rec, vec in zip(batch, vecs, strict=True):
        fleet[rec.driver_id] = (rec, vec)
    names = [*fleet, "D900", "ghost"]  # two ids never upserted
    for _ in range(data.draw(st.integers(1, 4), label="calls")):
        size = data.draw(st.integers(0, 10), label="rows")
        rows = []
        for _ in range(size):
            p = data.draw(positions(center), label="to")
            rows.append((data.draw(st.sampled_from(names)), p.lat, p.lng, data.draw(SECONDS)))
        statuses = data.draw(
            st.none()
            | st.lists(st.none() | st.sampled_from(STATUSES), min_size=size, max_size=size),
            label="statuses",
        )
        expected = expected_moves(fleet, rows, statuses)
        assert_moved(move(table, rows, statuses), expected)
        for _ in range(2):
            o = data.draw(orders(center), label="order")
            q = quantized_unit(data.draw(st.integers(0, 10**6), label="query seed"))
            considered, ranked = brute_force(fleet, o, q)
            assert_recommendation(table.recommend(o, q), considered, ranked, o.k)
    assert_consistent(table, fleet)


def test_stale_equal_newer_and_untimed_drivers() -> None:
    table = FleetTable(DIM)
    recs = [timed(driver(1), 10.0), timed(driver(2), 10.0), timed(driver(3), None)]
    table.upsert_drivers(recs, np.stack([quantized_unit(i) for i in range(3)]))
    lat, lng = SHANGHAI[0] + 0.01, SHANGHAI[1]
    moved = move(
        table, [("D001", lat, lng, 9.0), ("D002", lat, lng, 10.0), ("D003", lat, lng, -1e6)]
    )
    assert moved.applied.tolist() == [False, True, True]
    assert (moved.stale, moved.unknown) == (1, [])
    assert table.get_driver("D001") == recs[0]  # older than its stored time: ignored
    assert table.get_driver("D002").position == Position(lat=lat, lng=lng, ts=at(10.0))  # type: ignore[union-attr]
    assert table.get_driver("D003").position == Position(lat=lat, lng=lng, ts=at(-1e6))  # type: ignore[union-attr]
    # Once moved, the update's time is the one later updates are compared with.
    later = move(table, [("D003", SHANGHAI[0], lng, -2e6), ("D002", SHANGHAI[0], lng, 11.0)])
    assert later.applied.tolist() == [False, True] and later.stale == 1
    rec = table.get_driver("D003")
    assert rec is not None and rec.position.lat == lat


def test_a_single_update_older_than_the_stored_time_changes_nothing() -> None:
    """``update_driver`` (the single PATCH) keeps ``move``'s rule: a late position is
    ignored with the status sent beside it; an equal time or no time applies."""
    table = FleetTable(DIM)
    rec = timed(driver(1), 10.0)
    table.upsert_drivers([rec], quantized_unit(1)[None])
    lat, lng = SHANGHAI[0] + 0.01, SHANGHAI[1]
    late = table.update_driver(
        "D001", position=Position(lat=lat, lng=lng, ts=at(9.0)), status="busy"
    )
    assert late == rec == table.get_driver("D001")
    same = table.update_driver("D001", position=Position(lat=lat, lng=lng, ts=at(10.0)))
    assert same.position.lat == lat and table.get_driver("D001") == same
    untimed = table.update_driver("D001", position=Position(lat=lat + 0.01, lng=lng))
    assert untimed.position == Position(lat=lat + 0.01, lng=lng)
    assert table.update_driver("D001", status="busy").status == "busy"


def test_several_rows_for_one_driver_the_newest_wins_ties_the_last() -> None:
    table = FleetTable(DIM)
    table.upsert_drivers([driver(1), driver(2)], np.stack([quantized_unit(1), quantized_unit(2)]))
    lat = SHANGHAI[0]
    rows = [
        ("D001", lat + 0.01, 121.0, 5.0),
        ("D001", lat + 0.02, 121.0, 7.0),  # newest of D001
        ("D001", lat + 0.03, 121.0, 6.0),
        ("D002", lat + 0.04, 121.0, 3.0),
        ("D002", lat + 0.05, 121.0, 3.0),  # a tie: the last row wins
        ("nobody", lat, 121.0, 9.0),
        ("D002", lat + 0.06, 121.0, 2.0),
        ("nobody", lat, 121.0, 9.0),
        ("ghost", lat, 121.0, 9.0),
    ]
    moved = move(table, rows)
    assert moved.applied.tolist() == [False, True, False, False, True, False, False, False, False]
    assert moved.stale == 4
    assert moved.unknown == ["nobody", "ghost"]
    assert table.get_driver("D001").position.lat == lat + 0.02  # type: ignore[union-attr]
    assert table.get_driver("D002").position.lat == lat + 0.05  # type: ignore[union-attr]


def test_a_status_row_changes_grid_membership_and_constraint_bits() -> None:
    table = FleetTable(DIM)
    q = quantized_unit(1)
    table.upsert_drivers([driver(1, status="busy"), driver(2)], np.stack([q, quantized_unit(2)]))
    assert table.recommend(order(), q).considered == 1
    lat, lng = SHANGHAI
    moved = move(
        table, [("D001", lat, lng, 1.0), ("D002", lat, lng, 1.0)], ["available", "offline"]
    )
    assert moved.applied.all()
    got = table.recommend(order(), q)
    assert got.considered == 1 and [c.driver_id for c in got.candidates] == ["D001"]
    assert table.get_driver("D002").status == "offline"  # type: ignore[union-attr]
    # A stale row's status is ignored with its position; None keeps the status.
    moved = move(table, [("D001", lat, lng, 0.0), ("D002", lat, lng, 2.0)], ["busy", None])
    assert moved.applied.tolist() == [False, True]
    assert table.get_driver("D001").status == "available"  # type: ignore[union-attr]
    assert table.get_driver("D002").status == "offline"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("lats", "lngs", "seconds", "statuses", "match"),
    [
        ([31.0, 91.0], [121.0, 121.0], [1.0, 1.0], None, "row 1: position out of range"),
        ([31.0, 31.0], [121.0, float("nan")], [1.0, 1.0], None, "row 1: position out of range"),
        ([float("inf"), 31.0], [121.0, 121.0], [1.0, 1.0], None, "row 0: position"),
        ([31.0, 31.0], [121.0, 121.0], [1.0, 1.0], [None, "asleep"], "row 1: status must be"),
        ([31.0], [121.0], [1.0, 1.0], None, "2 driver ids but lats"),
    ],
)
def test_a_bad_row_is_a_value_error_naming_it_and_changes_nothing(
    lats: list[float],
    lngs: list[float],
    seconds: list[float],
    statuses: list[str | None] | None,
    match: str,
) -> None:
    table = FleetTable(DIM)
    table.upsert_drivers([driver(1), driver(2)], np.stack([quantized_unit(1), quantized_unit(2)]))
    before = [table.get_driver("D001"), table.get_driver("D002")]
    ts = np.array([us(s) for s in seconds], dtype=np.int64)
    with pytest.raises(ValueError, match=match):
        table.move(["D001", "D002"], lats, lngs, ts, statuses)
    assert [table.get_driver("D001"), table.get_driver("D002")] == before
    assert move(table, [("D001", 31.0, 121.0, -5.0)]).applied.tolist() == [True]  # no time kept


def test_times_outside_datetime_range_or_not_integers_are_refused() -> None:
    table = FleetTable(DIM)
    table.upsert_drivers([driver(1)], quantized_unit(1)[None, :])
    for bad in (NO_TS, np.iinfo(np.int64).max):
        with pytest.raises(ValueError, match="row 0: ts_us"):
            table.move(["D001"], [31.0], [121.0], np.array([bad], dtype=np.int64))
    with pytest.raises(ValueError, match="integer microseconds"):
        table.move(["D001"], [31.0], [121.0], np.array([1.5]))  # type: ignore[arg-type]
    assert table.get_driver("D001") == driver(1)


def test_timestamp_us_takes_naive_times_as_utc_and_read_back_is_utc() -> None:
    shanghai = timezone(timedelta(hours=8))
    assert timestamp_us(datetime(1970, 1, 1, 0, 0, 1)) == 1_000_000
    assert timestamp_us(datetime(1970, 1, 1, 8, 0, 1, 5, tzinfo=shanghai)) == 1_000_005
    table = FleetTable(DIM)
    table.upsert_drivers([driver(1)], quantized_unit(1)[None, :])
    table.move(["D001"], [31.0], [121.0], np.array([1_000_005], dtype=np.int64))
    ts = table.get_driver("D001").position.ts  # type: ignore[union-attr]
    assert ts == datetime(1970, 1, 1, 0, 0, 1, 5, tzinfo=UTC) and ts.tzinfo is not None


def test_update_driver_and_update_positions_keep_the_time_move_compares_with() -> None:
    table = FleetTable(DIM)
    table.upsert_drivers([driver(1), driver(2)], np.stack([quantized_unit(1), quantized_unit(2)]))
    naive = datetime(2026, 12, 1, 10, 0, 30)  # taken as UTC
    rec = table.update_driver("D001", position=Position(lat=31.0, lng=121.0, ts=naive))
    assert rec == table.get_driver("D001") and rec.position.ts == at(30.0)
    table.update_positions(["D002"], [31.0], [121.0], ts=at(20.0))
    moved = move(table, [("D001", 31.1, 121.0, 29.0), ("D002", 31.1, 121.0, 21.0)])
    assert moved.applied.tolist() == [False, True]
    # update_driver without a time leaves none: any later time applies.
    table.update_driver("D001", position=Position(lat=31.0, lng=121.0))
    assert move(table, [("D001", 31.2, 121.0, -100.0)]).applied.tolist() == [True]


def _fleet_with_times() -> FleetTable:
    table = FleetTable(DIM)
    recs = [timed(driver(i, 31.2 + i / 100), 100.0 if i % 2 else None) for i in range(6)]
    table.upsert_drivers(recs, np.stack([quantized_unit(i) for i in range(6)]))
    move(table, [("D002", 31.3, 121.4, 50.0), ("D003", 31.3, 121.4, 200.0)])
    table.update_driver("D004", status="busy")
    return table


def _probe(table: FleetTable) -> list[bool]:
    """Which of D000..D005 accept a move at T0 + 150 s (their stored times, read back)."""
    ids = [f"D{i:03d}" for i in range(6)]
    ts = np.full(6, us(150.0), dtype=np.int64)
    return table.move(ids, [31.25] * 6, [121.45] * 6, ts).applied.tolist()


# D000 none, D001 100 s (record), D002 50 s (moved), D003 200 s (moved), D004 none, D005 100 s
PROBE = [True, True, True, False, True, True]


def test_times_survive_a_snapshot_round_trip(tmp_path: Path) -> None:
    table = _fleet_with_times()
    table.save(tmp_path)
    loaded = FleetTable.load(tmp_path, DIM)
    for driver_id in table.driver_ids():
        assert loaded.get_driver(driver_id) == table.get_driver(driver_id)
    assert _probe(loaded) == _probe(table) == PROBE


def write_format_2(root: Path) -> None:
    """Rewrite the live snapshot under ``root`` as the previous version wrote it (format 2):
    no ``ts`` in columns.npz, moved rows' times as ISO strings in ids.json."""
    live = root / (root / "CURRENT").read_text().strip()
    with np.load(live / "columns.npz") as npz:
        arrays = {name: npz[name] for name in npz.files}
    ts = arrays.pop("ts")
    with (live / "columns.npz").open("wb") as fh:
        np.savez(fh, allow_pickle=False, **arrays)
    ids = json.loads((live / "ids.json").read_text())
    ids["ts"] = {
        str(row): (T0 + timedelta(microseconds=int(ts[row]) - us(0.0))).isoformat()
        for row in np.flatnonzero(arrays["moved"] & (ts != NO_TS)).tolist()
    }
    (live / "ids.json").write_text(json.dumps(ids))
    meta = json.loads((live / "meta.json").read_text())
    meta["format"] = 2
    (live / "meta.json").write_text(json.dumps(meta))


def test_a_format_2_snapshot_still_loads_with_its_times(tmp_path: Path) -> None:
    table = _fleet_with_times()
    table.save(tmp_path)
    write_format_2(tmp_path)
    loaded = FleetTable.load(tmp_path, DIM)
    for driver_id in table.driver_ids():
        assert loaded.get_driver(driver_id) == table.get_driver(driver_id)
    assert _probe(loaded) == PROBE


def test_an_older_change_log_upsert_without_times_gives_a_correct_table() -> None:
    """Upserts logged before the ts column carry no ``ts`` field: it comes from the JSON."""
    recs = [timed(driver(1), 100.0), timed(driver(2), None)]
    vecs = np.stack([quantized_unit(1), quantized_unit(2)])
    table = FleetTable(DIM)
    # Replaced below: their rows' times must not linger.
    table.upsert_drivers([timed(driver(1), 500.0), timed(driver(2), 500.0)], vecs)
    logged = changes_module.Upsert.of(1, Prepared.of(recs), vecs, table.vocabulary)
    old = changes_module.Upsert(
        **{f: getattr(logged, f) for f in logged.__struct_fields__ if f != "fields"},
        fields=[f for f in logged.fields if f[0] != "ts"],
    )
    assert len(old.fields) == len(logged.fields) - 1
    changes_module.apply(table, changes_module.decode(changes_module.encode(old)[8:]))
    moved = move(table, [("D001", 31.0, 121.0, 99.0), ("D002", 31.0, 121.0, -9.0)])
    assert moved.applied.tolist() == [False, True]
    assert move(table, [("D001", 31.0, 121.0, 101.0)]).applied.tolist() == [True]


def test_the_same_move_on_equal_tables_leaves_equal_tables(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tables = [_fleet_with_times(), _fleet_with_times()]
    n = 40
    ids = [f"D{int(i):03d}" for i in rng.integers(0, 8, n)]
    lats = SHANGHAI[0] + rng.normal(0, 0.05, n)
    lngs = SHANGHAI[1] + rng.normal(0, 0.05, n)
    ts = np.array([us(float(s)) for s in rng.integers(0, 300, n)], dtype=np.int64)
    statuses = [None if s == "-" else str(s) for s in rng.choice(["-", *STATUSES], n)]
    answers = [t.move(ids, lats, lngs, ts, statuses) for t in tables]
    assert answers[0].applied.tolist() == answers[1].applied.tolist()
    for i, t in enumerate(tables):
        t.save(tmp_path / str(i))
    for name in ("columns.npz", "records.bin", "ids.json", "vectors.npy"):
        one, two = (tmp_path / str(i) / "snapshot-00000001" / name for i in range(2))
        assert one.read_bytes() == two.read_bytes(), name
    q = quantized_unit(4)
    for radius in (1.0, 5.0, 30.0):
        o = order(radius_km=radius, k=5)
        assert tables[0].recommend(o, q) == tables[1].recommend(o, q)
