"""Saving the fleet index while it changes: ``save`` copies the vectors in short chunks
outside the table's lock, so an upsert or delete meanwhile must never publish a snapshot
whose vectors belong to other drivers (or other versions of a driver) than its records."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from indexes import FleetTable
from indexes import table as table_module
from tests.test_index import DIM, driver


def version_vector(i: int, version: int) -> np.ndarray:
    v = np.random.default_rng([i, version]).normal(size=DIM).astype(np.float32)
    return v / np.linalg.norm(v)


def versioned(i: int, version: int) -> tuple[list, np.ndarray]:
    """Driver i's record with its version in capacity_kg, and the vector of that version."""
    return [driver(i, capacity=float(version))], version_vector(i, version)[None, :]


def assert_records_match_vectors(table: FleetTable) -> None:
    for driver_id in table.driver_ids():
        rec = table.get_driver(driver_id)
        assert rec is not None
        expected = version_vector(int(driver_id[1:]), int(rec.vehicle.capacity_kg))
        np.testing.assert_array_equal(table.get_vector(driver_id), expected, err_msg=driver_id)


@pytest.mark.parametrize("chunk", [1, 7])
def test_a_save_while_vectors_change_publishes_a_consistent_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    # Tiny chunks: the writer below gets in between them, so copies restart (and, after
    # enough restarts, finish holding the lock).
    monkeypatch.setattr(table_module, "_SAVE_CHUNK", chunk)
    table = FleetTable(DIM)
    for i in range(120):
        table.upsert_drivers(*versioned(i, 0))
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer() -> None:
        try:
            version = 1
            while not stop.is_set():
                i = version % 150
                table.upsert_drivers(*versioned(i, version))  # replace, or insert 120..149
                table.delete_driver(f"D{(version * 7) % 150:03d}")  # swap-remove moves a row
                version += 1
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=writer)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads switch often: the writer gets between chunks
    thread.start()
    try:
        for _ in range(6):
            table.save(tmp_path)
            assert_records_match_vectors(FleetTable.load(tmp_path, DIM))
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert not errors
    table.save(tmp_path)
    loaded = FleetTable.load(tmp_path, DIM)
    assert sorted(loaded.driver_ids()) == sorted(table.driver_ids())
    assert_records_match_vectors(loaded)
