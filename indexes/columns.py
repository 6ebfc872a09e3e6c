"""The per-slot columns ``recommend`` filters on, in numpy arrays with spare capacity.

One row per store slot: vector id, status code, position, cargo limits (capacity_kg,
cargo_volume_m3, cargo_height_m), constraint bits, and whether the driver moved since its
record was stored (then its position is (lat, lng) here, with timestamp ``ts``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import numpy.typing as npt

from features.models import DriverRecord

FREE = -1  # status code of a row past the live slots


@dataclass
class Columns:
    fid: npt.NDArray[np.int64]
    status: npt.NDArray[np.int8]
    lat: npt.NDArray[np.float64]
    lng: npt.NDArray[np.float64]
    cargo: npt.NDArray[np.float64]  # (rows, 3)
    cbits: npt.NDArray[np.uint64]
    moved: npt.NDArray[np.bool_]
    ts: npt.NDArray[np.object_]  # datetime | None of a moved row

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
            ts=np.full(rows, None, dtype=object),
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
        return {"status": status, "lat": lat, "lng": lng, "cargo": cargo, "cbits": bits}

    def put(
        self, rows: npt.NDArray[np.int64], fids: npt.NDArray[np.int64], fields: dict[str, Any]
    ) -> None:
        """Fill the rows of freshly upserted records (``fields`` from ``fields_of``)."""
        self.fid[rows] = fids
        for name, values in fields.items():
            getattr(self, name)[rows] = values
        self.moved[rows] = False
        self.ts[rows] = None

    def copy_row(self, src: int, dst: int) -> None:
        for a in self.arrays().values():
            a[dst] = a[src]

    def clear_row(self, row: int) -> None:
        self.fid[row] = -1
        self.status[row] = FREE
        self.moved[row] = False
        self.ts[row] = None
