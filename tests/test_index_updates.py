"""Batched position updates (``FleetTable.update_positions``) and their lazy records."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.models import DriverRecord, Position
from indexes import FleetTable
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
    faiss_ids,
    faiss_vectors,
    order,
    orders,
    positions,
    quantized_unit,
)

TS = datetime(2026, 11, 30, 10, 5, tzinfo=UTC)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_batched_moves_match_brute_force_and_single_updates(data: st.DataObject) -> None:
    center = data.draw(CENTERS, label="center")
    table = FleetTable(DIM)
    twin = FleetTable(DIM)  # the same operations through update_driver, one at a time
    model: dict[str, tuple[DriverRecord, np.ndarray]] = {}
    batch = data.draw(st.lists(drivers(center), min_size=1, max_size=12), label="fleet")
    vecs = np.stack([quantized_unit(i) for i in range(len(batch))])
    table.upsert_drivers(batch, vecs)
    twin.upsert_drivers(batch, vecs)
    for rec, vec in zip(batch, vecs, strict=True):
        model[rec.driver_id] = (rec, vec)
    for _ in range(data.draw(st.integers(1, 5), label="steps")):
        kind = data.draw(st.sampled_from(["moves", "moves", "status", "delete"]))
        ids = list(model)
        if not ids:
            break
        if kind == "moves":
            who = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=8), label="who")
            to = [data.draw(positions(center), label="to") for _ in who]
            ts = data.draw(st.sampled_from([None, TS]), label="ts")
            table.update_positions(who, [p.lat for p in to], [p.lng for p in to], ts=ts)
            for driver_id, p in zip(who, to, strict=True):
                pos = Position(lat=p.lat, lng=p.lng, ts=ts)
                rec = twin.update_driver(driver_id, position=pos)
                model[driver_id] = (rec, model[driver_id][1])
        elif kind == "status":
            victim = data.draw(st.sampled_from(ids), label="status of")
            status = data.draw(st.sampled_from(STATUSES), label="status")
            rec = table.update_driver(victim, status=status)
            assert rec == twin.update_driver(victim, status=status)
            model[victim] = (rec, model[victim][1])
        else:
            victim = data.draw(st.sampled_from(ids), label="delete")
            assert table.delete_driver(victim) and twin.delete_driver(victim)
            del model[victim]
        for _ in range(2):
            o = data.draw(orders(center), label="order")
            q = quantized_unit(data.draw(st.integers(0, 10**6), label="query seed"))
            considered, expected = brute_force(model, o, q)
            got = table.recommend(o, q)
            assert_recommendation(got, considered, expected, o.k)
            assert got == twin.recommend(o, q)
    assert_consistent(table, model)  # get_driver returns exactly the moved records
    for driver_id in model:
        assert table.get_driver(driver_id) == twin.get_driver(driver_id)


def test_update_positions_is_all_or_nothing_and_does_no_vector_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = FleetTable(DIM)
    v = quantized_unit(3)
    table.upsert_drivers([driver(1), driver(2)], np.stack([v, v]))
    before = [table.get_driver("D001"), table.get_driver("D002")]
    with pytest.raises(KeyError, match="nobody"):
        table.update_positions(["D001", "nobody"], [31.0, 31.0], [121.0, 121.0])
    with pytest.raises(ValueError, match="range"):
        table.update_positions(["D001", "D002"], [31.0, 91.0], [121.0, 121.0])
    with pytest.raises(ValueError, match="range"):
        table.update_positions(["D001"], [float("nan")], [121.0])
    with pytest.raises(ValueError, match="shape"):
        table.update_positions(["D001", "D002"], [31.0], [121.0])
    with pytest.raises(ValueError):
        table.update_positions(["D001"], [31.0], [121.0], ts="not a time")  # type: ignore[arg-type]
    assert [table.get_driver("D001"), table.get_driver("D002")] == before
    assert table.recommend(order(), v).considered == 2

    ids, vectors = faiss_ids(table), faiss_vectors(table).copy()

    def no_vector_work(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("update_positions touched FAISS")

    for name in ("add", "add_with_ids", "remove_ids", "reset"):
        monkeypatch.setattr(type(table.flat), name, no_vector_work)
    far = SHANGHAI[0] + 0.5
    # A repeated driver: the last position wins.
    table.update_positions(["D001", "D002", "D001"], [far, far, SHANGHAI[0]], [SHANGHAI[1]] * 3)
    table.update_positions([], [], [])
    monkeypatch.undo()
    assert table.recommend(order(), v).considered == 1
    assert table.recommend(order(far, SHANGHAI[1]), v).considered == 1
    rec = table.get_driver("D002")
    assert rec is not None and rec.position == Position(lat=far, lng=SHANGHAI[1])
    assert rec.model_dump_json() == rec.model_copy().model_dump_json()
    assert faiss_ids(table) == ids and np.array_equal(faiss_vectors(table), vectors)


def test_batched_moves_survive_save_load_and_upsert(tmp_path: Path) -> None:
    table = FleetTable(DIM)
    table.upsert_drivers(
        [driver(i) for i in range(5)], np.stack([quantized_unit(i) for i in range(5)])
    )
    table.update_positions(["D001", "D002"], [31.3, 31.4], [121.5, 121.6], ts=TS)
    table.upsert_drivers([driver(2, 30.0, 120.0)], quantized_unit(9)[None, :])  # replaces D002
    table.save(tmp_path)
    loaded = FleetTable.load(tmp_path, DIM)
    assert loaded.get_driver("D001") == table.get_driver("D001")
    rec = loaded.get_driver("D001")
    assert rec is not None and rec.position == Position(lat=31.3, lng=121.5, ts=TS)
    assert loaded.get_driver("D002") == driver(2, 30.0, 120.0)
