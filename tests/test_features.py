"""The domain package: canonical text, constraints, distance, the synthetic fleet, file I/O.

These are the behaviours the cache and dispatch rely on: a record's text changes only when a
slowly-changing feature really changes, and files of records read back exactly.
"""

from __future__ import annotations

import csv
import gc
import itertools
import json
import math
import re
from collections import Counter
from datetime import UTC
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from features.constraints import (
    CONSTRAINTS,
    UnknownConstraintError,
    check_constraints,
    fits_cargo,
    satisfies,
)
from features.geo import EARTH_RADIUS_KM, haversine_km, haversine_km_each, haversine_km_many
from features.models import Cargo, DriverRecord, Order, VehicleRecord
from features.readers import (
    FLAT_COLUMNS,
    PARQUET_SCHEMA,
    Row,
    from_flat_dict,
    iter_rows,
    to_flat_dict,
    write_csv,
    write_jsonl,
    write_parquet,
    write_records,
)
from features.synthetic import CITIES, VEHICLE_TYPES, generate_fleet, iter_fleet
from features.text import (
    CONSTRAINT_PHRASES,
    TEXT_SCHEMA_VERSION,
    canonical_text,
    completed_orders_bucket,
    driver_text,
    format_rounded,
    order_text,
    record_text,
    vehicle_text,
)

API_EXAMPLE: dict[str, Any] = {
    "driver_id": "D000123",
    "status": "available",
    "position": {"lat": 31.2304, "lng": 121.4737, "ts": "2026-11-30T10:00:00Z"},
    "vehicle": {
        "vehicle_id": "V000123",
        "type": "van",
        "energy": "electric",
        "capacity_kg": 1200,
        "cargo_volume_m3": 8.5,
        "cargo_height_m": 1.7,
        "refrigerated": False,
        "tail_lift": True,
    },
    "profile": {
        "on_time_rate": 0.973,
        "damage_rate": 0.002,
        "service_score": 4.8,
        "completed_orders": 1532,
        "certifications": ["hazmat"],
        "languages": ["zh", "en"],
        "home_zone": "pudong",
    },
}
API_EXAMPLE_TEXT = (
    "electric van, tail lift; capacity 1200 kg, volume 8.5 m3, height 1.70 m; "
    "certifications: hazmat; languages: en, zh; on-time 97.5%, damage 0.2%, service 4.8 of 5, "
    "1000-2499 completed orders; home zone pudong"
)


def driver(**changes: Any) -> DriverRecord:
    """The API.md example with dotted-path changes: ``driver(**{"vehicle.energy": "diesel"})``."""
    data = json.loads(json.dumps(API_EXAMPLE))
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    return DriverRecord.model_validate(data)


def order(**fields: Any) -> Order:
    return Order.model_validate(
        {"order_id": "O1", "pickup": {"lat": 31.23, "lng": 121.47}, **fields}
    )


# ---- canonical text ------------------------------------------------------------------------


def test_driver_text_of_the_api_example() -> None:
    assert driver_text(driver()) == API_EXAMPLE_TEXT


def test_vehicle_text_is_the_head_of_driver_text() -> None:
    d = driver()
    assert (
        vehicle_text(d.vehicle)
        == "electric van, tail lift; capacity 1200 kg, volume 8.5 m3, height 1.70 m"
    )
    assert driver_text(d).startswith(vehicle_text(d.vehicle) + "; ")


def test_order_text_uses_the_words_of_driver_text() -> None:
    o = order(
        cargo={"weight_kg": 300, "volume_m3": 2.0, "height_m": 1.2},
        constraints=["tail_lift", "hazmat_certified", "electric_only"],
        requirements="Fragile,  fourth floor,\nno lift",
    )
    assert order_text(o) == (
        "needs electric vehicle, tail lift, certifications: hazmat; "
        "cargo 300 kg, volume 2.0 m3, height 1.20 m; requirements: fragile, fourth floor, no lift"
    )
    for phrase in ("electric", "tail lift", "certifications: hazmat"):
        assert phrase in driver_text(driver())


