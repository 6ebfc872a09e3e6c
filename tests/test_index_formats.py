"""Snapshot formats and the faiss-gpu path of the fleet index.

Format 1 (the IndexIDMap2 + records.jsonl layout of earlier versions) must still load, or a
fleet saved before an upgrade would be lost; an unknown format is refused by name. The GPU
test runs only where faiss has GPU support and sees a GPU (faiss-gpu cannot be carried to
the GPU machine here: FACTS.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import numpy as np
import pytest
from llama_index.core.vector_stores.types import VectorStoreQuery

from features.models import Cargo
from indexes import FleetIndexError, FleetTable, GeoGrid, SnapshotError, gpu
from indexes.snapshot import FORMAT
from indexes.table import CELL_DEG
from tests.test_index import (
    DIM,
    SHANGHAI,
    _answers,
    _populated,
    driver,
    faiss_ids,
    gaussian_unit,
    llama_query,
    order,
    quantized_unit,
)


def write_format_1(root: Path, table: FleetTable) -> None:
    """The snapshot the previous version wrote for ``table`` (its ``snapshot._write_files``)."""
    ids = table.driver_ids()
    fids = np.asarray(faiss_ids(table), dtype=np.int64)
    index = faiss.IndexIDMap2(faiss.IndexFlatIP(DIM))
    index.add_with_ids(np.stack([table.get_vector(i) for i in ids]), fids)  # type: ignore[misc]
    target = root / "snapshot-00000003"
    target.mkdir(parents=True)
    faiss.write_index(index, str(target / "index.faiss"))
    records = [table.get_driver(i) for i in ids]
    lines = b"".join(r.model_dump_json().encode() + b"\n" for r in records)  # type: ignore[union-attr]
    (target / "records.jsonl").write_bytes(lines)
    meta = {
        "format": 1,
        "dim": DIM,
        "next_id": int(fids.max()) + 1,
        "count": len(ids),
        "faiss_ids": fids.tolist(),
    }
    (target / "meta.json").write_text(json.dumps(meta))
    (root / "CURRENT").write_text("snapshot-00000003\n")


def test_a_format_1_snapshot_still_loads_and_is_saved_as_format_3(tmp_path: Path) -> None:
    table, orders_, q = _populated(200)
    table.update_driver("D001", status="busy")
    write_format_1(tmp_path, table)
    loaded = FleetTable.load(tmp_path, DIM)
    assert _answers(loaded, orders_, q) == _answers(table, orders_, q)
    for driver_id in table.driver_ids():
        assert loaded.get_driver(driver_id) == table.get_driver(driver_id)
        assert np.array_equal(loaded.get_vector(driver_id), table.get_vector(driver_id))  # type: ignore[arg-type]
    assert sorted(faiss_ids(loaded)) == sorted(faiss_ids(table))
    loaded.save(tmp_path)
    live = tmp_path / (tmp_path / "CURRENT").read_text().strip()
    assert json.loads((live / "meta.json").read_text())["format"] == FORMAT == 3
    again = FleetTable.load(tmp_path, DIM)
    assert _answers(again, orders_, q) == _answers(table, orders_, q)


def test_an_unknown_format_is_refused_by_name(tmp_path: Path) -> None:
    table, _, _ = _populated(20)
    table.save(tmp_path)
    live = tmp_path / (tmp_path / "CURRENT").read_text().strip()
    meta = json.loads((live / "meta.json").read_text())
    meta["format"] = 4
    (live / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(SnapshotError, match="unknown snapshot format 4"):
        FleetTable.load(tmp_path, DIM)


def test_a_snapshot_with_another_constraint_vocabulary_recomputes_the_bits(
    tmp_path: Path,
) -> None:
    """Bits are saved with the names behind them; a load under other names must not reuse
    them blindly (e.g. a constraint added or reordered between versions)."""
    table = FleetTable(DIM)
    recs = [
        driver(i, energy=("electric", "diesel")[i % 2], refrigerated=i % 3 == 0) for i in range(30)
    ]
    table.upsert_drivers(recs, np.stack([quantized_unit(i) for i in range(30)]))
    table.save(tmp_path)
    live = tmp_path / (tmp_path / "CURRENT").read_text().strip()
    meta = json.loads((live / "meta.json").read_text())
    meta["constraints"] = list(reversed(meta["constraints"]))
    (live / "meta.json").write_text(json.dumps(meta))
    loaded = FleetTable.load(tmp_path, DIM)
    q = quantized_unit(5)
    for names in (["electric_only"], ["refrigerated"], ["electric_only", "refrigerated"]):
        o = order(constraints=names, cargo=Cargo(weight_kg=10.0))
        assert loaded.recommend(o, q) == table.recommend(o, q)
        assert table.recommend(o, q).candidates


def test_delete_moves_the_last_row_and_keeps_every_answer() -> None:
    """Swap-remove: deleting from the middle moves the last driver's row, never its data."""
    rng = np.random.default_rng(3)
    table = FleetTable(DIM)
    recs = [driver(i, SHANGHAI[0] + 0.001 * i) for i in range(50)]
    vecs = gaussian_unit(rng, 50)
    table.upsert_drivers(recs, vecs)
    ids_before = dict(zip(table.driver_ids(), faiss_ids(table), strict=True))
    for victim in ("D010", "D049", "D000", "D025"):
        assert table.delete_driver(victim)
    assert len(table) == table.flat.ntotal == 46
    ids_after = dict(zip(table.driver_ids(), faiss_ids(table), strict=True))
    assert ids_after == {d: i for d, i in ids_before.items() if d in ids_after}  # ids move along
    for i, rec in enumerate(recs):
        if rec.driver_id in ("D010", "D049", "D000", "D025"):
            assert table.get_driver(rec.driver_id) is None
            continue
        assert table.get_driver(rec.driver_id) == rec
        assert np.array_equal(table.get_vector(rec.driver_id), vecs[i])  # type: ignore[arg-type]
        hit = llama_query(
            table, VectorStoreQuery(query_embedding=vecs[i].tolist(), similarity_top_k=1)
        )
        assert hit.ids == [rec.driver_id]


