"""The fleet index (indexes/): recommend against brute force, upsert/delete/move semantics,
crash-safe snapshots, the LlamaIndex surface, the batching embedding, and the geo grid."""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from llama_index.core import VectorStoreIndex
from llama_index.core.schema import TextNode
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryResult,
)

from features.constraints import CONSTRAINTS, UnknownConstraintError, satisfies
from features.geo import haversine_km
from features.models import (
    Cargo,
    DriverRecord,
    LatLng,
    Order,
    Position,
    Profile,
    VehicleRecord,
)
from indexes import (
    BatchingEmbedding,
    FleetTable,
    FleetVectorStore,
    GeoGrid,
    Recommendation,
    SnapshotError,
    UnsupportedFilterError,
    VectorError,
    driver_node,
)
from indexes import snapshot as snapshot_module

DIM = 16
SHANGHAI = (31.2304, 121.4737)
STATUSES = ("available", "busy", "offline")
TYPES = ("car", "van", "truck", "e-bike", "motorbike")
ENERGIES = ("electric", "diesel", "gasoline", "hybrid")
# Few distinct values, shared by vehicles and cargo, so "equal fits" happens often.
SIZES = (0.0, 1.0, 2.5, 12.0, 20.0)  # within every size bound (height <= 20 m)
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- helpers ----------------------------------------------------------------------------------


def quantized_unit(seed: int, dim: int = DIM) -> np.ndarray:
    """A unit vector with four entries of +-0.5: every dot product is an exact multiple of
    0.25 in float32, so ties are frequent and similarities compare exactly."""
    rng = np.random.default_rng(seed)
    v = np.zeros(dim, dtype=np.float32)
    v[rng.choice(dim, size=4, replace=False)] = rng.choice([-0.5, 0.5], size=4)
    return v


def gaussian_unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    v = rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def wrap_lng(lng: float) -> float:
    return (lng + 180.0) % 360.0 - 180.0


def clamp_lat(lat: float) -> float:
    return min(90.0, max(-90.0, lat))


def driver(
    i: int | str,
    lat: float = SHANGHAI[0],
    lng: float = SHANGHAI[1],
    *,
    status: str = "available",
    vtype: str = "van",
    energy: str = "diesel",
    capacity: float = 1200.0,
    volume: float = 8.0,
    height: float = 1.7,
    refrigerated: bool = False,
    tail_lift: bool = False,
    certifications: Sequence[str] = (),
    languages: Sequence[str] = ("zh",),
) -> DriverRecord:
    name = i if isinstance(i, str) else f"D{i:03d}"
    return DriverRecord(
        driver_id=name,
        status=status,
        position=Position(lat=lat, lng=lng),
        vehicle=VehicleRecord(
            vehicle_id="V" + name[1:],
            type=vtype,
            energy=energy,
            capacity_kg=capacity,
            cargo_volume_m3=volume,
            cargo_height_m=height,
            refrigerated=refrigerated,
            tail_lift=tail_lift,
        ),
        profile=Profile(certifications=list(certifications), languages=list(languages)),
    )


def order(
    lat: float = SHANGHAI[0],
    lng: float = SHANGHAI[1],
    *,
    radius_km: float = 5.0,
    k: int = 10,
    constraints: Sequence[str] = (),
    cargo: Cargo | None = None,
) -> Order:
    return Order(
        order_id="O1",
        pickup=LatLng(lat=lat, lng=lng),
        radius_km=radius_km,
        k=k,
        constraints=list(constraints),
        cargo=cargo,
    )


@dataclass(frozen=True)
class Expected:
    driver_id: str
    vehicle_id: str
    similarity: float
    distance_km: float


def off_the_circle(ok: bool) -> None:
    assert ok, "a driver sits on the circle: rounding decides, pick another seed"


def brute_force(
    fleet: dict[str, tuple[DriverRecord, np.ndarray]],
    o: Order,
    q: np.ndarray,
    require: Callable[[bool], object] = assume,
) -> tuple[int, list[Expected]]:
    """API.md's rules, one driver at a time: (considered, every candidate in order)."""
    considered = 0
    found = []
    for rec, vec in fleet.values():
        if rec.status != "available":
            continue
        d = haversine_km(o.pickup.lat, o.pickup.lng, rec.position.lat, rec.position.lng)
        # A point within a hair of the circle is decided by rounding: not a meaningful case.
        require(abs(d - o.radius_km) > 1e-7)
        if d > o.radius_km:
            continue
        considered += 1
        if not satisfies(rec, o.constraints, o.cargo):
            continue
        sim = float(np.dot(vec.astype(np.float64), q.astype(np.float64)))
        found.append(Expected(rec.driver_id, rec.vehicle.vehicle_id, sim, d))
    found.sort(key=lambda e: (-e.similarity, e.distance_km, e.driver_id))
    return considered, found