def test_every_constraint_has_a_phrase() -> None:
    assert set(CONSTRAINT_PHRASES) == set(CONSTRAINTS)


def test_order_text_ignores_ids_place_time_and_constraint_order() -> None:
    a = order(constraints=["refrigerated", "electric_only"], requirements="fragile")
    b = Order.model_validate(
        {
            "order_id": "O2",
            "pickup": {"lat": -10.0, "lng": 20.0},
            "pickup_time": "2027-01-01T00:00:00Z",
            "constraints": ["electric_only", "refrigerated", "electric_only"],
            "requirements": "  FRAGILE ",
            "radius_km": 50,
            "k": 3,
            "explain": True,
        }
    )
    assert (
        order_text(a)
        == order_text(b)
        == "needs electric vehicle, refrigerated; requirements: fragile"
    )


def test_order_text_without_needs_and_zero_cargo_dimensions() -> None:
    assert order_text(order()) == "needs any vehicle"
    assert order_text(order(cargo={})) == "needs any vehicle"
    assert (
        order_text(order(cargo={"weight_kg": 3, "height_m": 1.0}))
        == "needs any vehicle; cargo height 1.00 m"
    )


def test_record_text_dispatches_on_type() -> None:
    d = driver()
    assert record_text(d) == canonical_text(d) == driver_text(d)
    assert record_text(d.vehicle) == vehicle_text(d.vehicle)
    assert record_text(order()) == order_text(order())
    with pytest.raises(TypeError, match="dict"):
        record_text({"driver_id": "D1"})  # type: ignore[arg-type]


def test_text_schema_version_is_a_nonempty_string() -> None:
    assert isinstance(TEXT_SCHEMA_VERSION, str)
    assert TEXT_SCHEMA_VERSION


