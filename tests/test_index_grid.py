"""The geo grid's arena (``indexes.geo``): every point's row, payload included, follows it
through moves across cells, removes, renames, full blocks moving and the arena being rebuilt
(and the table's recommend stays exact through all of it); the radius test agrees with
haversine to the last bit, on the circle included."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.geo import haversine_km, haversine_km_many
from features.models import DriverRecord, Position
from indexes import FleetTable, GeoGrid, ranking
from indexes import geo as geo_module
from tests.test_index import (
    CENTERS,
    DIM,
    STATUSES,
    assert_recommendation,
    brute_force,
    clamp_lat,
    drivers,
    orders,
    positions,
    quantized_unit,
    wrap_lng,
)

PAYLOAD = {"tag": ((), np.int64), "vec": ((3,), np.float32)}


def payload_of(ident: int, version: int) -> tuple[int, np.ndarray]:
    return ident * 1000 + version, np.array([ident, version, -ident], dtype=np.float32)


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["move", "move", "many", "insert", "remove", "rename"]),
            st.integers(0, 30),
            st.integers(-4, 4),
            st.integers(-4, 4),
        ),
        max_size=120,
    ),
    probe=st.tuples(st.integers(-4, 4), st.integers(-4, 4), st.floats(0.0, 40.0)),
)
def test_rows_and_payload_follow_every_point(
    ops: list[tuple[str, int, int, int]], probe: tuple[int, int, float]
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(geo_module, "_COMPACT_AFTER", 0)  # rebuild whenever it may
        mp.setattr(geo_module, "_MIN_BLOCK", 1)  # blocks fill and move often
        run_ops(ops, probe)


def run_ops(ops: list[tuple[str, int, int, int]], probe: tuple[int, int, float]) -> None:
    grid = GeoGrid(0.05, payload=PAYLOAD)
    points: dict[int, tuple[float, float]] = {}
    tags: dict[int, int] = {}
    version = 0

    def where(dlat: int, dlng: int) -> tuple[float, float]:
        return 31.2 + dlat * 0.03, 121.4 + dlng * 0.03  # cells of 0.05 degrees: neighbours

    def tag(ident: int) -> None:
        nonlocal version
        version += 1
        value, vec = payload_of(ident, version)
        grid.put(np.array([ident]), "tag", value)
        grid.put(np.array([ident]), "vec", vec[None, :])
        tags[ident] = value

    for op, ident, dlat, dlng in ops:
        lat, lng = where(dlat, dlng)
        if op == "move":
            fresh = ident not in points
            grid.move(ident, lat, lng)
            points[ident] = (lat, lng)
            if fresh:
                tag(ident)
        elif op == "many" and points:
            ids = sorted(points)[: ident % 5 + 1]
            to = [where((dlat + i) % 9 - 4, (dlng * i) % 9 - 4) for i in range(len(ids))]
            grid.move_many(ids, [p[0] for p in to], [p[1] for p in to])
            points.update(zip(ids, to, strict=True))
        elif op == "insert" and ident not in points:
            new = [i for i in range(ident, ident + 3) if i not in points]
            grid.insert_many(new, [lat] * len(new), [lng] * len(new))
            for i in new:
                points[i] = (lat, lng)
                tag(i)
        elif op == "remove":
            assert grid.remove(ident) == (ident in points)
            points.pop(ident, None)
            tags.pop(ident, None)
        elif op == "rename" and ident in points and ident + 40 not in points:
            grid.rename(ident, ident + 40)
            points[ident + 40] = points.pop(ident)
            tags[ident + 40] = tags.pop(ident)  # the payload goes with the point
        assert_grid_rows(grid, points, tags)
    qlat, qlng = where(probe[0], probe[1])
    expected = {i for i, (a, b) in points.items() if haversine_km(qlat, qlng, a, b) <= probe[2]}
    assert set(grid.within(qlat, qlng, probe[2]).tolist()) == expected


def assert_grid_rows(
    grid: GeoGrid, points: dict[int, tuple[float, float]], tags: dict[int, int]
) -> None:
    """Positions and tags (the ``vec`` column of a renamed point keeps its old id's)."""
    assert len(grid) == len(points)
    for ident, (lat, lng) in points.items():
        assert grid.position(ident) == (lat, lng)
    rows = grid.near_rows(31.2, 121.4, 200.0)
    ids = grid.column("ids")[rows]
    assert sorted(ids.tolist()) == sorted(points)
    for ident, row in zip(ids.tolist(), rows.tolist(), strict=True):
        assert grid.column("tag")[row] == tags[ident]
        assert int(grid.column("vec")[row][0]) == tags[ident] // 1000


def test_a_point_on_the_circle_is_inside_and_a_hair_beyond_is_not() -> None:
    """The dot-product test defers to haversine near the circle: the answer is haversine's,
    bit for bit, at any radius."""
    rng = np.random.default_rng(5)
    grid = GeoGrid(0.02)
    lat0, lng0 = 31.2304, 121.4737
    lats = lat0 + rng.normal(0, 0.1, 400)
    lngs = lng0 + rng.normal(0, 0.1, 400)
    grid.insert_many(np.arange(400), lats, lngs)
    dist = haversine_km_many(lat0, lng0, lats, lngs)
    for i in rng.choice(400, 60, replace=False).tolist():
        r = float(dist[i])
        assert i in grid.within(lat0, lng0, r).tolist()
        assert i not in grid.within(lat0, lng0, math.nextafter(r, 0.0)).tolist()
        expected = set(np.flatnonzero(dist <= r).tolist())
        ids, got = grid.within_distances(lat0, lng0, r)
        assert set(ids.tolist()) == expected
        assert np.array_equal(got, haversine_km_many(lat0, lng0, lats[ids], lngs[ids]))


def test_the_arena_is_rebuilt_in_cell_order_and_queries_read_few_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(geo_module, "_COMPACT_AFTER", 0)
    grid = GeoGrid(0.02, payload=PAYLOAD)
    rng = np.random.default_rng(1)
    n = 3000
    lats = 31.2 + rng.uniform(-0.1, 0.1, n)
    lngs = 121.4 + rng.uniform(-0.1, 0.1, n)
    for i in range(n):  # one at a time, cells interleaved: blocks fill and move
        grid.move(i, float(lats[i]), float(lngs[i]))
        grid.put(np.array([i]), "tag", i)
    for compacted in (False, True):
        if compacted:
            grid.compact()
        rows = grid.near_rows(31.2, 121.4, 3.0)
        keys = grid.cell_keys(grid.column("lat")[rows], grid.column("lng")[rows])
        runs = 1 + int(np.count_nonzero(np.diff(rows) != 1))
        assert runs <= len(set(keys.tolist()))  # each cell's rows in one run
        assert np.array_equal(grid.column("tag")[rows], grid.column("ids")[rows])
        assert set(grid.column("ids")[rows].tolist()) >= set(grid.within(31.2, 121.4, 3.0).tolist())
    assert list(keys) == sorted(keys)  # cells laid out in key order once rebuilt


@settings(max_examples=30, deadline=None)
@given(
    lat=st.floats(-89.0, 89.0),
    lng=st.floats(-180.0, 180.0),
    radius=st.floats(0.001, 100.0),
    offsets=st.lists(st.tuples(st.floats(-1, 1), st.floats(-1, 1)), min_size=1, max_size=40),
)
def test_within_equals_haversine_everywhere(
    lat: float, lng: float, radius: float, offsets: list[tuple[float, float]]
) -> None:
    grid = GeoGrid(0.05)
    pts = [(clamp_lat(lat + a * radius / 50), wrap_lng(lng + b * radius / 50)) for a, b in offsets]
    grid.insert_many(np.arange(len(pts)), [p[0] for p in pts], [p[1] for p in pts])
    got = set(grid.within(lat, lng, radius).tolist())
    d = haversine_km_many(lat, lng, np.array([p[0] for p in pts]), np.array([p[1] for p in pts]))
    assert got == set(np.flatnonzero(d <= radius).tolist())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_recommend_stays_exact_while_blocks_move_and_the_arena_is_rebuilt(
    data: st.DataObject,
) -> None:
    """The table's recommend reads int8 vectors, bits and cargo from the arena: they must
    follow every driver through full blocks moving and rebuilds (forced here on every
    change), with the first pass on for every order."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(geo_module, "_COMPACT_AFTER", 0)
        mp.setattr(geo_module, "_MIN_BLOCK", 1)
        mp.setattr(ranking, "_EXACT_UP_TO", 0)
        center = data.draw(CENTERS, label="center")
        table = FleetTable(DIM)
        fleet: dict[str, tuple[DriverRecord, np.ndarray]] = {}

        def near(item: Any) -> Any:
            """A record or position pulled to within ~2 km of the centre: a few crowded
            cells, whose blocks fill up."""
            pos = item.position if isinstance(item, DriverRecord) else item
            lat = clamp_lat(center[0] + (pos.lat - center[0]) / 8)
            lng = wrap_lng(center[1] + ((pos.lng - center[1] + 180) % 360 - 180) / 8)
            moved = Position(lat=lat, lng=lng)
            if isinstance(item, DriverRecord):
                return item.model_copy(update={"position": moved})
            return moved

        for _ in range(data.draw(st.integers(1, 10), label="steps")):
            kind = data.draw(st.sampled_from(["upsert", "move", "move", "status", "delete"]))
            ids = list(fleet)
            if kind == "upsert":
                batch = [
                    near(r) for r in data.draw(st.lists(drivers(center), min_size=1, max_size=9))
                ]
                seeds = [data.draw(st.integers(0, 10**6)) for _ in batch]
                vecs = np.stack([quantized_unit(s) for s in seeds])
                if data.draw(st.booleans(), label="one by one"):  # cells grow a row at a time
                    for i in range(len(batch)):
                        table.upsert_drivers(batch[i : i + 1], vecs[i : i + 1])
                else:
                    table.upsert_drivers(batch, vecs)
                fleet.update({r.driver_id: (r, v) for r, v in zip(batch, vecs, strict=True)})
            elif kind == "move" and ids:
                who = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=8))
                to = [near(data.draw(positions(center))) for _ in who]
                table.update_positions(who, [p.lat for p in to], [p.lng for p in to])
                for driver_id, p in zip(who, to, strict=True):
                    rec = fleet[driver_id][0]
                    moved = rec.model_copy(update={"position": Position(lat=p.lat, lng=p.lng)})
                    fleet[driver_id] = (moved, fleet[driver_id][1])
            elif kind == "status" and ids:
                victim = data.draw(st.sampled_from(ids))
                rec = table.update_driver(victim, status=data.draw(st.sampled_from(STATUSES)))
                fleet[victim] = (rec, fleet[victim][1])
            elif kind == "delete" and ids:
                victim = data.draw(st.sampled_from(ids))
                assert table.delete_driver(victim)
                del fleet[victim]
            o = data.draw(orders(center), label="order")
            o = o.model_copy(update={"k": data.draw(st.integers(1, 2), label="k")})  # first pass
            q = quantized_unit(data.draw(st.integers(0, 10**6), label="query"))
            considered, expected = brute_force(fleet, o, q)
            assert_recommendation(table.recommend(o, q), considered, expected, o.k)
