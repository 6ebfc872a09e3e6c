"""A uniform lat/lng grid over small integer ids, for "who is within r km of this point".

Cells are ``cell_deg`` degrees square, keyed by (row, column) counted from (-90, -180). The cell
size is adjusted so that a whole number of columns spans 360 degrees, which makes the column
index wrap exactly at the antimeridian (-180 and +180 land in the same column). A query
enumerates only the cells of the circle's bounding box (or the occupied cells, when those are
fewer), then filters the gathered points by exact haversine distance, so the grid can only
ever be too generous before that filter, never too strict.
"""

from __future__ import annotations

import math

import numpy as np
import numpy.typing as npt

from features.geo import EARTH_RADIUS_KM, haversine_km_many

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Slack on the bounding box, in degrees (about 1 cm): rounding in the box arithmetic must not
# drop a point that the exact haversine filter would keep.
_BOX_SLACK_DEG = 1e-7


class GeoGrid:
    """Positions of ids (non-negative ints, e.g. store slots) in a lat/lng grid.

    ``move`` and ``remove`` are O(1); ``within`` costs the cells it visits plus one vectorised
    haversine over the points found in them.
    """

    def __init__(self, cell_deg: float = 0.05) -> None:
        if not 0.0 < cell_deg <= 90.0 or not math.isfinite(cell_deg):
            raise ValueError(f"cell_deg must be in (0, 90], got {cell_deg!r}")
        self._ncols = max(1, round(360.0 / cell_deg))
        self._cell = 360.0 / self._ncols
        self._nrows = math.ceil(180.0 / self._cell)
        self._cells: dict[int, set[int]] = {}
        self._key_of: dict[int, int] = {}
        self._lat: FloatArray = np.zeros(0)
        self._lng: FloatArray = np.zeros(0)

    @classmethod
    def from_cell_km(cls, cell_km: float) -> GeoGrid:
        """A grid whose cells are about ``cell_km`` tall (north-south)."""
        return cls(math.degrees(cell_km / EARTH_RADIUS_KM))

    @property
    def cell_deg(self) -> float:
        return self._cell

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, ident: object) -> bool:
        return ident in self._key_of

    def position(self, ident: int) -> tuple[float, float]:
        if ident not in self._key_of:
            raise KeyError(ident)
        return float(self._lat[ident]), float(self._lng[ident])

    def move(self, ident: int, lat: float, lng: float) -> None:
        """Insert ``ident`` at (lat, lng), or move it there."""
        if ident < 0:
            raise ValueError(f"ids must be non-negative, got {ident}")
        if not (-90.0 <= lat <= 90.0 and -180.0 <= lng <= 180.0):
            raise ValueError(f"position out of range: lat={lat!r}, lng={lng!r}")
        key = self._key(lat, lng)
        old = self._key_of.get(ident)
        if old != key:
            if old is not None:
                self._discard(old, ident)
            self._cells.setdefault(key, set()).add(ident)
            self._key_of[ident] = key
        if ident >= len(self._lat):
            self._grow(ident + 1)
        self._lat[ident] = lat
        self._lng[ident] = lng

    def move_many(self, idents: npt.ArrayLike, lats: npt.ArrayLike, lngs: npt.ArrayLike) -> None:
        """``move`` for many ids of the grid at once (validated first; a repeated id: last wins).

        Cells are computed vectorised with the same float operations as ``move``; only the ids
        whose cell changes touch the cell sets (a short move stays in its cell).
        """
        ids = np.asarray(idents, dtype=np.int64)
        la = np.asarray(lats, dtype=np.float64)
        ln = np.asarray(lngs, dtype=np.float64)
        if not ids.shape == la.shape == ln.shape or ids.ndim != 1:
            raise ValueError(f"shapes differ: ids {ids.shape}, lats {la.shape}, lngs {ln.shape}")
        if not ((la >= -90.0) & (la <= 90.0) & (ln >= -180.0) & (ln <= 180.0)).all():
            raise ValueError("positions out of range (or not finite)")
        key_of = self._key_of
        if any(i not in key_of for i in ids.tolist()):
            raise KeyError("move_many moves ids already in the grid; use move to insert")
        rows = np.minimum(np.floor((la + 90.0) / self._cell).astype(np.int64), self._nrows - 1)
        cols = np.floor((ln + 180.0) / self._cell).astype(np.int64) % self._ncols
        keys = (rows * self._ncols + cols).tolist()
        cells = self._cells
        for ident, key in zip(ids.tolist(), keys, strict=True):
            old = key_of[ident]
            if old != key:
                self._discard(old, ident)
                cells.setdefault(key, set()).add(ident)
                key_of[ident] = key
        self._lat[ids] = la  # numpy assigns in order: for a repeated id the last value stays
        self._lng[ids] = ln

    def remove(self, ident: int) -> bool:
        key = self._key_of.pop(ident, None)
        if key is None:
            return False
        self._discard(key, ident)
        return True

    def within(self, lat: float, lng: float, radius_km: float) -> IntArray:
        """Ids whose haversine distance to (lat, lng) is at most ``radius_km``."""
        return self.within_distances(lat, lng, radius_km)[0]

    def within_distances(
        self, lat: float, lng: float, radius_km: float
    ) -> tuple[IntArray, FloatArray]:
        """Ids within ``radius_km`` of (lat, lng) and their distances in km (same order)."""
        if not radius_km >= 0.0:
            raise ValueError(f"radius_km must be >= 0, got {radius_km!r}")
        ids = np.fromiter(self._gather(lat, lng, radius_km), dtype=np.int64)
        if ids.size == 0:
            return ids, np.zeros(0)
        dist = haversine_km_many(lat, lng, self._lat[ids], self._lng[ids])
        keep = dist <= radius_km
        return ids[keep], dist[keep]

    # -- internals ---------------------------------------------------------------------------

    def _row(self, lat: float) -> int:
        return min(math.floor((lat + 90.0) / self._cell), self._nrows - 1)

    def _col(self, lng: float) -> int:
        return math.floor((lng + 180.0) / self._cell) % self._ncols

    def _key(self, lat: float, lng: float) -> int:
        return self._row(lat) * self._ncols + self._col(lng)

    def _discard(self, key: int, ident: int) -> None:
        cell = self._cells[key]
        cell.discard(ident)
        if not cell:
            del self._cells[key]

    def _grow(self, need: int) -> None:
        size = max(need, 2 * len(self._lat), 64)
        for name in ("_lat", "_lng"):
            old = getattr(self, name)
            new = np.zeros(size)
            new[: len(old)] = old
            setattr(self, name, new)

    def _gather(self, lat: float, lng: float, radius_km: float) -> list[int]:
        """Ids in every cell that may hold a point within the radius (a superset)."""
        delta = radius_km / EARTH_RADIUS_KM  # angular radius, radians
        if delta >= math.pi:
            return list(self._key_of)
        dlat = math.degrees(delta) + _BOX_SLACK_DEG
        lat_lo, lat_hi = lat - dlat, lat + dlat
        row_lo, row_hi = self._row(max(lat_lo, -90.0)), self._row(min(lat_hi, 90.0))
        # Longitude half-width of a spherical cap: asin(sin(delta) / cos(lat)), valid while the
        # cap does not contain a pole; when it does (or nearly), every longitude is in play.
        full = lat_hi >= 90.0 or lat_lo <= -90.0
        if not full:
            s = math.sin(delta) / math.cos(math.radians(lat))
            full = s >= 1.0
        if not full:
            dlng = math.degrees(math.asin(s)) + _BOX_SLACK_DEG
            col_lo = math.floor((lng - dlng + 180.0) / self._cell)  # unwrapped
            col_hi = math.floor((lng + dlng + 180.0) / self._cell)
            full = col_hi - col_lo + 1 >= self._ncols
        if full:
            col_lo, col_hi = 0, self._ncols - 1
        span = col_hi - col_lo
        nrows = row_hi - row_lo + 1
        out: list[int] = []
        if nrows * (span + 1) <= len(self._cells):
            cells = self._cells
            ncols = self._ncols
            for row in range(row_lo, row_hi + 1):
                base = row * ncols
                for col in range(col_lo, col_hi + 1):
                    cell = cells.get(base + col % ncols)
                    if cell:
                        out.extend(cell)
        else:
            # Fewer occupied cells than cells in the box (wide radius, sparse grid, poles):
            # test each occupied cell against the box instead, wraparound included.
            for key, cell in self._cells.items():
                row, col = divmod(key, self._ncols)
                if row_lo <= row <= row_hi and (col - col_lo) % self._ncols <= span:
                    out.extend(cell)
        return out