def assert_recommendation(
    got: Recommendation,
    considered: int,
    expected: list[Expected],
    k: int,
    sim_tol: float = 0.0,
    dist_tol: float = 1e-9,
    score: Callable[[str], float] | None = None,
) -> None:
    """``got`` is a correct top-k of ``expected``. Keys closer than the tolerances (float noise
    between the scalar reference and the vectorised table) may come in either order, unless
    ``score`` gives the table's own (float32) similarity of a driver: a near tie with the
    last candidate is then decided exactly as API.md says, by that score, then distance."""
    assert got.considered == considered
    cands = got.candidates
    assert len(cands) == min(k, len(expected))
    by_id = {e.driver_id: e for e in expected}
    for c in cands:
        e = by_id[c.driver_id]
        assert c.vehicle_id == e.vehicle_id
        assert isinstance(c.similarity, float)
        assert isinstance(c.distance_km, float)
        assert abs(c.similarity - e.similarity) <= sim_tol
        assert abs(c.distance_km - e.distance_km) <= dist_tol
    keys = [(-c.similarity, c.distance_km, c.driver_id) for c in cands]
    assert keys == sorted(keys)  # the table's own order is exact
    if cands:
        last = by_id[cands[-1].driver_id]
        chosen = {c.driver_id for c in cands}
        for e in expected:
            if e.driver_id in chosen:
                continue
            better_sim = e.similarity > last.similarity + sim_tol
            near = abs(e.similarity - last.similarity) <= sim_tol
            if near and score is not None:
                mine, theirs = score(e.driver_id), cands[-1].similarity
                better_sim = mine > theirs
                near = mine == theirs
            closer = near and e.distance_km < last.distance_km - dist_tol
            assert not (better_sim or closer), f"{e} should have been chosen before {last}"
    near_ties = any(
        abs(a.similarity - b.similarity) <= sim_tol and abs(a.distance_km - b.distance_km) <= 1e-6
        for a, b in itertools.pairwise(expected)
    )
    if not near_ties:
        assert [c.driver_id for c in cands] == [e.driver_id for e in expected[:k]]


def scorer(table: FleetTable, q: np.ndarray) -> Callable[[str], float]:
    """A driver's similarity as the table computes it (``search`` restricted to the driver
    scores with ``recommend``'s kernel: bit for bit the same)."""
    return lambda driver_id: table.search(q, 1, driver_ids=[driver_id])[0][1]


def vector_of(table: FleetTable, driver_id: str) -> np.ndarray:
    vec = table.get_vector(driver_id)
    assert vec is not None, driver_id
    return vec


def faiss_ids(table: FleetTable) -> list[int]:
    """The ids of the live vectors (one per row of the FAISS index)."""
    ids = table.vector_ids()
    assert len(ids) == table.flat.ntotal
    return ids


def faiss_vectors(table: FleetTable) -> np.ndarray:
    index = table.flat
    return index.reconstruct_n(0, index.ntotal)


def llama_query(table: FleetTable, query: VectorStoreQuery) -> VectorStoreQueryResult:
    """``query`` through a LlamaIndex store over ``table``."""
    return FleetVectorStore(table=table).query(query)


def retrievable(table: FleetTable, driver_id: str, vec: np.ndarray) -> float | None:
    """The similarity FAISS reports for this driver and vector, or None if not found."""
    res = llama_query(
        table,
        VectorStoreQuery(query_embedding=vec.tolist(), similarity_top_k=1, node_ids=[driver_id]),
    )
    assert res.ids is not None and res.similarities is not None
    if not res.ids:
        return None
    assert res.ids == [driver_id]
    return res.similarities[0]


def assert_consistent(table: FleetTable, model: dict[str, tuple[DriverRecord, np.ndarray]]) -> None:
    assert len(table) == len(model) == table.flat.ntotal
    ids = faiss_ids(table)
    assert len(set(ids)) == len(ids)
    for driver_id, (rec, vec) in model.items():
        assert driver_id in table
        assert table.get_driver(driver_id) == rec
        stored = table.get_vector(driver_id)
        assert stored is not None and np.array_equal(stored, vec)
    # FAISS holds exactly the model's vectors, each findable under its driver.
    rows = sorted(map(tuple, faiss_vectors(table).tolist()))
    assert rows == sorted(tuple(vec.tolist()) for _, vec in model.values())
    for driver_id, (_, vec) in list(model.items())[:5]:
        assert retrievable(table, driver_id, vec) == pytest.approx(1.0, abs=1e-6)


# -- strategies -------------------------------------------------------------------------------

CENTERS = st.sampled_from(
    [SHANGHAI, (51.5, -0.12), (0.0, 179.95), (-33.9, -179.9), (89.9, 10.0), (-89.95, -170.0)]
)


@st.composite
def positions(draw: st.DrawFn, center: tuple[float, float]) -> Position:
    dlat = draw(st.floats(-0.15, 0.15, allow_nan=False))
    dlng = draw(st.floats(-0.15, 0.15, allow_nan=False))
    return Position(lat=clamp_lat(center[0] + dlat), lng=wrap_lng(center[1] + dlng))


@st.composite
def drivers(draw: st.DrawFn, center: tuple[float, float]) -> DriverRecord:
    pos = draw(positions(center))
    return driver(
        draw(st.integers(0, 19)),
        pos.lat,
        pos.lng,
        status=draw(st.sampled_from(STATUSES)),
        vtype=draw(st.sampled_from(TYPES)),
        energy=draw(st.sampled_from(ENERGIES)),
        capacity=draw(st.sampled_from(SIZES)),
        volume=draw(st.sampled_from(SIZES)),
        height=draw(st.sampled_from(SIZES)),
        refrigerated=draw(st.booleans()),
        tail_lift=draw(st.booleans()),
        certifications=draw(st.lists(st.sampled_from(["hazmat", "forklift"]), unique=True)),
        languages=draw(st.lists(st.sampled_from(["zh", "en", "fr"]), unique=True)),
    )


@st.composite
def orders(draw: st.DrawFn, center: tuple[float, float]) -> Order:
    pickup = draw(positions(center))
    cargo = draw(
        st.none()
        | st.builds(
            Cargo,
            weight_kg=st.sampled_from(SIZES),
            volume_m3=st.sampled_from(SIZES),
            height_m=st.sampled_from(SIZES),
        )
    )
    return order(
        pickup.lat,
        pickup.lng,
        radius_km=draw(st.floats(0.5, 30.0)),
        k=draw(st.integers(1, 8)),
        constraints=draw(st.lists(st.sampled_from(sorted(CONSTRAINTS)), unique=True, max_size=3)),
        cargo=cargo,
    )


