"""recommend's int8 first pass (indexes/quantized.py) must not change a single answer: with
many candidates it drops only those that provably cannot reach the top k, so every answer is
the exact one, bit for bit, on fleets built to stress exact ties and near-ties."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from features.models import DriverRecord, Order
from indexes import FleetTable, Recommendation, ranking
from tests.test_index import (
    DIM,
    PROPERTY,
    SHANGHAI,
    assert_recommendation,
    brute_force,
    driver,
    gaussian_unit,
    off_the_circle,
    order,
    quantized_unit,
    scorer,
)

Fleet = dict[str, tuple[DriverRecord, np.ndarray]]


def build(recs: list[DriverRecord], vecs: np.ndarray) -> tuple[FleetTable, Fleet]:
    table = FleetTable(vecs.shape[1])
    table.upsert_drivers(recs, vecs)
    return table, {r.driver_id: (r, v) for r, v in zip(recs, vecs, strict=True)}


def scattered(rng: np.random.Generator, n: int, spread: float = 0.03) -> list[DriverRecord]:
    lat, lng = SHANGHAI
    return [
        driver(i, lat + float(rng.normal(0, spread)), lng + float(rng.normal(0, spread)))
        for i in range(n)
    ]


def near_ties(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    """A few base vectors, each shared exactly by some drivers and nudged by 1e-7 to 1e-4 for
    others: int8 codes cannot tell them apart, exact scores can (or tie exactly)."""
    base = gaussian_unit(rng, 4, dim)[rng.integers(4, size=n)]
    nudge = rng.normal(size=(n, dim)) * rng.choice([0.0, 1e-7, 1e-5, 1e-4], size=(n, 1))
    vecs = (base + nudge).astype(np.float32)
    return vecs / np.linalg.norm(vecs, axis=1, keepdims=True)


@pytest.fixture
def patcher() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def plain(table: FleetTable, mp: pytest.MonkeyPatch, o: Order, q: np.ndarray) -> Recommendation:
    """The answer of the plain path: every candidate scored exactly."""
    mp.setattr(ranking, "_EXACT_UP_TO", 10**9)
    try:
        return table.recommend(o, q)
    finally:
        mp.undo()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_dense_fleet_of_near_ties_gets_the_exact_answer(
    seed: int, patcher: pytest.MonkeyPatch
) -> None:
    # 6,000 drivers within ~5 km: well above the size where the first pass starts.
    rng = np.random.default_rng(seed)
    recs = scattered(rng, 6000)
    table, fleet = build(recs, near_ties(rng, len(recs)))
    for i, (radius, k) in enumerate([(3.0, 1), (5.0, 10), (8.0, 50), (20.0, 200)]):
        o = order(radius_km=radius, k=k)
        # The query: one of the base directions (many exact ties), or a random one.
        q = gaussian_unit(rng, 1)[0] if i % 2 else fleet[recs[i].driver_id][1]
        got = table.recommend(o, q)
        assert got.considered > ranking._EXACT_UP_TO  # the first pass ran
        assert got == plain(table, patcher, o, q)  # bit for bit, ties included
        # (No float64 brute force here: near-ties 1e-7 apart are ordered by float32 scores,
        # which the plain path computes and tests/test_index.py checks against brute force.)
        assert got.considered == brute_force(fleet, o, q, off_the_circle)[0]
        assert len(got.candidates) == k


def test_when_every_candidate_survives_the_bound_the_answer_is_still_exact(
    patcher: pytest.MonkeyPatch,
) -> None:
    # Every driver has the same vector: all scores tie, the bound drops nobody, and distance
    # then driver_id decide (drivers share positions in pairs, so ids break ties too).
    rng = np.random.default_rng(3)
    recs = scattered(rng, 1500)
    recs += [driver(f"E{r.driver_id[1:]}", r.position.lat, r.position.lng) for r in recs]
    vecs = np.repeat(quantized_unit(3)[None, :], len(recs), axis=0)
    table, fleet = build(recs, vecs)
    o = order(radius_km=50.0, k=25)
    q = quantized_unit(3)  # scores are exact in float32 and float64 alike: 1.0
    rows = table._grid.within_rows(SHANGHAI[0], SHANGHAI[1], o.radius_km)
    assert rows.size == len(table)
    premise = ranking.may_reach_top(table._grid, table._quant, q, rows, o.k)
    assert premise.all()  # the premise of this test
    got = table.recommend(o, q)
    assert got.considered == len(recs)
    assert got == plain(table, patcher, o, q)
    considered, expected = brute_force(fleet, o, q, off_the_circle)
    assert_recommendation(got, considered, expected, o.k)


@PROPERTY
@given(st.data())
def test_the_first_pass_never_changes_an_answer(data: st.DataObject) -> None:
    """Forced on for every order (even tiny ones), through upserts, deletes and moves."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    n = data.draw(st.integers(5, 120), label="drivers")
    recs = scattered(rng, n, spread=0.01)
    kind = data.draw(st.sampled_from(["ties", "near-ties", "gaussian"]), label="vectors")
    if kind == "ties":
        vecs = np.stack([quantized_unit(int(s)) for s in rng.integers(0, 40, size=n)])
    else:
        vecs = near_ties(rng, n) if kind == "near-ties" else gaussian_unit(rng, n)
    table, fleet = build(recs, vecs)
    for victim in data.draw(st.lists(st.integers(0, n - 1), max_size=10), label="deletes"):
        table.delete_driver(recs[victim].driver_id)
        fleet.pop(recs[victim].driver_id, None)
    again = data.draw(st.lists(st.integers(0, n - 1), max_size=10), label="re-upserts")
    for i in again:  # back with a new vector (reuses freed slots' neighbours)
        vec = gaussian_unit(rng, 1)[0]
        table.upsert_drivers([recs[i]], vec[None, :])
        fleet[recs[i].driver_id] = (recs[i], vec)
    with pytest.MonkeyPatch.context() as mp:
        for _ in range(3):
            o = order(
                radius_km=data.draw(st.sampled_from([0.5, 1.0, 3.0, 10.0])),
                k=data.draw(st.integers(1, 30), label="k"),
            )
            q = gaussian_unit(rng, 1)[0] if rng.random() < 0.5 else vecs[rng.integers(n)]
            want = plain(table, mp, o, q)
            mp.setattr(ranking, "_EXACT_UP_TO", 0)
            assert table.recommend(o, q) == want
            mp.undo()
            if kind != "near-ties":  # see test_a_dense_fleet_of_near_ties_...
                considered, expected = brute_force(fleet, o, q, off_the_circle)
                assert_recommendation(
                    want, considered, expected, o.k, sim_tol=1e-5, score=scorer(table, q)
                )


