"""A uniform lat/lng grid over small integer ids, for "who is within r km of this point".

Cells are ``cell_deg`` degrees square, keyed by (row, column) counted from (-90, -180). The cell
size is adjusted so that a whole number of columns spans 360 degrees, which makes the column
index wrap exactly at the antimeridian (-180 and +180 land in the same column). A query
enumerates only the cells of the circle's bounding box (or the occupied cells, when those are
fewer), then keeps the gathered points whose haversine distance is at most the radius, so the
grid can only ever be too generous before that filter, never too strict.

The points live in an *arena*: parallel numpy arrays (id, lat, lng, the unit 3-vector of the
position, and any *payload* columns the owner declares, e.g. ``recommend``'s int8 vectors)
in which each occupied cell owns one contiguous block with spare room. A query reads its
cells' blocks in place, a few contiguous runs, however the points were inserted. An id knows
its cell key and its arena row: a move inside a cell rewrites the row, a move to another cell
or a remove copies the cell's last row into the hole (O(1)); a full block moves to the arena's
end with twice the room, and when the abandoned blocks add up to half the live rows the arena
is rebuilt in cell-key order (``compact``: neighbouring cells adjacent again).

The radius test is exact: for the unit 3-vectors p of a point and c of the centre,
``dot(p, c) = cos(d / R)``; a point whose dot lies more than ``COS_BAND`` from
``cos(r / R)`` is inside or outside by a wide margin (rounding in the dot is ~1e-15), and
only those within the band get the haversine test itself.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from features.geo import EARTH_RADIUS_KM, haversine_km_many

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]

# Slack on the bounding box, in degrees (about 1 cm): rounding in the box arithmetic must not
# drop a point that the exact haversine filter would keep.
_BOX_SLACK_DEG = 1e-7
_ABSENT = -1  # cell key of an id that is not in the grid
_FREE = -1  # id of an arena row no point holds
COS_BAND = 1e-12  # dot products this close to cos(r / R) are decided by haversine
_MIN_BLOCK = 8  # rows of a new cell's block
_COMPACT_AFTER = 4096  # abandoned rows tolerated beyond half the live ones


@dataclass
class _Cell:
    """A cell's block of the arena: rows ``start .. start + n`` live, room for ``cap``."""

    start: int
    cap: int
    n: int = 0