@st.composite
def shuffled(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with the keys of every object in a drawn order."""
    if isinstance(value, dict):
        keys = draw(st.permutations(list(value)))
        return {key: draw(shuffled(value[key])) for key in keys}
    return value


@given(data=st.data())
def test_field_order_does_not_matter(data: st.DataObject) -> None:
    record = DriverRecord.model_validate(data.draw(shuffled(API_EXAMPLE)))
    assert record == driver()
    assert driver_text(record) == API_EXAMPLE_TEXT
    text = json.dumps(data.draw(shuffled(API_EXAMPLE)))
    assert driver_text(DriverRecord.model_validate_json(text)) == API_EXAMPLE_TEXT


@given(
    lat=st.floats(-90, 90),
    lng=st.floats(-180, 180),
    status=st.sampled_from(["available", "busy", "offline"]),
    ts=st.one_of(st.none(), st.datetimes(timezones=st.just(UTC))),
    driver_id=st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=20),
    vehicle_id=st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=20),
)
@settings(max_examples=50)
def test_moving_parts_and_ids_do_not_change_the_text(
    lat: float, lng: float, status: str, ts: Any, driver_id: str, vehicle_id: str
) -> None:
    moved = driver(
        **{
            "position": {"lat": lat, "lng": lng, "ts": ts.isoformat() if ts else None},
            "status": status,
            "driver_id": driver_id,
            "vehicle.vehicle_id": vehicle_id,
        }
    )
    assert driver_text(moved) == API_EXAMPLE_TEXT


@pytest.mark.parametrize(
    "drift",
    [
        {"profile.completed_orders": 1540},
        {"profile.completed_orders": 2499},
        {"profile.on_time_rate": 0.974},
        {"profile.damage_rate": 0.0024},
        {"profile.service_score": 4.81},
        {"vehicle.capacity_kg": 1203},
        {"vehicle.cargo_volume_m3": 8.52},
        {"vehicle.cargo_height_m": 1.71},
        {"profile.languages": ["EN", " zh", "en"]},
        {"profile.home_zone": "  Pudong "},
    ],
)
def test_small_drift_and_spelling_keep_the_text(drift: dict[str, Any]) -> None:
    assert driver_text(driver(**drift)) == API_EXAMPLE_TEXT


@pytest.mark.parametrize(
    "change",
    [
        {"vehicle.energy": "diesel"},
        {"vehicle.type": "truck"},
        {"vehicle.capacity_kg": 1250},
        {"vehicle.cargo_volume_m3": 9.0},
        {"vehicle.refrigerated": True},
        {"vehicle.tail_lift": False},
        {"profile.certifications": ["hazmat", "adr"]},
        {"profile.certifications": []},
        {"profile.languages": ["zh"]},
        {"profile.completed_orders": 2500},
        {"profile.on_time_rate": 0.95},
        {"profile.home_zone": "minhang"},
    ],
)
def test_a_real_change_changes_the_text(change: dict[str, Any]) -> None:
    assert driver_text(driver(**change)) != API_EXAMPLE_TEXT


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        ("vehicle.capacity_kg", 1204, "capacity 1200 kg"),
        ("vehicle.capacity_kg", 1205, "capacity 1210 kg"),
        ("vehicle.capacity_kg", 0.4, "capacity 0 kg"),
        ("vehicle.cargo_volume_m3", 8.44, "volume 8.4 m3"),
        ("vehicle.cargo_volume_m3", 8.45, "volume 8.5 m3"),
        ("vehicle.cargo_height_m", 1.72, "height 1.70 m"),
        ("vehicle.cargo_height_m", 1.725, "height 1.75 m"),
        ("profile.on_time_rate", 0.9725, "on-time 97.5%"),
        ("profile.on_time_rate", 0.97249, "on-time 97.0%"),
        ("profile.on_time_rate", 1.0, "on-time 100.0%"),
        ("profile.damage_rate", 0.00049, "damage 0.0%"),
        ("profile.damage_rate", 0.0005, "damage 0.1%"),
        ("profile.damage_rate", 0.0123, "damage 1.2%"),
        ("profile.service_score", 4.85, "service 4.9 of 5"),
        ("profile.service_score", 4.84, "service 4.8 of 5"),
        ("profile.completed_orders", 0, "new driver"),
        ("profile.completed_orders", 9, "1-9 completed orders"),
        ("profile.completed_orders", 10, "10-49 completed orders"),
        ("profile.completed_orders", 999, "500-999 completed orders"),
        ("profile.completed_orders", 12345, "10000+ completed orders"),
    ],
)
def test_rounding_table(path: str, value: float, expected: str) -> None:
    assert expected in driver_text(driver(**{path: value}))


def test_completed_orders_buckets_cover_every_count() -> None:
    labels = [completed_orders_bucket(n) for n in range(0, 20_001)]
    runs = [label for label, _ in itertools.groupby(labels)]
    assert len(runs) == len(set(runs)) == 11  # each bucket is one contiguous run


@given(st.floats(min_value=0.0, max_value=1e12, allow_nan=False))
def test_numbers_render_without_float_artifacts(value: float) -> None:
    for step, decimals in (("10", 0), ("0.1", 1), ("0.05", 2)):
        rendered = format_rounded(value, step, decimals)
        assert re.fullmatch(r"\d+" + (rf"\.\d{{{decimals}}}" if decimals else ""), rendered)


def test_negative_zero_and_tiny_values_render_plainly() -> None:
    assert format_rounded(-0.0, "0.1", 1) == "0.0"
    assert format_rounded(1e-05, "0.05", 2) == "0.00"
    assert format_rounded(1e20, "10", 0) == "100000000000000000000"


def test_absent_profile_values_are_omitted_consistently() -> None:
    text = driver_text(driver(profile={}))
    assert (
        text
        == "electric van, tail lift; capacity 1200 kg, volume 8.5 m3, height 1.70 m; new driver"
    )
    partial = driver(**{"profile.on_time_rate": None, "profile.home_zone": None})
    assert "on-time" not in driver_text(partial)
    assert "home zone" not in driver_text(partial)
    assert "unknown" not in driver_text(partial)


def test_certifications_are_canonical() -> None:
    a = driver(**{"profile.certifications": ["Food_Safety", "hazmat", " HAZMAT", ""]})
    b = driver(**{"profile.certifications": ["hazmat", "food_safety"]})
    assert driver_text(a) == driver_text(b)
    assert "certifications: food safety, hazmat;" in driver_text(a)


# ---- constraints ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "passing", "failing"),
    [
        ("electric_only", {}, {"vehicle.energy": "hybrid"}),
        ("refrigerated", {"vehicle.refrigerated": True}, {}),
        ("tail_lift", {}, {"vehicle.tail_lift": False}),
        ("hazmat_certified", {}, {"profile.certifications": ["adr"]}),
        ("english_speaking", {}, {"profile.languages": ["zh"]}),
    ],
)
def test_each_constraint(name: str, passing: dict[str, Any], failing: dict[str, Any]) -> None:
    assert CONSTRAINTS[name](driver(**passing))
    assert not CONSTRAINTS[name](driver(**failing))
    assert satisfies(driver(**passing), [name], None)
    assert not satisfies(driver(**failing), [name], None)


def test_unknown_constraint_lists_the_known_ones() -> None:
    with pytest.raises(UnknownConstraintError) as info:
        check_constraints(["electric_only", "teleport"])
    assert info.value.unknown == ["teleport"]
    assert info.value.known == sorted(CONSTRAINTS)
    for known in CONSTRAINTS:
        assert known in str(info.value)
    assert check_constraints(["tail_lift", "electric_only", "tail_lift"]) == [
        "tail_lift",
        "electric_only",
    ]


def test_cargo_fit_is_inclusive() -> None:
    v = driver().vehicle
    assert fits_cargo(v, None)
    assert fits_cargo(v, Cargo(weight_kg=1200, volume_m3=8.5, height_m=1.7))
    assert not fits_cargo(v, Cargo(weight_kg=1200.001))
    assert not fits_cargo(v, Cargo(volume_m3=8.51))
    assert not fits_cargo(v, Cargo(height_m=1.71))
    assert not satisfies(driver(), ["electric_only"], Cargo(weight_kg=5000))


# ---- distance ------------------------------------------------------------------------------


def test_haversine_known_distances() -> None:
    assert haversine_km(31.2304, 121.4737, 39.9042, 116.4074) == pytest.approx(1067.3, abs=1.0)
    assert haversine_km(31.2304, 121.4737, 31.2304, 121.4737) == 0.0
    assert haversine_km(0, 0, 0, 180) == pytest.approx(math.pi * EARTH_RADIUS_KM)
    assert haversine_km(90, 0, -90, 0) == pytest.approx(math.pi * EARTH_RADIUS_KM)


def test_haversine_many_matches_the_scalar_form() -> None:
    fleet = generate_fleet(200, seed=5)
    lats = [d.position.lat for d in fleet]
    lngs = [d.position.lng for d in fleet]
    many = haversine_km_many(31.2304, 121.4737, np.array(lats), np.array(lngs))
    scalar = [haversine_km(31.2304, 121.4737, la, ln) for la, ln in zip(lats, lngs, strict=True)]
    assert many.tolist() == pytest.approx(scalar)


def test_distances_from_many_origins_in_one_pass_are_the_same_bits() -> None:
    """recommend on a device measures every order's survivors in one call; its answers must
    be the CPU path's bit for bit, which measures them order by order."""
    rng = np.random.default_rng(12)
    fleet = generate_fleet(3000, seed=8)
    lats = np.array([d.position.lat for d in fleet])
    lngs = np.array([d.position.lng for d in fleet])
    origins = [(float(a), float(b)) for a, b in zip(lats[:40], lngs[:40], strict=True)]
    counts = [int(c) for c in rng.integers(0, 150, size=len(origins))]
    counts[3] = 0  # an order with no survivor
    at = rng.integers(len(fleet), size=sum(counts))
    together = haversine_km_each(origins, counts, lats[at], lngs[at])
    alone = np.concatenate(
        [
            haversine_km_many(lat, lng, lats[part], lngs[part])
            for (lat, lng), part in zip(origins, np.split(at, np.cumsum(counts)[:-1]), strict=True)
        ]
    )
    assert np.array_equal(together, alone)  # exactly, not approximately
    assert together.max() > 5.0  # not all zero: far points too


# ---- models --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "loc"),
    [
        ("driver_id", ("driver_id",)),
        ("position", ("position",)),
        ("vehicle.capacity_kg", ("vehicle", "capacity_kg")),
        ("vehicle.type", ("vehicle", "type")),
    ],
)
def test_missing_required_field_is_named(path: str, loc: tuple[str, ...]) -> None:
    data = json.loads(json.dumps(API_EXAMPLE))
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    del node[leaf]
    with pytest.raises(ValidationError) as info:
        DriverRecord.model_validate(data)
    assert [(e["loc"], e["type"]) for e in info.value.errors()] == [(loc, "missing")]