def test_gpu_true_without_gpu_support_is_a_clear_error() -> None:
    if gpu.available():
        pytest.skip("this machine has faiss GPU support")
    with pytest.raises(FleetIndexError, match="faiss"):
        FleetTable(DIM, gpu=True)
    assert not FleetTable(DIM).on_gpu  # auto: CPU


@pytest.mark.gpu
@pytest.mark.skipif(not gpu.available(), reason=f"no faiss GPU: {gpu.why_not()}")
def test_gpu_replica_answers_like_the_cpu_index_and_follows_changes() -> None:
    rng = np.random.default_rng(0)
    cpu, dev = FleetTable(DIM, gpu=False), FleetTable(DIM, gpu=True)
    assert dev.on_gpu and not cpu.on_gpu
    recs = [driver(i) for i in range(500)]
    vecs = gaussian_unit(rng, 500)
    for table in (cpu, dev):
        table.upsert_drivers(recs, vecs)

    def top(table: FleetTable, q: np.ndarray) -> tuple[list[str], list[float]]:
        res = llama_query(table, VectorStoreQuery(query_embedding=q.tolist(), similarity_top_k=10))
        return res.ids or [], res.similarities or []

    for q in gaussian_unit(rng, 5):
        (ids_c, sims_c), (ids_g, sims_g) = top(cpu, q), top(dev, q)
        assert sims_g == pytest.approx(sims_c, abs=1e-5)
        assert ids_g[:3] == ids_c[:3]
    # The replica follows upserts and deletes: a new best match appears, a deleted one goes.
    q = gaussian_unit(rng, 1)[0]
    dev.upsert_drivers([driver(900)], q[None, :])
    assert top(dev, q)[0][0] == "D900"
    dev.delete_driver("D900")
    assert "D900" not in top(dev, q)[0]


def test_a_snapshot_with_a_repeated_driver_id_is_a_snapshot_error(tmp_path: Path) -> None:
    table, _, _ = _populated(20)
    table.save(tmp_path)
    live = tmp_path / (tmp_path / "CURRENT").read_text().strip()
    ids = json.loads((live / "ids.json").read_text())
    ids["driver_ids"][1] = ids["driver_ids"][0]
    (live / "ids.json").write_text(json.dumps(ids))
    with pytest.raises(SnapshotError, match="twice"):
        FleetTable.load(tmp_path, DIM)


def test_save_writes_rows_in_grid_cell_order_and_answers_stay_the_same(tmp_path: Path) -> None:
    """Neighbours' vectors end up adjacent after a save and load (locality for recommend)."""
    rng = np.random.default_rng(5)
    table = FleetTable(DIM)
    lats = SHANGHAI[0] + rng.uniform(-0.3, 0.3, 120)
    recs = [driver(i, float(lat)) for i, lat in enumerate(lats)]
    table.upsert_drivers(recs, gaussian_unit(rng, 120))
    table.save(tmp_path)
    loaded = FleetTable.load(tmp_path, DIM)
    rows_lat = [loaded.get_driver(d).position.lat for d in loaded.driver_ids()]  # type: ignore[union-attr]
    cell = GeoGrid(CELL_DEG).cell_deg  # the table's grid
    assert [int((x + 90.0) // cell) for x in rows_lat] == sorted(
        int((x + 90.0) // cell) for x in rows_lat
    )
    q = gaussian_unit(rng, 1)[0]
    for r in (3.0, 10.0, 40.0):
        assert loaded.recommend(order(radius_km=r, k=15), q) == table.recommend(
            order(radius_km=r, k=15), q
        )