@PROPERTY
@given(st.data())
def test_many_orders_ranked_together_as_each_alone(data: st.DataObject) -> None:
    """``best_scored_many`` == ``best_scored`` per order, with exact (similarity, distance)
    ties inside the top k, at its edge and beyond it, where driver_id decides."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    ids = [f"d{i:03d}" for i in rng.permutation(200)]
    vehicles = [f"v{i}" for i in range(200)]
    sizes = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=8), label="sizes")
    ks = [data.draw(st.integers(1, 12), label="k") for _ in sizes]
    slots = np.concatenate([rng.choice(200, size=n, replace=False) for n in sizes])
    few = data.draw(st.booleans(), label="few values")  # few: many exact ties
    sims = (rng.integers(0, 3, slots.size) / 4 if few else rng.random(slots.size)).astype(
        np.float32
    )
    dist = rng.integers(0, 3, slots.size) / 2 if few else rng.random(slots.size)
    got = ranking.best_scored_many(slots, sims, dist, sizes, ks, ids, vehicles)
    start = 0
    for size, k, answer in zip(sizes, ks, got, strict=True):
        part = slice(start, start + size)
        start += size
        alone = ranking.best_scored(
            slots[part], sims[part], dist[part].__getitem__, k, ids, vehicles
        )
        assert answer == alone
        assert len(answer) == min(size, k)
        assert all(type(c) is ranking.Candidate for c in answer)  # named fields, as alone


def test_products_of_many_queries_are_each_alone_and_counts_are_checked() -> None:
    """``inner_products_many`` == ``inner_products`` per query; counts that do not add up
    raise (FAISS's kernel would read past the arrays it is given)."""
    rng = np.random.default_rng(3)
    rows = gaussian_unit(rng, 50)
    queries = gaussian_unit(rng, 3)
    sizes = [4, 0, 7]
    slots = np.concatenate([rng.choice(50, size=n, replace=False) for n in sizes])
    got = ranking.inner_products_many(rows, queries, slots, sizes)
    parts = np.split(slots, np.cumsum(sizes)[:-1])
    want = [ranking.inner_products(rows, q, part) for q, part in zip(queries, parts, strict=True)]
    np.testing.assert_array_equal(got, np.concatenate(want))
    with pytest.raises(ValueError, match="groups"):
        ranking.inner_products_many(rows, queries[:2], slots, sizes)
    with pytest.raises(ValueError, match="groups"):
        ranking.inner_products_many(rows, queries, slots[:-1], sizes)