@pytest.mark.parametrize("lat", [90.0001, -91, float("nan")])
def test_latitude_out_of_range_is_rejected(lat: float) -> None:
    with pytest.raises(ValidationError) as info:
        driver(**{"position.lat": lat})
    assert info.value.errors()[0]["loc"] == ("position", "lat")


def test_unknown_fields_are_ignored() -> None:
    assert driver(**{"vehicle.colour": "red", "shoe_size": 44}) == driver()


# ---- synthetic fleet -----------------------------------------------------------------------


def test_generator_is_deterministic_and_prefix_stable() -> None:
    a = generate_fleet(300, seed=7)
    assert a == generate_fleet(300, seed=7)
    assert a != generate_fleet(300, seed=8)
    assert generate_fleet(40, seed=7) == a[:40]
    assert list(iter_fleet(300, seed=7)) == a
    assert generate_fleet(0) == []


def test_generator_makes_valid_unique_records() -> None:
    fleet = generate_fleet(5000, seed=1)
    assert [d.driver_id for d in fleet[:2]] == ["D000000", "D000001"]
    assert fleet[123].vehicle.vehicle_id == "V000123"
    assert len({d.driver_id for d in fleet}) == len(fleet)
    for d in fleet:
        assert DriverRecord.model_validate(d.model_dump()) == d


