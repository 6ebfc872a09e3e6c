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


def mixed_fleet(
    rng: np.random.Generator, n: int, lat: float, lng: float, spread_deg: float
) -> list[DriverRecord]:
    """n drivers around (lat, lng): most available, some busy or offline; electric or
    diesel; no cargo room, some or much."""
    from tests.test_index import driver

    return [
        driver(
            i,
            lat + float(rng.normal(0, spread_deg)),
            lng + float(rng.normal(0, spread_deg)),
            status=str(rng.choice(STATUSES, p=[0.7, 0.2, 0.1])),
            energy=str(rng.choice(["electric", "diesel"])),
            capacity=float(rng.choice([0.0, 100.0, 1200.0])),
        )
        for i in range(n)
    ]


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
    recs = mixed_fleet(rng, n, lat, lng, 0.04)
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
    # Exact ties beyond K sent some orders through the dense pass, the others were answered
    # by the top pass: both checked above.
    device_fleet = on_device._device
    assert device_fleet is not None
    assert 0 < device_fleet.dense_orders < 18


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
    device_fleet = on_device._device
    assert device_fleet is not None
    assert device_fleet.dense_orders == 0  # the drivers on the circle came from the top pass


def _unit_rows(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_the_device_scores_stay_within_their_error_bound(device: str) -> None:
    """The first pass keeps a driver unless its device score is more than twice
    ``DeviceFleet.error`` below the k-th best, so the bound must hold: against FAISS's float32
    scores, for gaussian vectors, vectors with components float16 cannot hold (subnormal or
    flushed), one dominant component, near-duplicates, and the table's largest norm."""
    device = device_or_skip(device)
    from indexes import ranking
    from indexes.table import _UNIT_TOLERANCE

    dim, rng = 384, np.random.default_rng(5)
    gaussian = _unit_rows(rng.normal(size=(600, dim)))
    tiny = gaussian * np.where(rng.random((600, dim)) < 0.9, 1e-5, 1.0)
    peaked = rng.normal(size=(600, dim)) * 1e-3
    peaked[:, 0] = 1.0
    twins = np.repeat(gaussian[:5], 120, axis=0) + rng.normal(size=(600, dim)) * 1e-6
    rows = np.concatenate([gaussian, _unit_rows(tiny), _unit_rows(peaked), _unit_rows(twins)])
    rows[-1] *= np.float32(1.0 + _UNIT_TOLERANCE)  # the longest row the table accepts
    fleet = gpu.DeviceFleet(dim, device, _UNIT_TOLERANCE, 1e-12)
    n = len(rows)

    def read(slots: np.ndarray, with_vectors: bool) -> gpu.Columns:
        cols: gpu.Columns = {
            "xyz": np.tile([1.0, 0.0, 0.0], (len(slots), 1)),
            "available": np.ones(len(slots), dtype=bool),
            "cbits": np.zeros(len(slots), dtype=np.uint64),
            "cargo": np.zeros((len(slots), 3)),
        }
        if with_vectors:
            cols["vectors"] = rows[slots]
        return cols

    fleet.sync(n, read)
    queries = np.concatenate([rows[::97], _unit_rows(rng.normal(size=(8, dim)))])
    device_scores = fleet.scores(queries)
    worst = 0.0
    for q, got in zip(queries, device_scores, strict=True):
        exact = ranking.inner_products(rows, q, np.arange(n))
        gap = float(np.max(np.abs(got.astype(np.float64) - exact)))
        assert gap <= fleet.error(q)
        worst = max(worst, gap / fleet.error(q))
    assert worst > 0.01  # the scores are really rounded: the test can see an error


def test_the_two_step_top_k_returns_the_top_k() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    k = 64
    cols = 4 * k * gpu._BLOCK
    # Few distinct values (ties everywhere), -inf (not eligible), inf and float32 max (near
    # the circle's edge), clustered in a few blocks.
    ranked = rng.integers(0, 50, size=(3, cols)).astype(np.float32) / 7
    ranked[rng.random((3, cols)) < 0.5] = -np.inf
    ranked[0, 5000:5030] = np.inf
    ranked[1, 100:110] = np.finfo(np.float32).max
    ranked[2, :] = -np.inf
    ranked[2, 77] = 3.0
    got_values, got_at = gpu._top(torch, torch.from_numpy(ranked), k)
    want = torch.from_numpy(ranked).topk(k, dim=1).values.numpy()
    assert np.array_equal(got_values.numpy(), want)
    at = got_at.numpy()
    assert np.array_equal(np.take_along_axis(ranked, at, axis=1), want)
    assert all(len(set(row.tolist())) == k for row in at)  # k distinct columns per row


@pytest.mark.gpu
def test_the_fused_kernel_ranks_as_the_torch_operations() -> None:
    """``indexes.rank_kernel`` (the top pass's masks in one Triton kernel, used on CUDA where
    triton is installed) gives the torch operations' ranking values, block maxima and counts:
    drivers unavailable, on the circles, with and without the constraints and cargo."""
    device = device_or_skip("cuda")
    torch = pytest.importorskip("torch")
    from features.geo import haversine_km
    from features.models import Cargo, LatLng

    rng = np.random.default_rng(21)
    lat, lng = 31.2304, 121.4737
    recs = mixed_fleet(rng, 3000, lat, lng, 0.03)
    table = FleetTable(DIM, device=device)
    table.upsert_drivers(recs, np.stack([quantized_unit(i % 11) for i in range(len(recs))]))
    ring = [r for r in recs if r.status == "available"][:8]  # each on one order's circle
    orders_ = [
        Order(
            order_id=f"O{j}",
            pickup=LatLng(lat=lat, lng=lng),
            radius_km=haversine_km(lat, lng, ring[j].position.lat, ring[j].position.lng),
            k=5,
            constraints=["electric_only"] if j % 2 else [],
            cargo=Cargo(weight_kg=100.0) if j % 3 == 0 else None,
        )
        for j in range(8)
    ]
    fleet = table._device
    assert fleet is not None and fleet._kernel is not None, "triton is not installed"
    table.recommend_many(orders_, [quantized_unit(1)] * len(orders_))  # the mirror synced
    names = [list(o.constraints) for o in orders_]
    step = gpu._TopStep(fleet, 8, 64)
    step.run(table._device_orders(orders_, names, [quantized_unit(1)] * len(orders_)))
    q, params, mask = fleet._unpack(step.inputs)
    scores = fleet._scores(q)
    t = fleet._tensors
    ranked, block_top, inside, near = fleet._kernel.rank(
        torch, scores, t["xyz"], t["cbits"], t["cargo"], params, mask
    )
    want, want_inside, want_near = fleet._ranked(scores, params, mask)
    assert torch.equal(ranked, want)
    assert torch.equal(inside.long(), want_inside) and torch.equal(near.long(), want_near)
    assert int(want_near.sum()) >= 8  # the drivers the circles run through
    rows, cols = want.shape
    assert torch.equal(block_top, want.view(rows, cols // gpu._BLOCK, gpu._BLOCK).amax(dim=2))


def test_a_kernel_that_fails_leaves_the_top_pass_to_torch(caplog: pytest.LogCaptureFixture) -> None:
    """A Triton kernel that does not compile on this machine (as one did on the H200 before
    it was fixed) must not fail recommends: a warning, then the torch operations, exact."""
    device_or_skip("cpu")
    from tests.test_index import driver, order

    class Broken:
        @staticmethod
        def rank(*args: object) -> None:
            raise RuntimeError("CompilationError: at 39:64")

    recs = [driver(i, 31.2304 + i / 2000, 121.4737) for i in range(40)]
    vecs = np.stack([quantized_unit(i % 7) for i in range(40)])
    on_device, plain = FleetTable(DIM, device="cpu"), FleetTable(DIM)
    for table in (on_device, plain):
        table.upsert_drivers(recs, vecs)
    fleet = on_device._device
    assert fleet is not None
    fleet._kernel = Broken()
    orders_ = [order(radius_km=r, k=3) for r in (0.5, 1.0, 5.0)]
    qs = [quantized_unit(s) for s in (1, 2, 3)]
    with caplog.at_level("WARNING", logger="indexes.gpu"):
        got = on_device.recommend_many(orders_, qs)
    assert got == [plain.recommend(o, q) for o, q in zip(orders_, qs, strict=True)]
    assert "Triton kernel failed" in caplog.text
    assert fleet._kernel is None
    assert on_device.recommend_many(orders_, qs) == got  # and it stays on torch


@pytest.mark.parametrize("device", DEVICES)
def test_passes_captured_before_the_mirror_grows_are_captured_again(device: str) -> None:
    """A fleet that outgrows the mirror after batches ran (on CUDA: after their passes were
    captured as graphs over the old tensors) is answered exactly (GPU == CPU) by new passes,
    of the batch sizes seen before and of new ones."""
    device = device_or_skip(device)
    rng = np.random.default_rng(5)
    lat, lng = 31.2304, 121.4737
    on_device, plain = FleetTable(DIM, device=device), FleetTable(DIM)

    def upsert(recs: list[DriverRecord]) -> None:
        vecs = np.stack([_gaussian(int(rng.integers(10**6))) for _ in recs])
        for table in (on_device, plain):
            table.upsert_drivers(recs, vecs)

    def batches(sizes: list[int]) -> None:
        from tests.test_index import order

        for size in sizes:
            batch = [
                order(lat + float(rng.normal(0, 0.02)), lng, radius_km=3.0, k=5)
                for _ in range(size)
            ]
            qs = [_gaussian(int(seed)) for seed in rng.integers(10**6, size=size)]
            got = on_device.recommend_many(batch, qs)
            assert got == [plain.recommend(o, q) for o, q in zip(batch, qs, strict=True)]
            assert sum(len(r.candidates) for r in got) > 0

    upsert(mixed_fleet(rng, 300, lat, lng, 0.03))
    batches([3, 16])
    device_fleet = on_device._device
    assert device_fleet is not None
    capacity = device_fleet._capacity()
    upsert(mixed_fleet(rng, 2 * capacity, lat, lng, 0.03))  # the first 300 again, then new
    batches([3, 16, 5])
    assert device_fleet._capacity() > capacity  # the mirror was built again, larger