# -- recommend against brute force ------------------------------------------------------------


@PROPERTY
@given(st.data())
def test_recommend_matches_brute_force_after_random_operations(data: st.DataObject) -> None:
    center = data.draw(CENTERS, label="center")
    table = FleetTable(DIM)
    model: dict[str, tuple[DriverRecord, np.ndarray]] = {}
    seen_ids: set[int] = set()
    ids_ = [f"D{i:03d}" for i in range(20)]
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        kind = data.draw(st.sampled_from(["upsert", "upsert", "delete", "move", "status"]))
        if kind == "upsert":
            batch = data.draw(st.lists(drivers(center), min_size=1, max_size=8), label="batch")
            n = len(batch)
            seeds = data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n))
            vecs = np.stack([quantized_unit(s) for s in seeds])
            table.upsert_drivers(batch, vecs)
            for rec, vec in zip(batch, vecs, strict=True):
                model[rec.driver_id] = (rec, vec)
        elif kind == "delete":
            victim = data.draw(st.sampled_from(ids_), label="delete")
            assert table.delete_driver(victim) == (model.pop(victim, None) is not None)
        elif kind == "move":
            victim = data.draw(st.sampled_from(ids_), label="move")
            pos = data.draw(positions(center), label="to")
            if victim in model:
                rec = table.update_driver(victim, position=pos)
                assert rec.position == pos
                model[victim] = (rec, model[victim][1])
            else:
                with pytest.raises(KeyError):
                    table.update_driver(victim, position=pos)
        else:
            victim = data.draw(st.sampled_from(ids_), label="status of")
            status = data.draw(st.sampled_from(STATUSES), label="status")
            if victim in model:
                rec = table.update_driver(victim, status=status)
                model[victim] = (rec, model[victim][1])
            else:
                with pytest.raises(KeyError):
                    table.update_driver(victim, status=status)
        # FAISS ids are never reused: a new one is larger than every id ever handed out.
        now = set(faiss_ids(table))
        fresh = now - seen_ids
        assert not seen_ids or not fresh or min(fresh) > max(seen_ids)
        seen_ids |= now
    assert_consistent(table, model)
    for _ in range(3):
        o = data.draw(orders(center), label="order")
        q = quantized_unit(data.draw(st.integers(0, 10**6), label="query seed"))
        considered, expected = brute_force(model, o, q)
        assert_recommendation(table.recommend(o, q), considered, expected, o.k)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_recommend_matches_brute_force_on_a_synthetic_fleet(seed: int) -> None:
    synthetic = pytest.importorskip("features.synthetic")
    fleet = synthetic.generate_fleet(1500, seed=seed)
    rng = np.random.default_rng(seed)
    dim = 384  # the real model's: FAISS kernels differ by dimension
    vecs = gaussian_unit(rng, len(fleet), dim)
    table = FleetTable(dim)
    table.upsert_drivers(fleet, vecs)
    model = {r.driver_id: (r, v) for r, v in zip(fleet, vecs, strict=True)}
    for i in range(20):
        anchor = fleet[int(rng.integers(len(fleet)))].position
        o = order(
            anchor.lat,
            anchor.lng,
            radius_km=float(rng.uniform(1, 40)),
            k=int(rng.integers(1, 60)),
            constraints=list(rng.choice(sorted(CONSTRAINTS), size=i % 3, replace=False)),
            cargo=Cargo(weight_kg=float(rng.uniform(0, 800)), volume_m3=1.0) if i % 2 else None,
        )
        q = gaussian_unit(rng, 1, dim)[0]
        considered, expected = brute_force(model, o, q, off_the_circle)
        got = table.recommend(o, q)
        assert_recommendation(got, considered, expected, o.k, sim_tol=1e-5, score=scorer(table, q))
        if i > 1:
            continue
        # The reported similarity is bit for bit the score FAISS's own search gives.
        everyone = llama_query(
            table, VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=2000)
        )
        faiss_scores = dict(zip(everyone.ids or [], everyone.similarities or [], strict=True))
        assert all(c.similarity == faiss_scores[c.driver_id] for c in got.candidates)
        assert all(c.similarity == retrievable(table, c.driver_id, q) for c in got.candidates)


def test_recommend_orders_ties_by_distance_then_driver_id() -> None:
    table = FleetTable(DIM)
    v = quantized_unit(7)
    lat, lng = SHANGHAI
    recs = [
        driver("D005", lat + 0.01, lng),
        driver("D004", lat + 0.01, lng),  # same place as D005: tie broken by driver_id
        driver("D003", lat + 0.02, lng),
        driver("D002", lat, lng),
        driver("D001", lat + 0.03, lng, status="busy"),
    ]
    other = -v
    table.upsert_drivers([*recs, driver("D000", lat, lng)], np.stack([v] * 5 + [other]))
    got = table.recommend(order(lat, lng, k=3), v)
    assert [c.driver_id for c in got.candidates] == ["D002", "D004", "D005"]
    assert got.considered == 5
    assert got.candidates[0].similarity == 1.0
    assert got.candidates[0].distance_km == 0.0
    assert got.candidates[1].distance_km == pytest.approx(1.112, abs=1e-3)