def test_generator_mixes_as_designed() -> None:
    fleet = generate_fleet(5000, seed=2)
    statuses = Counter(d.status for d in fleet)
    assert statuses["available"] / 5000 == pytest.approx(0.6, abs=0.03)
    assert statuses["busy"] / 5000 == pytest.approx(0.3, abs=0.03)
    assert statuses["offline"] / 5000 == pytest.approx(0.1, abs=0.02)
    types = Counter[str](d.vehicle.type for d in fleet)
    for name, vtype in VEHICLE_TYPES.items():
        assert types[name] / 5000 == pytest.approx(vtype.share, abs=0.03)
    ranges = {"e-bike": (20, 40), "van": (600, 1500), "truck": (2000, 12000)}
    for d in fleet:
        v = d.vehicle
        if v.type in ranges:
            low, high = ranges[v.type]
            assert low <= v.capacity_kg <= high
        if v.type == "e-bike":
            assert v.energy == "electric"
            assert not v.tail_lift
    assert any(d.vehicle.refrigerated for d in fleet)
    assert any("hazmat" in d.profile.certifications for d in fleet)
    # Fleets buy the same models: vehicle texts repeat, so the cache can share them.
    assert len({vehicle_text(d.vehicle) for d in fleet}) < 200


def test_generator_places_drivers_near_cities() -> None:
    fleet = generate_fleet(3000, seed=3)
    centres = list(CITIES.values())

    def nearest_km(d: DriverRecord) -> float:
        return min(haversine_km(d.position.lat, d.position.lng, c.lat, c.lng) for c in centres)

    distances = [nearest_km(d) for d in fleet]
    assert sum(x <= 15 for x in distances) / len(distances) > 0.85
    assert max(distances) < 60
    for d in fleet:
        city = min(
            centres, key=lambda c: haversine_km(d.position.lat, d.position.lng, c.lat, c.lng)
        )
        assert d.profile.home_zone in city.zones