class GeoGrid:
    """Positions of ids (non-negative ints, e.g. store slots) in a lat/lng grid.

    ``move`` and ``remove`` are O(1); ``within`` costs the cells it visits plus a few
    vectorised passes over the points found in them. ``payload`` names extra arena columns
    (name -> (shape of one row, dtype)) that travel with each point: ``put`` writes them,
    ``column`` reads them at arena rows (``near_rows``, ``within_rows``).
    """

    def __init__(
        self,
        cell_deg: float = 0.05,
        payload: Mapping[str, tuple[tuple[int, ...], npt.DTypeLike]] | None = None,
    ) -> None:
        if not 0.0 < cell_deg <= 90.0 or not math.isfinite(cell_deg):
            raise ValueError(f"cell_deg must be in (0, 90], got {cell_deg!r}")
        self._ncols = max(1, round(360.0 / cell_deg))
        self._cell = 360.0 / self._ncols
        self._nrows = math.ceil(180.0 / self._cell)
        self._cells: dict[int, _Cell] = {}
        self._count = 0
        self._key: IntArray = np.zeros(0, dtype=np.int64)  # cell key per id, or _ABSENT
        self._pos: IntArray = np.zeros(0, dtype=np.int64)  # arena row per id
        self._spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "ids": ((), np.dtype(np.int64)),
            "lat": ((), np.dtype(np.float64)),
            "lng": ((), np.dtype(np.float64)),
            "xyz": ((3,), np.dtype(np.float64)),
        }
        for name, (shape, dtype) in (payload or {}).items():
            if name in self._spec:
                raise ValueError(f"payload column {name!r} is taken")
            self._spec[name] = (tuple(shape), np.dtype(dtype))
        self._arena = self._new_arena(0)
        self._end = 0  # arena rows handed to blocks so far
        self._garbage = 0  # rows of abandoned blocks (compacted away)

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
        row = self._pos[ident]
        return float(self._arena["lat"][row]), float(self._arena["lng"][row])

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

    # -- changes -----------------------------------------------------------------------------

    def move(self, ident: int, lat: float, lng: float) -> None:
        """Insert ``ident`` at (lat, lng), or move it there (its payload moves with it)."""
        if ident < 0:
            raise ValueError(f"ids must be non-negative, got {ident}")
        if not (-90.0 <= lat <= 90.0 and -180.0 <= lng <= 180.0):
            raise ValueError(f"position out of range: lat={lat!r}, lng={lng!r}")
        if ident >= len(self._key):
            self._grow(ident + 1)
        key = self._row(lat) * self._ncols + self._col(lng)
        old = int(self._key[ident])
        if old == _ABSENT:
            self._append(key, ident)
        elif old != key:
            self._relink(ident, old, key)
        self._place(np.array([self._pos[ident]]), np.array([lat]), np.array([lng]))
        self._maybe_compact()

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
            self._relink(ident, int(self._key[ident]), key)
        self._place(self._pos[ids], la, ln)
        self._maybe_compact()

    def insert_many(self, idents: npt.ArrayLike, lats: npt.ArrayLike, lngs: npt.ArrayLike) -> None:
        """Insert ids not yet in the grid (distinct), grouped by cell: one numpy copy per cell
        instead of Python work per id. For loading and bulk upserts."""
        ids = np.asarray(idents, dtype=np.int64)
        la = np.asarray(lats, dtype=np.float64)
        ln = np.asarray(lngs, dtype=np.float64)
        keys = self._keys(ids, la, ln)
        if ids.size == 0:
            return
        if ids.min() < 0:
            raise ValueError(f"ids must be non-negative, got {int(ids.min())}")
        if ids.max() >= len(self._key):
            self._grow(int(ids.max()) + 1)
        if (self._key[ids] != _ABSENT).any() or _repeats(ids):
            raise ValueError("insert_many inserts distinct ids not in the grid; use move_many")
        order = np.argsort(keys, kind="stable")
        ids, keys, la, ln = ids[order], keys[order], la[order], ln[order]
        bounds = [0, *(np.flatnonzero(np.diff(keys)) + 1).tolist(), ids.size]
        rows = np.empty(ids.size, dtype=np.int64)
        for lo, hi in itertools.pairwise(bounds):
            cell = self._room(int(keys[lo]), hi - lo)
            rows[lo:hi] = np.arange(cell.start + cell.n, cell.start + cell.n + hi - lo)
            cell.n += hi - lo
        self._arena["ids"][rows] = ids
        self._key[ids] = keys
        self._pos[ids] = rows
        self._count += ids.size
        self._place(rows, la, ln)
        self._maybe_compact()

    def remove(self, ident: int) -> bool:
        if ident not in self:
            return False
        self._discard(int(self._key[ident]), int(self._pos[ident]))
        self._key[ident] = _ABSENT
        self._count -= 1
        return True

    def rename(self, old: int, new: int) -> None:
        """Give ``old``'s point (position and payload) to ``new``, which is not in the grid."""
        if old not in self or new in self or new < 0:
            raise KeyError(f"rename {old} -> {new}: {old} absent or {new} present")
        if new >= len(self._key):
            self._grow(new + 1)
        row = self._pos[old]
        self._arena["ids"][row] = new
        self._key[new], self._pos[new] = self._key[old], row
        self._key[old] = _ABSENT

    def put(self, idents: IntArray, name: str, values: npt.ArrayLike) -> None:
        """Write payload column ``name`` of ids in the grid."""
        self._arena[name][self._pos[idents]] = values

    # -- queries -----------------------------------------------------------------------------

    def column(self, name: str) -> npt.NDArray:
        """An arena column (read it at rows from ``near_rows`` or ``within_rows``; valid until
        the grid next changes)."""
        return self._arena[name]

    def within(self, lat: float, lng: float, radius_km: float) -> IntArray:
        """Ids whose haversine distance to (lat, lng) is at most ``radius_km``."""
        return self.within_distances(lat, lng, radius_km)[0]

    def within_distances(
        self, lat: float, lng: float, radius_km: float
    ) -> tuple[IntArray, FloatArray]:
        """Ids within ``radius_km`` of (lat, lng) and their distances in km (same order)."""
        rows = self.within_rows(lat, lng, radius_km)
        return self._arena["ids"][rows], self.row_distances(rows, lat, lng)

    def near(self, lat: float, lng: float, radius_km: float) -> IntArray:
        """Ids in every cell that may hold a point within the radius: a superset of
        ``within``, in ascending order."""
        ids = self._arena["ids"][self.near_rows(lat, lng, radius_km)]
        ids.sort()
        return ids

    def near_rows(self, lat: float, lng: float, radius_km: float) -> IntArray:
        """Arena rows of every point in the cells that may hold one within the radius,
        ascending (runs of contiguous rows)."""
        if not radius_km >= 0.0:
            raise ValueError(f"radius_km must be >= 0, got {radius_km!r}")
        cells = self._gather(lat, lng, radius_km)
        if not cells:
            return np.zeros(0, dtype=np.int64)
        starts = np.fromiter((c.start for c in cells), dtype=np.int64, count=len(cells))
        counts = np.fromiter((c.n for c in cells), dtype=np.int64, count=len(cells))
        order = np.argsort(starts)
        return _ranges(starts[order], counts[order])

    def within_rows(self, lat: float, lng: float, radius_km: float) -> IntArray:
        """Arena rows of the points whose haversine distance to (lat, lng) is at most
        ``radius_km``, ascending (see the module docstring for the exact test)."""
        rows = self.near_rows(lat, lng, radius_km)
        if not rows.size:
            return rows
        centre = unit_vectors(np.array([lat]), np.array([lng]))[0]
        cos = np.einsum("ij,j->i", self._arena["xyz"][rows], centre)  # no threaded BLAS
        limit = math.cos(radius_km / EARTH_RADIUS_KM)
        keep = cos >= limit + COS_BAND
        band = np.flatnonzero(np.abs(cos - limit) < COS_BAND)
        if band.size:
            keep[band] = self.row_distances(rows[band], lat, lng) <= radius_km
        return rows[keep]

    def row_distances(self, rows: IntArray, lat: float, lng: float) -> FloatArray:
        """Haversine km from (lat, lng) to the points at these arena rows."""
        if rows.size == 0:
            return np.zeros(0)
        return haversine_km_many(lat, lng, self._arena["lat"][rows], self._arena["lng"][rows])

    def distances(self, ids: IntArray, lat: float, lng: float) -> FloatArray:
        """Haversine km from (lat, lng) to each id (ids must be in the grid)."""
        return self.row_distances(self._pos[ids], lat, lng)

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

    def _place(self, rows: IntArray, lats: FloatArray, lngs: FloatArray) -> None:
        arena = self._arena
        arena["lat"][rows] = lats
        arena["lng"][rows] = lngs
        arena["xyz"][rows] = unit_vectors(lats, lngs)

    def _append(self, key: int, ident: int) -> int:
        """A new row for ``ident`` at the end of cell ``key`` (its columns still to fill)."""
        cell = self._room(key, 1)
        row = cell.start + cell.n
        cell.n += 1
        self._arena["ids"][row] = ident
        self._key[ident] = key
        self._pos[ident] = row
        self._count += 1
        return row

    def _relink(self, ident: int, old: int, key: int) -> None:
        """Move ``ident``'s row (all columns) from cell ``old`` to the end of cell ``key``."""
        cell = self._room(key, 1)
        row, src = cell.start + cell.n, int(self._pos[ident])
        cell.n += 1
        for a in self._arena.values():
            a[row] = a[src]
        self._discard(old, src)
        self._key[ident] = key
        self._pos[ident] = row

    def _discard(self, key: int, row: int) -> None:
        """Free ``row`` of cell ``key``: the cell's last row is copied into it."""
        cell = self._cells[key]
        cell.n -= 1
        last = cell.start + cell.n
        arena = self._arena
        if row != last:
            for a in arena.values():
                a[row] = a[last]
            self._pos[arena["ids"][row]] = row
        arena["ids"][last] = _FREE
        if cell.n == 0:
            del self._cells[key]
            self._garbage += cell.cap

    def _room(self, key: int, more: int) -> _Cell:
        """Cell ``key`` with room for ``more`` rows (a new block, or its block moved to the
        arena's end with at least twice the room)."""
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = _Cell(
                self._claim(max(_MIN_BLOCK, more)), max(_MIN_BLOCK, more)
            )
        elif cell.n + more > cell.cap:
            cap = max(2 * cell.cap, cell.n + more)
            start = self._claim(cap)
            for a in self._arena.values():
                a[start : start + cell.n] = a[cell.start : cell.start + cell.n]
            self._arena["ids"][cell.start : cell.start + cell.cap] = _FREE
            self._pos[self._arena["ids"][start : start + cell.n]] = np.arange(start, start + cell.n)
            self._garbage += cell.cap
            cell.start, cell.cap = start, cap
        return cell

    def _claim(self, rows: int) -> int:
        """The first of ``rows`` fresh arena rows (the arena grows by doubling)."""
        start = self._end
        self._end += rows
        if self._end > len(self._arena["ids"]):
            bigger = self._new_arena(max(self._end, 2 * len(self._arena["ids"]), 1024))
            for name, a in self._arena.items():
                bigger[name][:start] = a[:start]
            self._arena = bigger
        return start

    def _new_arena(self, rows: int) -> dict[str, npt.NDArray]:
        arena = {
            name: np.zeros((rows, *shape), dtype) for name, (shape, dtype) in self._spec.items()
        }
        arena["ids"][:] = _FREE
        return arena

    def _maybe_compact(self) -> None:
        if self._garbage > self._count // 2 + _COMPACT_AFTER:
            self.compact()

    def compact(self) -> None:
        """Rebuild the arena in cell-key order, each block with a quarter more room."""
        cells = [self._cells[k] for k in sorted(self._cells)]
        if not cells:
            self._arena, self._end, self._garbage = self._new_arena(0), 0, 0
            return
        counts = np.fromiter((c.n for c in cells), dtype=np.int64, count=len(cells))
        caps = counts + np.maximum(_MIN_BLOCK // 2, counts // 4)
        starts = np.concatenate([[0], np.cumsum(caps)[:-1]]).astype(np.int64)
        src = _ranges(
            np.fromiter((c.start for c in cells), dtype=np.int64, count=len(cells)), counts
        )
        dst = _ranges(starts, counts)
        total = int(caps.sum())
        arena = self._new_arena(max(total + total // 8, 1024))
        for name, a in self._arena.items():
            arena[name][dst] = a[src]
        self._arena = arena
        self._pos[arena["ids"][dst]] = dst
        for cell, start, cap in zip(cells, starts.tolist(), caps.tolist(), strict=True):
            cell.start, cell.cap = start, cap
        self._end = total
        self._garbage = 0

    def _grow(self, need: int) -> None:
        size = max(need, 2 * len(self._key), 64)
        for name, fill in (("_key", _ABSENT), ("_pos", 0)):
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


def _ranges(starts: IntArray, counts: IntArray) -> IntArray:
    """The rows ``start .. start + count`` of each (start, count), concatenated."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    nonempty = counts > 0
    starts, counts = starts[nonempty], counts[nonempty]
    # A run of ones, with a jump at the first row of each range to that range's start.
    steps = np.ones(total, dtype=np.int64)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    steps[firsts] = starts - np.concatenate([[0], starts[:-1] + counts[:-1] - 1])
    steps[0] = starts[0]
    return np.cumsum(steps)


def unit_vectors(lats: FloatArray, lngs: FloatArray) -> FloatArray:
    """(n, 3) points on the unit sphere."""
    phi, lam = np.radians(lats), np.radians(lngs)
    cos_phi = np.cos(phi)
    return np.stack([cos_phi * np.cos(lam), cos_phi * np.sin(lam), np.sin(phi)], axis=-1)


def _repeats(ids: IntArray) -> bool:
    """Whether non-negative ``ids`` hold a value twice (O(n + max id), no sort)."""
    seen = np.zeros(int(ids.max()) + 1, dtype=bool)
    seen[ids] = True
    return int(seen.sum()) != ids.size