def test_recommend_applies_constraints_and_equal_cargo_fits() -> None:
    table = FleetTable(DIM)
    v = quantized_unit(1)
    table.upsert_drivers(
        [
            driver(1, energy="electric", capacity=300, volume=2.0, height=1.2),  # exact fit
            driver(2, energy="electric", capacity=299.9, volume=2.0, height=1.2),
            driver(3, energy="diesel", capacity=1000, volume=9, height=2),
            driver(4, energy="electric", capacity=1000, volume=9, height=2, status="busy"),
            driver(5, SHANGHAI[0] + 1.0, SHANGHAI[1], energy="electric"),  # 111 km away
        ],
        np.stack([v] * 5),
    )
    cargo = Cargo(weight_kg=300, volume_m3=2.0, height_m=1.2)
    got = table.recommend(order(constraints=["electric_only"], cargo=cargo), v)
    assert [c.driver_id for c in got.candidates] == ["D001"]
    assert got.considered == 3  # available and inside the radius, before constraints/cargo
    with pytest.raises(UnknownConstraintError):
        table.recommend(order(constraints=["teleport"]), v)


def test_recommend_rejects_a_bad_query_vector() -> None:
    table = FleetTable(DIM)
    with pytest.raises(VectorError):
        table.recommend(order(), np.ones(DIM))  # not unit length
    with pytest.raises(VectorError):
        table.recommend(order(), quantized_unit(1)[:-1])
    with pytest.raises(VectorError):
        table.recommend(order(), quantized_unit(1)[None, :])
    with pytest.raises(VectorError):
        table.recommend(order(), "not a vector")


# -- upsert, delete, update -------------------------------------------------------------------


def test_delete_then_insert_keeps_every_live_driver() -> None:
    """The FaissMapVectorStore bug (FACTS.md): insert after delete reused a live id."""
    table = FleetTable(DIM)
    a, b, c = quantized_unit(1), quantized_unit(2), quantized_unit(3)
    table.upsert_drivers([driver("DA"), driver("DB")], np.stack([a, b]))
    assert table.delete_driver("DA")
    table.upsert_drivers([driver("DC")], c[None, :])
    assert retrievable(table, "DB", b) == pytest.approx(1.0)
    assert retrievable(table, "DC", c) == pytest.approx(1.0)
    assert retrievable(table, "DA", a) is None
    assert "DA" not in table and table.get_driver("DA") is None
    ids = faiss_ids(table)
    assert len(ids) == len(set(ids)) == table.flat.ntotal == len(table) == 2
    hits = llama_query(table, VectorStoreQuery(query_embedding=a.tolist(), similarity_top_k=10))
    assert sorted(hits.ids or []) == ["DB", "DC"]
    assert not table.delete_driver("DA")


def test_upsert_replaces_the_vector_and_the_record() -> None:
    table = FleetTable(DIM)
    old, new = quantized_unit(1), quantized_unit(2)
    table.upsert_drivers([driver(1), driver(2)], np.stack([old, quantized_unit(3)]))
    table.upsert_drivers([driver(1, status="busy", vtype="truck")], new[None, :])
    assert table.flat.ntotal == len(table) == 2
    assert np.array_equal(vector_of(table, "D001"), new)
    rec = table.get_driver("D001")
    assert rec is not None and rec.vehicle.type == "truck"
    res = llama_query(table, VectorStoreQuery(query_embedding=old.tolist(), similarity_top_k=5))
    assert res.similarities is not None
    for driver_id, sim in zip(res.ids or [], res.similarities, strict=True):
        if driver_id == "D001":
            assert sim == pytest.approx(float(old @ new))  # the new vector answers
    assert not any(np.array_equal(row, old) for row in faiss_vectors(table))


def test_upsert_with_repeated_driver_id_keeps_the_last() -> None:
    table = FleetTable(DIM)
    first, last = quantized_unit(1), quantized_unit(2)
    table.upsert_drivers([driver(1, status="busy"), driver(1)], np.stack([first, last]))
    assert len(table) == table.flat.ntotal == 1
    assert np.array_equal(vector_of(table, "D001"), last)
    rec = table.get_driver("D001")
    assert rec is not None and rec.status == "available"


@pytest.mark.parametrize(
    "make_vectors",
    [
        lambda: np.stack([quantized_unit(1), quantized_unit(2)]),  # 2 rows for 3 records
        lambda: np.ones((3, DIM + 1), dtype=np.float32) / math.sqrt(DIM + 1),
        lambda: np.stack([quantized_unit(1), quantized_unit(2), np.full(DIM, np.nan)]),
        lambda: np.stack([quantized_unit(1), quantized_unit(2), 2 * quantized_unit(3)]),
        lambda: [["a"] * DIM] * 3,
    ],
    ids=["rows", "dim", "nan", "not-unit", "not-numeric"],
)
def test_upsert_is_all_or_nothing(make_vectors: Any) -> None:
    table = FleetTable(DIM)
    table.upsert_drivers([driver(1)], quantized_unit(9)[None, :])
    before = (faiss_ids(table), faiss_vectors(table).copy(), table.get_driver("D001"))
    with pytest.raises(VectorError):
        table.upsert_drivers([driver(1, status="busy"), driver(2), driver(3)], make_vectors())
    assert (len(table), table.flat.ntotal) == (1, 1)
    assert faiss_ids(table) == before[0]
    assert np.array_equal(faiss_vectors(table), before[1])
    assert table.get_driver("D001") == before[2]
    assert "D002" not in table
    with pytest.raises(TypeError):
        table.upsert_drivers([driver(2).model_dump()], quantized_unit(2)[None, :])  # type: ignore[list-item]
    assert len(table) == 1