def test_generator_city_choice() -> None:
    fleet = generate_fleet(200, seed=4, cities=["Berlin"])
    berlin = CITIES["berlin"]
    assert all(
        haversine_km(d.position.lat, d.position.lng, berlin.lat, berlin.lng) < 60 for d in fleet
    )
    assert all("de" in d.profile.languages for d in fleet)
    with pytest.raises(ValueError, match="known: shanghai"):
        generate_fleet(10, cities=["atlantis"])


def test_generate_fleet_restores_the_garbage_collector() -> None:
    assert gc.isenabled()
    generate_fleet(10)
    assert gc.isenabled()
    gc.disable()
    try:
        generate_fleet(10)
        assert not gc.isenabled()
    finally:
        gc.enable()


# ---- readers and writers -------------------------------------------------------------------

WRITERS = {"jsonl": write_jsonl, "csv": write_csv, "parquet": write_parquet}


@pytest.mark.parametrize("ext", ["jsonl", "ndjson", "csv", "parquet"])
def test_round_trip(tmp_path: Path, ext: str) -> None:
    fleet = [*generate_fleet(250, seed=9), driver(profile={}), driver(**{"position.ts": None})]
    path = tmp_path / f"fleet.{ext}"
    assert write_records(fleet, path) == len(fleet)
    rows = list(iter_rows(path, chunk_size=64))
    assert [r.error for r in rows] == [None] * len(fleet)
    assert [r.record for r in rows] == fleet
    first_line = 2 if ext == "csv" else 1
    assert [r.line for r in rows] == list(range(first_line, first_line + len(fleet)))


@pytest.mark.parametrize("ext", ["jsonl", "csv", "parquet"])
def test_each_writer_streams_an_iterator(tmp_path: Path, ext: str) -> None:
    path = tmp_path / f"fleet.{ext}"
    assert WRITERS[ext](iter_fleet(30, seed=1), path) == 30
    assert [r.record for r in iter_rows(path)] == generate_fleet(30, seed=1)


def test_nested_parquet_is_read(tmp_path: Path) -> None:
    fleet = generate_fleet(50, seed=10)
    path = tmp_path / "nested.parquet"
    pq.write_table(pa.Table.from_pylist([d.model_dump() for d in fleet]), path)
    assert [r.record for r in iter_rows(path, chunk_size=16)] == fleet


def test_flat_layout_is_shared() -> None:
    d = driver()
    flat = to_flat_dict(d)
    assert tuple(flat) == FLAT_COLUMNS == tuple(PARQUET_SCHEMA.names)
    assert flat["profile.languages"] == ["zh", "en"]
    assert from_flat_dict(flat) == d


def test_bad_jsonl_rows_are_reported_and_reading_goes_on(tmp_path: Path) -> None:
    good = driver().model_dump_json()
    negative = driver().model_dump()
    negative["vehicle"]["capacity_kg"] = -1
    missing = driver().model_dump(mode="json")
    del missing["vehicle"]["energy"]
    lines = [
        good,  # 1
        "{not json",  # 2
        good,  # 3
        "",  # 4: blank, skipped
        json.dumps(missing),  # 5
        json.dumps(negative, default=str),  # 6
        "[1, 2]",  # 7
        good,  # 8
    ]
    path = tmp_path / "drivers.jsonl"
    path.write_text("\n".join(lines) + "\n")
    rows = list(iter_rows(path))
    assert [r.line for r in rows] == [1, 2, 3, 5, 6, 7, 8]
    assert [r.ok for r in rows] == [True, False, True, False, False, False, True]
    errors = {r.line: r.error for r in rows}
    assert errors[2] is not None and errors[2].startswith("invalid JSON")
    assert errors[5] == "vehicle.energy: Field required"
    assert errors[6] == "vehicle.capacity_kg: Input should be greater than or equal to 0"
    assert errors[7] == "expected a JSON object, got list"


