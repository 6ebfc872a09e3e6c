"""The per-slot columns ``recommend`` filters on, in numpy arrays with spare capacity.

One row per store slot: vector id, status code, position, cargo limits (capacity_kg,
cargo_volume_m3, cargo_height_m), constraint bits, whether the driver moved since its record
was stored (then its position is (lat, lng) here), and the time of its position ``ts``.

``ts`` is integer microseconds since the Unix epoch, UTC (``timestamp_us``), for every row:
the record's ``position.ts`` at upsert, the update's time after a move, ``NO_TS`` for none.
Bulk moves compare it with the incoming times to drop stale ones, vectorised.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import numpy.typing as npt

from features.models import DriverRecord

FREE = -1  # status code of a row past the live slots
NO_TS = np.iinfo(np.int64).min  # ``ts`` of a position without a time
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
# The times a datetime can hold, in microseconds: every ts column value but NO_TS lies here.
MIN_TS_US = (datetime.min.replace(tzinfo=UTC) - _EPOCH) // _MICROSECOND
MAX_TS_US = (datetime.max.replace(tzinfo=UTC) - _EPOCH) // _MICROSECOND


def timestamp_us(ts: datetime | None) -> int:
    """``ts`` as integer microseconds since the Unix epoch (a naive time is taken as UTC);
    ``NO_TS`` for None."""
    if ts is None:
        return int(NO_TS)
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    return (ts - _EPOCH) // _MICROSECOND


def datetime_of(us: int) -> datetime | None:
    """The timezone-aware UTC time of a ``ts`` value (None for ``NO_TS``)."""
    return None if us == NO_TS else _EPOCH + timedelta(microseconds=int(us))


def timestamps_of_json(blobs: Sequence[bytes]) -> npt.NDArray[np.int64]:
    """The ``position.ts`` of records given as their JSON (as ``model_dump_json`` wrote it),
    as a ``ts`` column: for changes and snapshots made before the column existed."""
    out = np.full(len(blobs), NO_TS, dtype=np.int64)
    for i, blob in enumerate(blobs):
        iso = json.loads(blob)["position"].get("ts")
        if iso is not None:
            out[i] = timestamp_us(datetime.fromisoformat(iso))
    return out


@dataclass
class Columns:
    fid: npt.NDArray[np.int64]
    status: npt.NDArray[np.int8]
    lat: npt.NDArray[np.float64]
    lng: npt.NDArray[np.float64]
    cargo: npt.NDArray[np.float64]  # (rows, 3)
    cbits: npt.NDArray[np.uint64]
    moved: npt.NDArray[np.bool_]
    ts: npt.NDArray[np.int64]  # time of the position, µs since the epoch, or NO_TS

    @classmethod
    def empty(cls, rows: int) -> Columns:
        return cls(
            fid=np.full(rows, -1, dtype=np.int64),
            status=np.full(rows, FREE, dtype=np.int8),
            lat=np.zeros(rows),
            lng=np.zeros(rows),
            cargo=np.zeros((rows, 3)),
            cbits=np.zeros(rows, dtype=np.uint64),
            moved=np.zeros(rows, dtype=bool),
            ts=np.full(rows, NO_TS, dtype=np.int64),
        )

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def capacity(self) -> int:
        return len(self.fid)

    def grown(self, need: int) -> Columns:
        """Self when ``need`` rows fit, else a copy with at least twice the capacity."""
        if need <= self.capacity:
            return self
        bigger = Columns.empty(max(need, 2 * self.capacity, 64))
        for name, old in self.arrays().items():
            getattr(bigger, name)[: len(old)] = old
        return bigger

    def head(self, rows: int) -> Columns:
        """A copy of the first ``rows`` rows."""
        return Columns(**{name: a[:rows].copy() for name, a in self.arrays().items()})

    def take(self, rows: npt.NDArray[np.int64]) -> Columns:
        """A copy of these rows, in this order."""
        return Columns(**{name: a[rows] for name, a in self.arrays().items()})

    @staticmethod
    def fields_of(
        records: Sequence[DriverRecord],
        bits: npt.NDArray[np.uint64],
        status_code: Mapping[str, int],
    ) -> dict[str, npt.NDArray[Any]]:
        """The column values of records (for ``put``)."""
        n = len(records)
        cargo = np.empty((n, 3))
        for i, r in enumerate(records):
            v = r.vehicle
            cargo[i] = (v.capacity_kg, v.cargo_volume_m3, v.cargo_height_m)
        status = np.fromiter((status_code[r.status] for r in records), dtype=np.int8, count=n)
        lat = np.fromiter((r.position.lat for r in records), dtype=np.float64, count=n)
        lng = np.fromiter((r.position.lng for r in records), dtype=np.float64, count=n)
        ts = np.fromiter((timestamp_us(r.position.ts) for r in records), dtype=np.int64, count=n)
        return {"status": status, "lat": lat, "lng": lng, "cargo": cargo, "cbits": bits, "ts": ts}

    def put(
        self,
        rows: npt.NDArray[np.int64],
        fids: npt.NDArray[np.int64],
        fields: dict[str, Any],
        blobs: Sequence[bytes],
    ) -> None:
        """Fill the rows of freshly upserted records: ``fields`` from ``fields_of``, ``blobs``
        their JSON. Fields made by a version without a ``ts`` column (an older change log's
        upsert) lack ``ts``: it is read from the JSON then."""
        self.fid[rows] = fids
        for name, values in fields.items():
            getattr(self, name)[rows] = values
        if "ts" not in fields:
            self.ts[rows] = timestamps_of_json(blobs)
        self.moved[rows] = False

    def copy_row(self, src: int, dst: int) -> None:
        for a in self.arrays().values():
            a[dst] = a[src]

    def clear_row(self, row: int) -> None:
        self.fid[row] = -1
        self.status[row] = FREE
        self.moved[row] = False
        self.ts[row] = NO_TS