def test_update_driver_moves_and_changes_status_without_vector_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = FleetTable(DIM)
    v = quantized_unit(4)
    table.upsert_drivers([driver(1), driver(2, SHANGHAI[0] + 0.5)], np.stack([v, v]))
    ids, vectors = faiss_ids(table), faiss_vectors(table).copy()

    def no_vector_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("update_driver touched FAISS")

    for name in ("add", "add_with_ids", "remove_ids", "reset"):
        monkeypatch.setattr(type(table.flat), name, no_vector_work)
    far = Position(lat=SHANGHAI[0] + 0.5, lng=SHANGHAI[1])
    rec = table.update_driver("D001", position=far, status="busy")
    assert rec.position == far and rec.status == "busy"
    assert table.get_driver("D001") == rec
    assert table.recommend(order(), v).considered == 0  # moved away and busy
    table.update_driver("D001", status="available")
    got = table.recommend(order(far.lat, far.lng), v)
    assert sorted(c.driver_id for c in got.candidates) == ["D001", "D002"]
    with pytest.raises(KeyError):
        table.update_driver("nobody", status="busy")
    with pytest.raises(ValueError, match="status"):
        table.update_driver("D001", status="asleep")
    monkeypatch.undo()
    assert faiss_ids(table) == ids
    assert np.array_equal(faiss_vectors(table), vectors)


# -- snapshots --------------------------------------------------------------------------------


def _populated(n: int = 300, seed: int = 0) -> tuple[FleetTable, list[Order], np.ndarray]:
    rng = np.random.default_rng(seed)
    table = FleetTable(DIM)
    recs = [
        driver(
            i,
            SHANGHAI[0] + float(rng.normal(0, 0.05)),
            SHANGHAI[1] + float(rng.normal(0, 0.05)),
            status=str(rng.choice(STATUSES)),
            energy=str(rng.choice(ENERGIES)),
            capacity=float(rng.choice(SIZES)),
        )
        for i in range(n)
    ]
    table.upsert_drivers(recs, gaussian_unit(rng, n))
    for i in range(0, n, 7):
        table.delete_driver(f"D{i:03d}")
    orders_ = [
        order(radius_km=r, k=20, constraints=c) for r in (2, 5, 12) for c in ([], ["electric_only"])
    ]
    return table, orders_, gaussian_unit(rng, 1)[0]


def _answers(table: FleetTable, orders_: list[Order], q: np.ndarray) -> list[Recommendation]:
    return [table.recommend(o, q) for o in orders_]


def test_save_load_round_trip_answers_identically(tmp_path: Path) -> None:
    table, orders_, q = _populated()
    table.save(tmp_path / "fleet")
    loaded = FleetTable.load(tmp_path / "fleet", DIM)
    assert _answers(loaded, orders_, q) == _answers(table, orders_, q)
    assert sorted(loaded.driver_ids()) == sorted(table.driver_ids())
    for driver_id in table.driver_ids():
        assert loaded.get_driver(driver_id) == table.get_driver(driver_id)
        assert np.array_equal(vector_of(loaded, driver_id), vector_of(table, driver_id))
    # The id counter is persisted: ids handed out after a load are still new.
    before = set(faiss_ids(loaded))
    loaded.upsert_drivers([driver(999)], quantized_unit(1)[None, :])
    assert min(set(faiss_ids(loaded)) - before) > max(before)
    assert sorted(p.name for p in (tmp_path / "fleet").iterdir()) == [
        "CURRENT",
        "snapshot-00000001",
    ]
    snap = tmp_path / "fleet" / "snapshot-00000001"
    assert sorted(p.name for p in snap.iterdir()) == [
        "columns.npz",
        "ids.json",
        "meta.json",
        "records.bin",
        "vectors.npy",
    ]


def test_saving_from_a_thread_while_the_store_changes(tmp_path: Path) -> None:
    table, orders_, q = _populated(200)
    errors: list[BaseException] = []

    def saver() -> None:
        try:
            for _ in range(5):
                table.save(tmp_path)
                FleetTable.load(tmp_path, DIM)  # every published snapshot is whole
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=saver)
    thread.start()
    for i in range(300):
        table.upsert_drivers([driver(2000 + i)], quantized_unit(i)[None, :])
        table.update_driver(f"D{2000 + i}", status="busy")
        table.delete_driver(f"D{2000 + i - 50}")
    thread.join()
    assert not errors
    table.save(tmp_path)
    loaded = FleetTable.load(tmp_path, DIM)
    assert sorted(loaded.driver_ids()) == sorted(table.driver_ids())
    assert _answers(loaded, orders_, q) == _answers(table, orders_, q)


def test_load_of_a_missing_dir_is_an_empty_store(tmp_path: Path) -> None:
    table = FleetTable.load(tmp_path / "nothing-here", DIM)
    assert len(table) == 0 and table.dim == DIM


def test_an_empty_store_saves_and_loads(tmp_path: Path) -> None:
    FleetTable(DIM).save(tmp_path)
    table = FleetTable.load(tmp_path, DIM)
    assert len(table) == 0
    populated, _, _ = _populated(5)
    ids = list(populated.driver_ids())
    table.upsert_drivers(
        [populated.get_driver(i) for i in ids],  # type: ignore[misc]
        np.stack([populated.get_vector(i) for i in ids]),  # type: ignore[misc]
    )
    assert sorted(table.driver_ids()) == sorted(ids)


def test_load_with_another_dim_is_a_clear_error(tmp_path: Path) -> None:
    table, _, _ = _populated(20)
    table.save(tmp_path)
    with pytest.raises(ValueError, match=f"{DIM}-d vectors, expected 32-d"):
        FleetTable.load(tmp_path, 32)