def test_bad_csv_rows_are_reported_with_their_lines(tmp_path: Path) -> None:
    path = tmp_path / "drivers.csv"
    write_csv([driver(), driver(**{"vehicle.capacity_kg": 5})], path)
    header, row, row2 = path.read_text().splitlines()
    bad_capacity = row2.replace(",5.0,", ",-5,")
    bad_status = row.replace(",available,", ",parked,")
    too_many = row + ",extra"
    cells = next(csv.reader([row]))
    cells[FLAT_COLUMNS.index("profile.home_zone")] = "two\nlines"
    multi_line = ",".join(f'"{c}"' for c in cells)
    path.write_text(
        "\n".join([header, row, bad_capacity, "", bad_status, multi_line, too_many, row]) + "\n"
    )
    rows = list(iter_rows(path))
    assert [(r.line, r.ok) for r in rows] == [
        (2, True),
        (3, False),
        (5, False),
        (6, True),
        (8, False),
        (9, True),
    ]
    assert rows[1].error == "vehicle.capacity_kg: Input should be greater than or equal to 0"
    assert rows[2].error is not None and rows[2].error.startswith("status: Input should be")
    assert rows[3].record is not None and rows[3].record.profile.home_zone == "two\nlines"
    assert (
        rows[4].error
        == f"row has {len(FLAT_COLUMNS) + 1} cells, the header has {len(FLAT_COLUMNS)}"
    )


def test_csv_cells_read_leniently(tmp_path: Path) -> None:
    path = tmp_path / "minimal.csv"
    path.write_text(
        "driver_id,status,position.lat,position.lng,vehicle.vehicle_id,vehicle.type,"
        "vehicle.energy,vehicle.capacity_kg,vehicle.cargo_volume_m3,vehicle.cargo_height_m,"
        "vehicle.refrigerated,vehicle.tail_lift,profile.languages,profile.certifications,notes\n"
        "D1,busy,1.5,2.5,V1,car,hybrid,400,1.4,0.95,yes,0, en ; zh ;,,whatever\n"
        "D2,busy,1.5,2.5,V2,car,hybrid,400,1.4,0.95,maybe,no,,,\n"
    )
    first, second = iter_rows(path)
    assert first.record is not None
    assert first.record.vehicle.refrigerated is True
    assert first.record.vehicle.tail_lift is False
    assert first.record.profile.languages == ["en", "zh"]
    assert first.record.profile.certifications == []
    assert first.record.position.ts is None
    assert first.record.profile.completed_orders == 0
    assert second.error is not None and second.error.startswith("vehicle.refrigerated:")


def test_bad_parquet_rows_are_numbered(tmp_path: Path) -> None:
    rows = [to_flat_dict(d) for d in generate_fleet(5, seed=11)]
    rows[2]["vehicle.capacity_kg"] = -3.0
    rows[3]["driver_id"] = None
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=PARQUET_SCHEMA), path)
    result = list(iter_rows(path, chunk_size=2))
    assert [(r.line, r.error) for r in result] == [
        (1, None),
        (2, None),
        (3, "vehicle.capacity_kg: Input should be greater than or equal to 0"),
        (4, "driver_id: Field required"),
        (5, None),
    ]


def test_unknown_extension_is_refused_before_reading(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.xlsx.*known: \.jsonl"):
        iter_rows(tmp_path / "missing.xlsx")
    with pytest.raises(ValueError, match="known"):
        write_records([], tmp_path / "fleet")
    with pytest.raises(ValueError, match="chunk_size"):
        iter_rows(tmp_path / "x.parquet", chunk_size=0)


def test_empty_files_have_no_rows(tmp_path: Path) -> None:
    for name in ("e.jsonl", "e.csv"):
        (tmp_path / name).write_text("")
        assert list(iter_rows(tmp_path / name)) == []
    write_parquet([], tmp_path / "e.parquet")
    assert list(iter_rows(tmp_path / "e.parquet")) == []


def test_csv_refuses_a_list_item_with_the_separator(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"profile\.certifications"):
        write_csv([driver(**{"profile.certifications": ["a;b"]})], tmp_path / "x.csv")


def test_row_is_a_plain_value() -> None:
    assert Row(3, None, "bad") == Row(3, None, "bad")
    assert not Row(3, None, "bad").ok


def test_vehicle_record_alone_renders() -> None:
    vehicle = VehicleRecord.model_validate(API_EXAMPLE["vehicle"])
    assert record_text(vehicle) == vehicle_text(driver().vehicle)
