"""A uniform lat/lng grid over small integer ids, for "who is within r km of this point".

Cells are ``cell_deg`` degrees square, keyed by (row, column) counted from (-90, -180). The cell
size is adjusted so that a whole number of columns spans 360 degrees, which makes the column
index wrap exactly at the antimeridian (-180 and +180 land in the same column). A query
enumerates only the cells of the circle's bounding box (or the occupied cells, when those are
fewer), then filters the gathered points by exact haversine distance, so the grid can only
ever be too generous before that filter, never too strict.

Each occupied cell is a numpy array of ids with a fill count; an id knows its cell key and its
index in that array, so a move or a remove is a swap with the cell's last id (O(1)), and a
query concatenates array slices instead of iterating Python sets.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import numpy.typing as npt

from features.geo import EARTH_RADIUS_KM, haversine_km_many

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Slack on the bounding box, in degrees (about 1 cm): rounding in the box arithmetic must not
# drop a point that the exact haversine filter would keep.
_BOX_SLACK_DEG = 1e-7
_ABSENT = -1  # cell key of an id that is not in the grid


class _Cell:
    """The ids of one cell: ``ids[:n]`` (capacity doubles when full)."""

    __slots__ = ("ids", "n")

    def __init__(self) -> None:
        self.ids: IntArray = np.empty(8, dtype=np.int64)
        self.n = 0


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
        self._cells: dict[int, _Cell] = {}
        self._count = 0
        self._key: IntArray = np.zeros(0, dtype=np.int64)  # cell key per id, or _ABSENT
        self._at: IntArray = np.zeros(0, dtype=np.int64)  # index of the id in its cell
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
        return self._count

    def __contains__(self, ident: object) -> bool:
        if isinstance(ident, bool) or not isinstance(ident, int | np.integer):
            return False
        return bool(0 <= ident < len(self._key) and self._key[ident] != _ABSENT)

    def contains_many(self, ids: IntArray) -> npt.NDArray[np.bool_]:
        """``id in grid`` for each of many non-negative ids."""
        inside = ids < len(self._key)
        inside[inside] = self._key[ids[inside]] != _ABSENT
        return inside

    def position(self, ident: int) -> tuple[float, float]:
        if ident not in self:
            raise KeyError(ident)
        return float(self._lat[ident]), float(self._lng[ident])

    def cell_keys(self, lats: npt.ArrayLike, lngs: npt.ArrayLike) -> IntArray:
        """The cell key of each position (validated), with the same float operations as
        ``move``; keys grow row by row, so sorting by key groups neighbours together."""
        la = np.asarray(lats, dtype=np.float64)
        ln = np.asarray(lngs, dtype=np.float64)
        if not ((la >= -90.0) & (la <= 90.0) & (ln >= -180.0) & (ln <= 180.0)).all():
            raise ValueError("positions out of range (or not finite)")
        rows = np.minimum(np.floor((la + 90.0) / self._cell).astype(np.int64), self._nrows - 1)
        cols = np.floor((ln + 180.0) / self._cell).astype(np.int64) % self._ncols
        return rows * self._ncols + cols

    def move(self, ident: int, lat: float, lng: float) -> None:
        """Insert ``ident`` at (lat, lng), or move it there."""
        if ident < 0:
            raise ValueError(f"ids must be non-negative, got {ident}")
        if not (-90.0 <= lat <= 90.0 and -180.0 <= lng <= 180.0):
            raise ValueError(f"position out of range: lat={lat!r}, lng={lng!r}")
        if ident >= len(self._key):
            self._grow(ident + 1)
        key = self._row(lat) * self._ncols + self._col(lng)
        old = int(self._key[ident])
        if old != key:
            if old != _ABSENT:
                self._discard(old, ident)
            self._append(key, ident)
        self._lat[ident] = lat
        self._lng[ident] = lng

    def move_many(self, idents: npt.ArrayLike, lats: npt.ArrayLike, lngs: npt.ArrayLike) -> None:
        """``move`` for many ids of the grid at once (validated first; a repeated id: last wins).

        Cells are computed vectorised with the same float operations as ``move``; only the ids
        whose cell changes run Python code (a short move stays in its cell).
        """
        ids = np.asarray(idents, dtype=np.int64)
        la = np.asarray(lats, dtype=np.float64)
        ln = np.asarray(lngs, dtype=np.float64)
        keys = self._keys(ids, la, ln)
        known = (ids >= 0) & (ids < len(self._key))
        if not known.all() or (self._key[ids] == _ABSENT).any():
            raise KeyError("move_many moves ids already in the grid; use move to insert")
        if ids.size > 1:  # a repeated id: only its last move counts
            last = ids.size - 1 - np.unique(ids[::-1], return_index=True)[1]
            ids, la, ln, keys = ids[last], la[last], ln[last], keys[last]
        changed = np.flatnonzero(keys != self._key[ids])
        for ident, key in zip(ids[changed].tolist(), keys[changed].tolist(), strict=True):
            self._discard(int(self._key[ident]), ident)
            self._append(key, ident)
        self._lat[ids] = la
        self._lng[ids] = ln

    def insert_many(self, idents: npt.ArrayLike, lats: npt.ArrayLike, lngs: npt.ArrayLike) -> None:
        """Insert ids not yet in the grid (distinct), grouped by cell: one numpy copy per cell
        instead of Python work per id. For loading and bulk upserts."""
        ids = np.asarray(idents, dtype=np.int64)
        keys = self._keys(ids, lats, lngs)
        if ids.size == 0:
            return
        if ids.min() < 0:
            raise ValueError(f"ids must be non-negative, got {int(ids.min())}")
        if ids.max() >= len(self._key):
            self._grow(int(ids.max()) + 1)
        if (self._key[ids] != _ABSENT).any() or _repeats(ids):
            raise ValueError("insert_many inserts distinct ids not in the grid; use move_many")
        self._lat[ids] = lats
        self._lng[ids] = lngs
        self._key[ids] = keys
        self._count += ids.size
        order = np.argsort(keys, kind="stable")
        ids, keys = ids[order], keys[order]
        bounds = [0, *(np.flatnonzero(np.diff(keys)) + 1).tolist(), ids.size]
        for lo, hi in itertools.pairwise(bounds):
            key = int(keys[lo])
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = _Cell()
            block = ids[lo:hi]
            end = cell.n + block.size
            if end > len(cell.ids):
                grown = np.empty(max(end, 2 * len(cell.ids)), dtype=np.int64)
                grown[: cell.n] = cell.ids[: cell.n]
                cell.ids = grown
            cell.ids[cell.n : end] = block
            self._at[block] = np.arange(cell.n, end)
            cell.n = end

    def remove(self, ident: int) -> bool:
        if ident not in self:
            return False
        self._discard(int(self._key[ident]), ident)
        return True

    def within(self, lat: float, lng: float, radius_km: float) -> IntArray:
        """Ids whose haversine distance to (lat, lng) is at most ``radius_km``."""
        return self.within_distances(lat, lng, radius_km)[0]

    def within_distances(
        self, lat: float, lng: float, radius_km: float
    ) -> tuple[IntArray, FloatArray]:
        """Ids within ``radius_km`` of (lat, lng) and their distances in km (same order)."""
        ids = self.near(lat, lng, radius_km)
        dist = self.distances(ids, lat, lng)
        keep = dist <= radius_km
        return ids[keep], dist[keep]

    def near(self, lat: float, lng: float, radius_km: float) -> IntArray:
        """Ids in every cell that may hold a point within the radius: a superset of
        ``within``, in ascending order (callers filter it further, then by ``distances``)."""
        if not radius_km >= 0.0:
            raise ValueError(f"radius_km must be >= 0, got {radius_km!r}")
        parts = [c.ids[: c.n] for c in self._gather(lat, lng, radius_km)]
        if not parts:
            return np.zeros(0, dtype=np.int64)
        ids = np.concatenate(parts)
        ids.sort()  # ascending ids read the store's columns and vectors front to back
        return ids

    def distances(self, ids: IntArray, lat: float, lng: float) -> FloatArray:
        """Haversine km from (lat, lng) to each id (ids must be in the grid)."""
        if ids.size == 0:
            return np.zeros(0)
        return haversine_km_many(lat, lng, self._lat[ids], self._lng[ids])

    # -- internals ---------------------------------------------------------------------------

    def _row(self, lat: float) -> int:
        return min(math.floor((lat + 90.0) / self._cell), self._nrows - 1)

    def _col(self, lng: float) -> int:
        return math.floor((lng + 180.0) / self._cell) % self._ncols

    def _keys(self, ids: IntArray, lats: npt.ArrayLike, lngs: npt.ArrayLike) -> IntArray:
        """Validated cell keys, vectorised with the same float operations as ``move``."""
        la = np.asarray(lats, dtype=np.float64)
        ln = np.asarray(lngs, dtype=np.float64)
        if not ids.shape == la.shape == ln.shape or ids.ndim != 1:
            raise ValueError(f"shapes differ: ids {ids.shape}, lats {la.shape}, lngs {ln.shape}")
        return self.cell_keys(la, ln)

    def _append(self, key: int, ident: int) -> None:
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = _Cell()
        if cell.n == len(cell.ids):
            cell.ids = np.concatenate([cell.ids, np.empty(cell.n, dtype=np.int64)])
        cell.ids[cell.n] = ident
        self._at[ident] = cell.n
        self._key[ident] = key
        cell.n += 1
        self._count += 1

    def _discard(self, key: int, ident: int) -> None:
        """Swap the cell's last id into ``ident``'s place."""
        cell = self._cells[key]
        cell.n -= 1
        i, last = int(self._at[ident]), int(cell.ids[cell.n])
        cell.ids[i] = last
        self._at[last] = i
        self._key[ident] = _ABSENT
        self._count -= 1
        if cell.n == 0:
            del self._cells[key]

    def _grow(self, need: int) -> None:
        size = max(need, 2 * len(self._key), 64)
        for name, fill in (("_key", _ABSENT), ("_at", 0), ("_lat", 0.0), ("_lng", 0.0)):
            old = getattr(self, name)
            new = np.full(size, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _gather(self, lat: float, lng: float, radius_km: float) -> list[_Cell]:
        """Every occupied cell that may hold a point within the radius."""
        delta = radius_km / EARTH_RADIUS_KM  # angular radius, radians
        if delta >= math.pi:
            return list(self._cells.values())
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
        cells = self._cells
        ncols = self._ncols
        if nrows * (span + 1) <= len(cells):
            found = (
                cells.get(row * ncols + col % ncols)
                for row in range(row_lo, row_hi + 1)
                for col in range(col_lo, col_hi + 1)
            )
            return [c for c in found if c is not None]
        # Fewer occupied cells than cells in the box (wide radius, sparse grid, poles):
        # test each occupied cell against the box instead, wraparound included.
        out = []
        for key, cell in cells.items():
            row, col = divmod(key, ncols)
            if row_lo <= row <= row_hi and (col - col_lo) % ncols <= span:
                out.append(cell)
        return out


def _repeats(ids: IntArray) -> bool:
    """Whether non-negative ``ids`` hold a value twice (O(n + max id), no sort)."""
    seen = np.zeros(int(ids.max()) + 1, dtype=bool)
    seen[ids] = True
    return int(seen.sum()) != ids.size