@pytest.mark.parametrize("fail_at", ["records", "meta", "pointer", "replace"])
def test_a_crash_during_save_leaves_the_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: str
) -> None:
    table, orders_, q = _populated()
    table.save(tmp_path)
    previous = _answers(table, orders_, q)
    table.upsert_drivers([driver(1000, status="available")], q[None, :])
    table.delete_driver("D001")

    real_write = snapshot_module.write_durably

    def crashing_write(path: Path, *pieces: bytes) -> None:
        if fail_at in path.name.lower():
            data = b"".join(pieces)
            path.write_bytes(data[: len(data) // 2])  # a torn write, then the crash
            raise OSError("disk on fire")
        real_write(path, *pieces)

    def crashing_replace(*args: Any) -> None:
        raise OSError("power cut")

    names = {"records": "records", "meta": "meta", "pointer": "current"}
    if fail_at == "replace":
        monkeypatch.setattr(os, "replace", crashing_replace)
    else:
        fail_at = names[fail_at]
        monkeypatch.setattr(snapshot_module, "write_durably", crashing_write)
    with pytest.raises(OSError):
        table.save(tmp_path)
    monkeypatch.undo()
    loaded = FleetTable.load(tmp_path, DIM)
    assert _answers(loaded, orders_, q) == previous
    assert "D1000" not in loaded and "D001" in loaded
    # A later save succeeds and publishes the new state.
    table.save(tmp_path)
    assert "D1000" in FleetTable.load(tmp_path, DIM)


def test_debris_of_a_killed_save_is_ignored_then_cleaned(tmp_path: Path) -> None:
    table, orders_, q = _populated(50)
    table.save(tmp_path)
    debris = tmp_path / "snapshot-00000007"  # a save killed before switching CURRENT
    debris.mkdir()
    (debris / "index.faiss").write_bytes(b"\x00garbage")
    (tmp_path / "CURRENT.tmp").write_text("snapshot-00000007")
    assert _answers(FleetTable.load(tmp_path, DIM), orders_, q) == _answers(table, orders_, q)
    table.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["CURRENT", "snapshot-00000002"]


def test_a_corrupt_snapshot_is_a_snapshot_error(tmp_path: Path) -> None:
    table, _, _ = _populated(30)
    snap = snapshot_module.read(tmp_path)
    assert snap is None
    table.save(tmp_path)
    live = tmp_path / (tmp_path / "CURRENT").read_text().strip()
    blob = (live / "records.bin").read_bytes()
    (live / "records.bin").write_bytes(blob[:-10])  # a torn last record
    with pytest.raises(SnapshotError, match="records"):
        FleetTable.load(tmp_path, DIM)
    (tmp_path / "CURRENT").write_text("snapshot-99999999")
    with pytest.raises(SnapshotError):
        FleetTable.load(tmp_path, DIM)
    table.save(tmp_path)  # a save repairs a broken pointer
    assert len(FleetTable.load(tmp_path, DIM)) == len(table)


# -- LlamaIndex surface -----------------------------------------------------------------------


class FakeEmbeddings:
    """LangChain-shaped embeddings: unit vectors from a table (else from a hash), calls logged."""

    def __init__(self, table: dict[str, np.ndarray] | None = None) -> None:
        self.table = table or {}
        self.calls: list[tuple[str, int]] = []

    def _vec(self, text: str) -> list[float]:
        if text in self.table:
            return self.table[text].tolist()
        return quantized_unit(sum(text.encode()) * 7919 + len(text)).tolist()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(("embed_documents", len(texts)))
        return [self._vec(t) for t in texts]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        self.calls.append(("aembed_documents", len(texts)))
        return [self._vec(t) for t in texts]

    def embed_query(self, text: str) -> list[float]:
        self.calls.append(("embed_query", 1))
        return self._vec(text)

    async def aembed_query(self, text: str) -> list[float]:
        self.calls.append(("aembed_query", 1))
        return self._vec(text)


def _fan(n: int) -> np.ndarray:
    """Unit vectors whose cosine with e0 falls as the index grows."""
    angles = np.linspace(0.0, 1.5, n)
    v = np.zeros((n, DIM), dtype=np.float32)
    v[:, 0], v[:, 1] = np.cos(angles), np.sin(angles)
    return v


def _fan_store() -> FleetVectorStore:
    store = FleetVectorStore(DIM)
    recs = [
        driver(0, vtype="van"),
        driver(1, vtype="car"),
        driver(2, vtype="van", status="busy"),
        driver(3, vtype="truck", refrigerated=True),
        driver(4, vtype="van", refrigerated=True),
        driver(5, vtype="truck"),
        driver(6, vtype="van", status="offline"),
        driver(7, vtype="van"),
    ]
    store.table.upsert_drivers(recs, _fan(len(recs)))
    return store


def test_llamaindex_retriever_with_filters_returns_the_expected_drivers() -> None:
    store = _fan_store()
    e0 = np.eye(DIM, dtype=np.float32)[0]
    fake = FakeEmbeddings({"text": e0})
    index = VectorStoreIndex.from_vector_store(store, embed_model=BatchingEmbedding(fake))
    filters = MetadataFilters(
        filters=[
            MetadataFilter(key="status", value="available"),
            MetadataFilter(key="vehicle_type", value=["van", "truck"], operator=FilterOperator.IN),
        ]
    )
    got = index.as_retriever(similarity_top_k=3, filters=filters).retrieve("text")
    assert [n.node.node_id for n in got] == ["D000", "D003", "D004"]
    cosines = np.cos(np.linspace(0.0, 1.5, 8))
    assert [n.score for n in got] == pytest.approx([cosines[0], cosines[3], cosines[4]], abs=1e-6)
    assert got[0].node.metadata["vehicle_id"] == "V000"
    assert fake.calls == [("embed_query", 1)]

    refrigerated = MetadataFilters(filters=[MetadataFilter(key="refrigerated", value=1)])
    got = index.as_retriever(similarity_top_k=3, filters=refrigerated).retrieve("text")
    assert [n.node.node_id for n in got] == ["D003", "D004"]
    either = MetadataFilters(
        filters=[
            MetadataFilter(key="status", value=["busy", "offline"], operator=FilterOperator.IN),
            MetadataFilter(key="energy", value="electric"),
        ],
        condition=FilterCondition.OR,
    )
    got = index.as_retriever(similarity_top_k=5, filters=either).retrieve("text")
    assert [n.node.node_id for n in got] == ["D002", "D006"]


def test_llamaindex_insert_embeds_a_batch_in_one_call() -> None:
    store = FleetVectorStore(DIM)
    fake = FakeEmbeddings()
    index = VectorStoreIndex.from_vector_store(store, embed_model=BatchingEmbedding(fake))
    nodes = [driver_node(driver(i, vtype=TYPES[i % 5])) for i in range(300)]
    index.insert_nodes(nodes)
    assert fake.calls == [("embed_documents", 300)]
    assert len(store.table) == 300
    assert store.table.get_driver("D042") == driver(42, vtype=TYPES[42 % 5])
    res = store.query(
        VectorStoreQuery(
            query_embedding=fake.embed_query("x"), similarity_top_k=4, doc_ids=["D007"]
        )
    )
    assert res.ids == ["D007"]


def test_batching_embedding_sends_each_batch_whole() -> None:
    fake = FakeEmbeddings()
    embed = BatchingEmbedding(fake)
    texts = [f"driver text {i}" for i in range(1000)]
    vectors = embed.get_text_embedding_batch(texts)
    assert fake.calls == [("embed_documents", 1000)]
    assert len(vectors) == 1000 and vectors[3] == fake._vec(texts[3])
    fake.calls.clear()
    vectors = asyncio.run(embed.aget_text_embedding_batch(texts))
    assert fake.calls == [("aembed_documents", 1000)]
    assert vectors[999] == fake._vec(texts[999])
    fake.calls.clear()
    assert embed.get_query_embedding("q") == fake._vec("q")
    assert asyncio.run(embed.aget_text_embedding("t")) == fake._vec("t")
    assert fake.calls == [("embed_query", 1), ("aembed_documents", 1)]


def test_query_filters_that_cannot_be_evaluated_are_named() -> None:
    store = _fan_store()
    q = np.eye(DIM, dtype=np.float32)[0].tolist()
    cases = [
        (MetadataFilter(key="home_zone", value="pudong"), "home_zone"),
        (MetadataFilter(key="status", value="busy", operator=FilterOperator.GT), "'>'"),
        (MetadataFilter(key="tail_lift", value="maybe"), "tail_lift"),
    ]
    for flt, named in cases:
        with pytest.raises(UnsupportedFilterError, match=named):
            store.query(VectorStoreQuery(query_embedding=q, filters=MetadataFilters(filters=[flt])))
    negated = MetadataFilters(
        filters=[MetadataFilter(key="status", value="busy")], condition=FilterCondition.NOT
    )
    with pytest.raises(UnsupportedFilterError, match="not"):
        store.query(VectorStoreQuery(query_embedding=q, filters=negated))


def test_nodes_api_add_get_delete_clear() -> None:
    store = FleetVectorStore(DIM)
    assert store  # an empty store is still truthy: LlamaIndex tests `if vector_store:`
    assert store == store and store != FleetVectorStore(DIM)
    recs = [driver(i, status=STATUSES[i % 3]) for i in range(6)]
    nodes = [driver_node(r, quantized_unit(i)) for i, r in enumerate(recs)]
    assert store.add(nodes) == [r.driver_id for r in recs]
    plain = TextNode(id_="D100", embedding=quantized_unit(100).tolist(), metadata={})
    plain.metadata.update(driver(100).model_dump(mode="json", exclude={"driver_id"}))
    store.add([plain])
    assert store.table.get_driver("D100") == driver(100)
    with pytest.raises(ValueError, match="driver_id"):
        store.add([driver_node(driver(1), quantized_unit(1)).model_copy(update={"id_": "X"})])
    with pytest.raises(VectorError):
        store.add([driver_node(driver(9))])  # no embedding
    busy = MetadataFilters(filters=[MetadataFilter(key="status", value="busy")])
    assert sorted(n.node_id for n in store.get_nodes(filters=busy)) == ["D001", "D004"]
    store.delete_nodes(filters=busy)
    assert sorted(store.table.driver_ids()) == ["D000", "D002", "D003", "D005", "D100"]
    store.delete("D000")
    store.delete_nodes(node_ids=["D002"])
    assert len(store.table) == store.client.ntotal == 3
    before = max(faiss_ids(store.table))
    store.clear()
    assert len(store.table) == store.client.ntotal == 0
    store.add([driver_node(driver(1), quantized_unit(1))])
    assert faiss_ids(store.table)[0] > before  # clear() does not reset the id counter


def test_persist_and_from_persist_path(tmp_path: Path) -> None:
    store = _fan_store()
    store.persist(str(tmp_path / "vs"))
    loaded = FleetVectorStore.from_persist_path(str(tmp_path / "vs"))
    assert loaded.table.dim == DIM
    assert sorted(loaded.table.driver_ids()) == sorted(store.table.driver_ids())
    with pytest.raises(SnapshotError):
        FleetVectorStore.from_persist_path(str(tmp_path / "empty"))
    assert len(FleetVectorStore.from_persist_path(str(tmp_path / "empty"), dim=DIM).table) == 0


def test_a_store_over_an_existing_table_shares_it_both_ways() -> None:
    """``FleetVectorStore(table=...)`` keeps no state of its own: drivers upserted through the
    table answer LlamaIndex queries, nodes added or deleted through the store are the table's,
    and the domain API lives on the table only."""
    table = FleetTable(DIM)
    table.upsert_drivers([driver(i, vtype=TYPES[i % 5]) for i in range(8)], _fan(8))
    store = FleetVectorStore(table=table)
    assert store.table is table and store.client is table.flat
    assert not hasattr(store, "recommend") and not hasattr(store, "upsert_drivers")
    e0 = np.eye(DIM, dtype=np.float32)[0]
    embed = BatchingEmbedding(FakeEmbeddings({"text": e0}))
    index = VectorStoreIndex.from_vector_store(store, embed_model=embed)
    vans = MetadataFilters(filters=[MetadataFilter(key="vehicle_type", value="van")])
    got = index.as_retriever(similarity_top_k=5, filters=vans).retrieve("text")
    assert [n.node.node_id for n in got] == ["D001", "D006"]
    assert [n.node_id for n in store.get_nodes(node_ids=["D007", "nobody", "D002"])] == [
        "D007",
        "D002",
    ]

    index.insert_nodes([driver_node(driver(20, vtype="car"))])  # embedded by the index
    assert table.get_driver("D020") == driver(20, vtype="car")
    store.add([driver_node(driver(21, vtype="car"), e0)])
    best = table.recommend(order(k=2), e0).candidates
    assert [(c.driver_id, c.similarity) for c in best] == [("D000", 1.0), ("D021", 1.0)]
    store.delete("D000")
    table.delete_driver("D001")
    assert "D000" not in table and not store.get_nodes(node_ids=["D001"])
    got = index.as_retriever(similarity_top_k=5, filters=vans).retrieve("text")
    assert [n.node.node_id for n in got] == ["D006"]
    assert len(table) == store.client.ntotal == 8


def test_a_store_needs_dim_or_table() -> None:
    with pytest.raises(ValueError, match="dim"):
        FleetVectorStore()
    with pytest.raises(ValueError, match="not both"):
        FleetVectorStore(DIM, table=FleetTable(DIM))
    with pytest.raises(ValueError, match="dim must be a positive int"):
        FleetVectorStore(0)


# -- geo grid ---------------------------------------------------------------------------------


def _grid_brute_force(
    points: dict[int, tuple[float, float]], lat: float, lng: float, r: float
) -> set[int]:
    out = set()
    for ident, (plat, plng) in points.items():
        d = haversine_km(lat, lng, plat, plng)
        assume(abs(d - r) > 1e-7)
        if d <= r:
            out.add(ident)
    return out


GRID_CENTERS = st.sampled_from(
    [(31.2, 121.5), (0.0, 180.0), (0.0, -180.0), (12.0, 179.99), (-45.0, -179.95),
     (89.99, 0.0), (90.0, 45.0), (-89.5, 100.0), (-90.0, -180.0), (60.0, 179.0)]
)  # fmt: skip


@settings(max_examples=100, deadline=None)
@given(
    center=GRID_CENTERS,
    cell_deg=st.sampled_from([0.05, 0.5, 7.0]),
    offsets=st.lists(
        st.tuples(st.floats(-3, 3, allow_nan=False), st.floats(-6, 6, allow_nan=False)),
        max_size=60,
    ),
    query=st.tuples(st.floats(-1, 1), st.floats(-3, 3)),
    radius_km=st.floats(0.1, 400.0),
)
def test_grid_within_matches_brute_force_everywhere(
    center: tuple[float, float],
    cell_deg: float,
    offsets: list[tuple[float, float]],
    query: tuple[float, float],
    radius_km: float,
) -> None:
    grid = GeoGrid(cell_deg)
    points = {
        i: (clamp_lat(center[0] + dlat), wrap_lng(center[1] + dlng))
        for i, (dlat, dlng) in enumerate(offsets)
    }
    for ident, (lat, lng) in points.items():
        grid.move(ident, lat, lng)
    qlat, qlng = clamp_lat(center[0] + query[0]), wrap_lng(center[1] + query[1])
    expected = _grid_brute_force(points, qlat, qlng, radius_km)
    ids, dist = grid.within_distances(qlat, qlng, radius_km)
    assert set(ids.tolist()) == expected
    assert len(ids) == len(expected)
    assert np.all(dist <= radius_km)


def test_grid_across_the_antimeridian_and_at_the_poles() -> None:
    grid = GeoGrid()
    grid.move(1, 0.0, 179.99)
    grid.move(2, 0.0, -179.99)
    grid.move(3, 0.0, 180.0)
    grid.move(4, 0.0, -180.0)
    grid.move(5, 0.0, 179.5)  # 55 km west
    assert set(grid.within(0.0, 180.0, 5.0).tolist()) == {1, 2, 3, 4}
    assert set(grid.within(0.0, -179.995, 2.0).tolist()) == {1, 2, 3, 4}
    grid.move(10, 89.99, 0.0)
    grid.move(11, 89.99, 180.0)  # 2.2 km from 10, across the pole
    grid.move(12, 90.0, -77.0)
    assert set(grid.within(89.99, 0.0, 2.5).tolist()) == {10, 11, 12}
    assert set(grid.within(90.0, 123.0, 1.2).tolist()) == {10, 11, 12}


def test_grid_moves_and_removes_in_place() -> None:
    grid = GeoGrid()
    grid.move(7, *SHANGHAI)
    assert grid.within(*SHANGHAI, 1.0).tolist() == [7]
    grid.move(7, SHANGHAI[0] + 1.0, SHANGHAI[1])
    assert grid.within(*SHANGHAI, 1.0).tolist() == []
    assert grid.position(7) == (SHANGHAI[0] + 1.0, SHANGHAI[1])
    assert grid.remove(7) and not grid.remove(7)
    assert len(grid) == 0 and 7 not in grid
    assert grid.within(SHANGHAI[0] + 1.0, SHANGHAI[1], 1.0).tolist() == []
    with pytest.raises(ValueError):
        grid.move(1, 91.0, 0.0)
    with pytest.raises(ValueError):
        GeoGrid(0.0)
    assert GeoGrid.from_cell_km(5.0).cell_deg == pytest.approx(0.045, abs=1e-3)
