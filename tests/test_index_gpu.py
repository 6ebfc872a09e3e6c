"""``FleetTable.recommend_many`` with a device first pass (``indexes.gpu.DeviceFleet``):
GPU == CPU == brute force, bit for bit, on random fleets with ties, through moves, status
changes, upserts and deletes between batches. "cuda" runs where torch sees a GPU (the H200,
through the device tool) and skips elsewhere; "cpu" runs the same torch code on the CPU, so
the first pass's logic is tested everywhere."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features.models import DriverRecord, Order, Position
from indexes import FleetTable, gpu
from tests.test_index import (
    CENTERS,
    DIM,
    STATUSES,
    assert_recommendation,
    brute_force,
    drivers,
    orders,
    positions,
    quantized_unit,
    scorer,
)

Fleet = dict[str, tuple[DriverRecord, np.ndarray]]


def device_or_skip(device: str) -> str:
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    reason = gpu.why_no_device(device)
    if reason is not None:
        pytest.skip(reason)
    return device


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]  # only a GPU test may skip


def check_batch(
    on_device: FleetTable, plain: FleetTable, fleet: Fleet, batch: list[Order], seeds: list[int]
) -> None:
    qs = [quantized_unit(s) if s % 3 else _gaussian(s) for s in seeds]
    got = on_device.recommend_many(batch, qs)
    assert len(got) == len(batch)
    for o, q, answer in zip(batch, qs, got, strict=True):
        assert answer == plain.recommend(o, q)  # GPU == CPU, bit for bit
        considered, expected = brute_force(fleet, o, q)
        assert_recommendation(
            answer, considered, expected, o.k, sim_tol=1e-5, score=scorer(plain, q)
        )


def _gaussian(seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=DIM).astype(np.float32)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_device_first_pass_answers_as_the_cpu_and_brute_force(
    device: str, data: st.DataObject
) -> None:
    device = device_or_skip(device)
    center = data.draw(CENTERS, label="center")
    batch = data.draw(st.lists(drivers(center), min_size=1, max_size=40), label="fleet")
    # Few distinct vectors: many exact ties, decided by distance, then driver_id.
    vecs = np.stack([quantized_unit(i % 7) for i in range(len(batch))])
    on_device, plain = FleetTable(DIM, device=device), FleetTable(DIM)
    fleet: Fleet = {}
    for table in (on_device, plain):
        table.upsert_drivers(batch, vecs)
    for rec, vec in zip(batch, vecs, strict=True):
        fleet[rec.driver_id] = (rec, vec)
    for _ in range(data.draw(st.integers(1, 4), label="steps")):
        ids = list(fleet)
        kind = data.draw(st.sampled_from(["move", "status", "upsert", "delete"]), label="kind")
        if kind == "move" and ids:
            who = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=6), label="who")
            to = [data.draw(positions(center), label="to") for _ in who]
            for table in (on_device, plain):
                table.update_positions(who, [p.lat for p in to], [p.lng for p in to])
            for driver_id, p in zip(who, to, strict=True):
                rec = fleet[driver_id][0].model_copy(
                    update={"position": Position(lat=p.lat, lng=p.lng)}
                )
                fleet[driver_id] = (rec, fleet[driver_id][1])
        elif kind == "status" and ids:
            victim = data.draw(st.sampled_from(ids), label="victim")
            status = data.draw(st.sampled_from(STATUSES), label="status")
            for table in (on_device, plain):
                rec = table.update_driver(victim, status=status)
            fleet[victim] = (rec, fleet[victim][1])
        elif kind == "upsert":
            rec = data.draw(drivers(center), label="upsert")
            vec = quantized_unit(data.draw(st.integers(0, 9), label="vector"))
            for table in (on_device, plain):
                table.upsert_drivers([rec], vec[None, :])
            fleet[rec.driver_id] = (rec, vec)
        elif kind == "delete" and ids:
            victim = data.draw(st.sampled_from(ids), label="delete")
            for table in (on_device, plain):
                assert table.delete_driver(victim)
            del fleet[victim]
        size = data.draw(st.integers(1, 6), label="batch")
        batch_orders = [data.draw(orders(center), label="order") for _ in range(size)]
        seeds = [data.draw(st.integers(0, 10**6), label="query") for _ in range(size)]
        check_batch(on_device, plain, fleet, batch_orders, seeds)


@pytest.mark.parametrize("device", DEVICES)
def test_a_dense_fleet_through_the_device_first_pass(device: str) -> None:
    """Thousands of candidates per order, near-ties and exact ties, orders of every radius
    in one batch; then moves and upserts, and the mirror follows."""
    device = device_or_skip(device)
    rng = np.random.default_rng(11)
    n = 6000
    lat, lng = 31.2304, 121.4737
    from tests.test_index import driver

    recs = [
        driver(
            i,
            lat + float(rng.normal(0, 0.04)),
            lng + float(rng.normal(0, 0.04)),
            status=str(rng.choice(STATUSES, p=[0.7, 0.2, 0.1])),
            energy=str(rng.choice(["electric", "diesel"])),
            capacity=float(rng.choice([0.0, 100.0, 1200.0])),
        )
        for i in range(n)
    ]
    base = rng.normal(size=(5, DIM)).astype(np.float32)
    vecs = base[rng.integers(5, size=n)] + rng.normal(size=(n, DIM)).astype(
        np.float32
    ) * rng.choice([0.0, 1e-6, 1e-3], size=(n, 1)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    on_device, plain = FleetTable(DIM, device=device), FleetTable(DIM)
    for table in (on_device, plain):
        table.upsert_drivers(recs, vecs)
    from features.models import Cargo, LatLng

    def batch() -> list[Order]:
        return [
            Order(
                order_id=f"O{j}",
                pickup=LatLng(lat=lat + float(rng.normal(0, 0.02)), lng=lng),
                radius_km=float(r),
                k=int(k),
                constraints=["electric_only"] if j % 2 else [],
                cargo=Cargo(weight_kg=100.0) if j % 3 == 0 else None,
            )
            for j, (r, k) in enumerate([(1, 1), (3, 10), (5, 50), (10, 200), (30, 10), (0.2, 5)])
        ]

    for step in range(3):
        orders_ = batch()
        qs = [base[j % 5] / np.linalg.norm(base[j % 5]) for j in range(len(orders_))]
        got = on_device.recommend_many(orders_, qs)
        for o, q, answer in zip(orders_, qs, got, strict=True):
            assert answer == plain.recommend(o, q)
        assert max(a.considered for a in got) > 2000
        who = [f"D{int(i):03d}" for i in rng.integers(n, size=500)]
        to_lat = lat + rng.normal(0, 0.04, 500)
        to_lng = lng + rng.normal(0, 0.04, 500)
        for table in (on_device, plain):
            table.update_positions(who, to_lat, to_lng)
            table.upsert_drivers(
                recs[step * 10 : step * 10 + 10], vecs[::-1][step * 10 : step * 10 + 10]
            )
            table.delete_driver(f"D{step + 100:03d}")


def test_recommend_many_without_a_device_is_recommend_each() -> None:
    table = FleetTable(DIM)
    from tests.test_index import driver, order

    table.upsert_drivers(
        [driver(i, 31.23 + i / 1000) for i in range(20)],
        np.stack([quantized_unit(i) for i in range(20)]),
    )
    orders_ = [order(radius_km=r, k=3) for r in (1.0, 5.0)]
    qs = [quantized_unit(1), quantized_unit(2)]
    assert table.recommend_many(orders_, qs) == [
        table.recommend(o, q) for o, q in zip(orders_, qs, strict=True)
    ]
    with pytest.raises(ValueError, match="2 orders but 1 query"):
        table.recommend_many(orders_, qs[:1])


@pytest.mark.parametrize("device", DEVICES)
def test_drivers_on_the_circle_are_decided_by_haversine_on_the_device(device: str) -> None:
    device = device_or_skip(device)
    from features.geo import haversine_km
    from tests.test_index import driver, order

    rng = np.random.default_rng(4)
    recs = [driver(i, 31.2304 + float(rng.normal(0, 0.02)), 121.4737) for i in range(50)]
    on_device, plain = FleetTable(DIM, device=device), FleetTable(DIM)
    vecs = np.stack([quantized_unit(i % 5) for i in range(50)])
    for table in (on_device, plain):
        table.upsert_drivers(recs, vecs)
    orders_ = []
    for rec in recs[:10]:
        r = haversine_km(31.2304, 121.4737, rec.position.lat, rec.position.lng)
        orders_ += [order(radius_km=r, k=50), order(radius_km=np.nextafter(r, 0.0), k=50)]
    qs = [quantized_unit(2)] * len(orders_)
    got = on_device.recommend_many(orders_, qs)
    assert got == [plain.recommend(o, q) for o, q in zip(orders_, qs, strict=True)]
    for i, rec in enumerate(recs[:10]):
        on, beyond = got[2 * i], got[2 * i + 1]
        assert rec.driver_id in {c.driver_id for c in on.candidates}
        assert rec.driver_id not in {c.driver_id for c in beyond.candidates}
        assert on.considered == beyond.considered + 1
