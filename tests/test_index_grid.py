"""The geo grid's arena (``indexes.geo``): every point's row, payload included, follows it
through moves across cells, removes, renames, full blocks moving and the arena being rebuilt;
the radius test agrees with haversine to the last bit, on the circle included."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from features.geo import haversine_km, haversine_km_many
from indexes import GeoGrid
from indexes import geo as geo_module
from tests.test_index import clamp_lat, wrap_lng

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
