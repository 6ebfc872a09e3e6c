"""The live fleet: drivers, their unit vectors in FAISS, real upsert and delete, ``recommend``.

Every driver holds one *slot*: a row of a FAISS ``IndexFlatIP`` (the one copy of its vector,
scored in place) and of the numpy columns below. Slots are dense: a delete moves the last row
into the freed one (swap-remove, O(dim)), a replace overwrites the row in place, an insert
appends; nothing is O(fleet). Each vector also gets an *id* from a persisted counter that only
grows (``vector_ids``), so an id is never handed out twice: the stock FaissMapVectorStore
reuses ``ntotal`` and hides live documents (FACTS.md).

Records are kept as the JSON bytes they were upserted with and parsed only when one is read
(``get_driver``, ``records``, ``search``); what ``recommend`` needs lives in columns: status
code, position, cargo limits, one bit per named constraint, driver and vehicle id. The
``GeoGrid`` holds the *available* drivers only (the only ones ``recommend`` looks at): a status
change inserts or removes the driver there. ``update_driver``, the batched
``update_positions`` and ``move`` (bulk positions with times: a row older than the driver's
stored time, the ``ts`` column, is stale and ignored) change the columns and the grid, never
the vectors nor the JSON: a record read later gets its live status and position laid over the
stored JSON (``_record``).

The grid keeps, beside each available driver's position, what ``recommend`` reads of it
(int8 vector, constraint bits, cargo limits) in its cell's contiguous block of an arena
(``indexes.geo``), however the table's own rows are ordered: ``recommend`` takes the arena
rows within the radius, then ``indexes.ranking`` filters them by constraint bits and cargo,
drops those an int8 first pass proves out of the top k, and scores the rest exactly on the
table's float32 rows; the answer is exact, bit for bit. ``recommend_many`` answers a batch of
orders the same way, with the first pass for the whole batch on a CUDA device when the table
has one (``device=``, ``indexes.gpu.DeviceFleet``).

With faiss-gpu and a GPU, unrestricted ``search`` runs on a GPU replica of the flat index,
rebuilt after vectors change (``gpu=True`` requires it, ``None`` uses it when present).

The table is meant for one thread (the proxy's event loop); an internal lock also makes
``save`` from a worker thread safe (it copies the state in short turns under the lock, then
writes without it). ``indexes.store`` adapts a table to LlamaIndex.

Changes made ``with table.applying(seq)`` are numbered (``seq``, the number of the last one):
a snapshot records the number of the last change it holds, copied under the same lock as the
state, so that replaying a change log (``indexes.changelog``) from the next one rebuilds the
table exactly, nothing applied twice or skipped.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, get_args

import faiss
import numpy as np
import numpy.typing as npt

from features.constraints import CONSTRAINTS, Predicate, check_constraints
from features.geo import EARTH_RADIUS_KM, haversine_km_each, haversine_km_many
from features.models import DriverRecord, Order, Position, Status
from indexes import gpu, ranking, snapshot
from indexes import gpu as gpu_module
from indexes.columns import MAX_TS_US, MIN_TS_US, Columns, datetime_of, timestamp_us
from indexes.errors import FleetIndexError, SnapshotError, VectorError
from indexes.geo import COS_BAND, GeoGrid, unit_vectors
from indexes.quantized import Quantizer
from indexes.ranking import Recommendation, Slots, Vectors

STATUSES: tuple[str, ...] = get_args(Status)
_STATUS_CODE: dict[str, int] = {s: i for i, s in enumerate(STATUSES)}
_AVAILABLE = _STATUS_CODE["available"]
_UNIT_TOLERANCE = 1e-3  # |norm - 1| allowed: inner product is cosine only on unit vectors
_MAX_BITS = 64  # constraints with a column bit; any further one is evaluated on records
# Grid cells of 0.02 degrees (2.2 km north-south): at a million drivers around six cities a
# 3 km query visits ~16 cells holding about twice the drivers in the circle; 0.05 degrees
# gathered (and distance-tested) 5 to 10 times them.
CELL_DEG = 0.02
# save copies vectors in chunks of this many rows, each under the lock (~10 ms at 1M drivers,
# rows scattered), and gives up copying outside the lock after this many restarts.
_SAVE_CHUNK = 8192
_SAVE_TRIES = 3


def constraint_bits(
    records: Sequence[DriverRecord], names: Sequence[str] = tuple(CONSTRAINTS)[:_MAX_BITS]
) -> npt.NDArray[np.uint64]:
    """One bit per named constraint each record satisfies (the ``cbits`` column)."""
    preds = [CONSTRAINTS[name] for name in names]
    return np.fromiter(
        (sum(1 << b for b, pred in enumerate(preds) if pred(r)) for r in records),
        dtype=np.uint64,
        count=len(records),
    )


@dataclass(frozen=True)
class Prepared:
    """Records as the table keeps them: ids, vehicle ids, their JSON and their column values
    (``Columns.fields_of``). Made where the records were validated (an HTTP worker, a
    warm-up reader) so that the index owner parses nothing: ``fields`` travel as arrays."""

    ids: list[str]
    vehicle_ids: list[str]
    blobs: list[bytes]
    fields: dict[str, npt.NDArray[Any]]
    rows: list[int] = field(default_factory=list)  # after ``deduplicated``: rows kept

    @classmethod
    def of(cls, records: Sequence[DriverRecord]) -> Prepared:
        return cls(
            ids=[r.driver_id for r in records],
            vehicle_ids=[r.vehicle.vehicle_id for r in records],
            blobs=[r.model_dump_json().encode() for r in records],
            fields=Columns.fields_of(records, constraint_bits(records), _STATUS_CODE),
        )

    def deduplicated(self) -> Prepared:
        """The last occurrence of each repeated driver id (``rows``: which were kept)."""
        last = {driver_id: i for i, driver_id in enumerate(self.ids)}
        if len(last) == len(self.ids):
            return self
        rows = list(last.values())
        return Prepared(
            ids=[self.ids[i] for i in rows],
            vehicle_ids=[self.vehicle_ids[i] for i in rows],
            blobs=[self.blobs[i] for i in rows],
            fields={name: values[rows] for name, values in self.fields.items()},
            rows=rows,
        )


@dataclass(frozen=True)
class Moved:
    """What ``FleetTable.move`` did: per input row whether it was applied, how many known
    rows were stale, and the unknown driver ids (each once, in input order)."""

    applied: npt.NDArray[np.bool_]
    stale: int
    unknown: list[str]


class FleetTable:
    """Drivers, their unit embedding vectors and positions; see the module docstring."""

    def __init__(
        self,
        dim: int,
        *,
        cell_deg: float = CELL_DEG,
        gpu: bool | None = None,
        device: str | None = None,
    ) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self._dim = dim = int(dim)
        self._lock = threading.RLock()
        self._save_lock = threading.Lock()
        self._flat = faiss.IndexFlatIP(dim)
        self._replica = _replica_for(gpu)
        # recommend_many's first pass on a CUDA device (``indexes.gpu.DeviceFleet``).
        self._device = (
            None
            if device is None
            else gpu_module.DeviceFleet(dim, device, _UNIT_TOLERANCE, COS_BAND)
        )
        self._next_id = 0
        self._seq = 0  # number of the last change applied (``applying``); 0: none
        self._epoch = 0  # bumped whenever a vector or the slot layout changes
        self._quant = Quantizer(dim, _UNIT_TOLERANCE)  # int8 rows, recommend's first pass
        # Available drivers only, each with what recommend reads (its cell's rows contiguous).
        self._grid = GeoGrid(
            cell_deg,
            payload={
                **self._quant.payload,
                "cbits": ((), np.uint64),
                "cargo": ((3,), np.float64),
            },
        )
        self._constraints: tuple[str, ...] = tuple(CONSTRAINTS)[:_MAX_BITS]
        self._vocabulary = zlib.crc32(json.dumps([STATUSES, self._constraints]).encode())
        self._slot_of: dict[str, int] = {}
        self._ids: list[str] = []  # slot -> driver_id
        self._vehicles: list[str] = []  # slot -> vehicle_id
        self._json: list[bytes] = []  # slot -> record as upserted
        self._cols = Columns.empty(0)

    def __repr__(self) -> str:
        return f"FleetTable(dim={self._dim}, drivers={len(self)})"

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def on_gpu(self) -> bool:
        """Whether unrestricted ``search`` calls run on a GPU replica."""
        return self._replica is not None

    @property
    def flat(self) -> faiss.IndexFlatIP:
        """The FAISS index, row i = slot i (read it, don't mutate it)."""
        return self._flat

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, driver_id: object) -> bool:
        return driver_id in self._slot_of

    def driver_ids(self) -> list[str]:
        return list(self._ids)

    @property
    def seq(self) -> int:
        """The number of the last change applied ``with applying(seq)`` (saved in snapshots)."""
        return self._seq

    @property
    def vocabulary(self) -> int:
        """A crc32 of the names behind status codes and constraint bits: column values made
        under another vocabulary (a change logged by another version) mean something else."""
        return self._vocabulary

    @contextlib.contextmanager
    def applying(self, seq: int) -> Iterator[None]:
        """Make the changes inside the change numbered ``seq`` (> ``self.seq``): ``seq`` is
        taken only when they succeed, under the lock a snapshot copies the state under."""
        if seq <= self._seq:
            raise ValueError(f"change {seq} is not after change {self._seq}")
        with self._lock:
            yield
            self._seq = seq

    def vector_ids(self) -> list[int]:
        """The id of each live vector, in slot order. Ids come from a counter that only grows:
        a new or replaced vector always gets an id never seen before (persisted by ``save``)."""
        with self._lock:
            return self._cols.fid[: len(self)].tolist()

    def get_driver(self, driver_id: str) -> DriverRecord | None:
        """The driver's current record, or None if unknown."""
        with self._lock:
            slot = self._slot_of.get(driver_id)
            return None if slot is None else self._record(slot)

    def get_vector(self, driver_id: str) -> Vectors | None:
        """A copy of the driver's stored (unit) vector."""
        with self._lock:
            slot = self._slot_of.get(driver_id)
            return None if slot is None else self._rows()[slot].copy()

    # -- changes -------------------------------------------------------------------------------

    def upsert_drivers(self, records: Sequence[DriverRecord], vectors: npt.ArrayLike) -> None:
        """Insert or replace drivers with their unit vectors (row i belongs to records[i]).

        Everything is checked before anything changes. A driver_id repeated in one call: the
        last occurrence wins.
        """
        for rec in records:
            if not isinstance(rec, DriverRecord):
                raise TypeError(f"expected DriverRecord, got {type(rec).__name__}")
        self.upsert_prepared(Prepared.of(records), vectors)

    def upsert_prepared(self, prepared: Prepared, vectors: npt.ArrayLike) -> None:
        """``upsert_drivers`` of records already turned into what the table keeps
        (``Prepared.of``, in any process): no record is parsed or validated here."""
        vecs = self._check_vectors(vectors, len(prepared.ids))
        prepared = prepared.deduplicated()
        if len(prepared.ids) != len(vecs):
            vecs = vecs[prepared.rows]
        if not prepared.ids:
            return
        ids, vehicle_ids, blobs, fields = (
            prepared.ids,
            prepared.vehicle_ids,
            prepared.blobs,
            prepared.fields,
        )
        with self._lock:
            slot_of, slot_ids, vehicles, json = self._slot_of, self._ids, self._vehicles, self._json
            n = len(slot_ids)
            slots = np.fromiter((slot_of.get(d, -1) for d in ids), dtype=np.int64, count=len(ids))
            old = np.flatnonzero(slots >= 0)
            new = np.flatnonzero(slots < 0)
            # Add first: should FAISS fail to add, nothing has changed yet.
            self._flat.add(vecs[new])
            self._rows()[slots[old]] = vecs[old]  # a replaced vector is overwritten in place
            self._vectors_changed()
            slots[new] = np.arange(n, n + new.size)
            for i in old.tolist():
                vehicles[slots[i]] = vehicle_ids[i]
                json[slots[i]] = blobs[i]
            for i in new.tolist():
                slot_of[ids[i]] = n
                slot_ids.append(ids[i])
                vehicles.append(vehicle_ids[i])
                json.append(blobs[i])
                n += 1
            fids = np.arange(self._next_id, self._next_id + len(ids), dtype=np.int64)
            self._next_id += len(ids)
            cols = self._cols = self._cols.grown(n)
            cols.put(slots, fids, fields, blobs)
            self._sync_grid(slots, fresh=True)

    def update_driver(
        self, driver_id: str, *, position: Position | None = None, status: str | None = None
    ) -> DriverRecord:
        """Move a driver and/or change its status: no vector work. KeyError if unknown.

        A position whose time is older than the driver's stored time is stale (telemetry
        arrives out of order, as ``move`` says) and the whole update is ignored, its status
        too: the stored record comes back unchanged. A position without a time applies."""
        if status is not None and status not in _STATUS_CODE:
            raise ValueError(f"status must be one of {', '.join(_STATUS_CODE)}, got {status!r}")
        if position is not None and type(position) is not Position:
            position = Position.model_validate(position)
        with self._lock:
            slot = self._slot_of.get(driver_id)
            if slot is None:
                raise KeyError(driver_id)
            record = self._record(slot)
            cols = self._cols
            at = None if position is None or position.ts is None else timestamp_us(position.ts)
            if at is not None and at < cols.ts[slot]:  # stale: see above
                return record
            changes: dict[str, Any] = {}
            if position is not None:
                ts_us = timestamp_us(position.ts)
                # As ``_record`` will read it back: the time in UTC (made before any column
                # changes, so that a time it cannot hold changes nothing)
                changes["position"] = Position.model_construct(
                    lat=position.lat, lng=position.lng, ts=datetime_of(ts_us)
                )
                cols.lat[slot], cols.lng[slot] = position.lat, position.lng
                cols.moved[slot] = True
                cols.ts[slot] = ts_us
            if status is not None:
                changes["status"] = status
            if not changes:
                return record
            record = record.model_copy(update=changes)
            if status is not None:
                cols.status[slot] = _STATUS_CODE[status]
                # Constraints read the slowly-changing parts today; recomputed on a status
                # change anyway, so a constraint on status could not go stale.
                cols.cbits[slot] = self._constraint_bits([record])[0]
            self._sync_grid(np.array([slot]), fresh=status is not None)
            return record

    def update_positions(
        self,
        driver_ids: Sequence[str],
        lats: npt.ArrayLike,
        lngs: npt.ArrayLike,
        ts: datetime | None = None,
    ) -> None:
        """Move many drivers at once (``update_driver(id, position=Position(lat, lng, ts))``
        for each, one ``ts`` for the batch). All-or-nothing: a KeyError for an unknown driver
        or a ValueError for a bad position changes nothing. A repeated driver: the last wins.

        Vectorised: only the grid cells and two columns change; records are not touched.
        """
        la = np.asarray(lats, dtype=np.float64)
        ln = np.asarray(lngs, dtype=np.float64)
        ids = list(driver_ids)
        if not len(ids) == la.size == ln.size or la.ndim != 1 or ln.ndim != 1:
            raise ValueError(f"{len(ids)} ids, lats of shape {la.shape}, lngs of {ln.shape}")
        if ts is not None:
            ts = Position(lat=0.0, lng=0.0, ts=ts).ts  # validated as PATCH would
        if not ((la >= -90.0) & (la <= 90.0) & (ln >= -180.0) & (ln <= 180.0)).all():
            raise ValueError("positions out of range (or not finite)")
        if not ids:
            return
        with self._lock:
            slot_of = self._slot_of
            try:
                slots = np.fromiter((slot_of[d] for d in ids), dtype=np.int64, count=len(ids))
            except KeyError as exc:
                raise KeyError(exc.args[0]) from None
            cols = self._cols
            cols.lat[slots] = la  # numpy assigns in order: for a repeated id the last stays
            cols.lng[slots] = ln
            cols.moved[slots] = True
            cols.ts[slots] = timestamp_us(ts)
            self._sync_grid(np.unique(slots))

    def move(
        self,
        driver_ids: Sequence[str],
        lats: npt.ArrayLike,
        lngs: npt.ArrayLike,
        ts_us: npt.NDArray[np.int64],
        statuses: Sequence[str | None] | None = None,
    ) -> Moved:
        """Bulk positions with their times (API.md, ``PATCH /v1/fleet/positions``).

        Row i moves ``driver_ids[i]`` to (lats[i], lngs[i]) at time ``ts_us[i]``
        (microseconds since the Unix epoch, UTC: ``timestamp_us``) and, when
        ``statuses[i]`` is not None, sets its status as ``update_driver`` does. A row older
        than the driver's stored time is stale and ignored (an equal time applies; a driver
        without a time accepts any); of several rows for one driver the newest applies (on
        equal times the last) and the others are stale. Unknown drivers are skipped.

        Everything is validated first: a bad position, time or status is a ValueError naming
        the row, and nothing changes. Vectorised: without statuses only columns and grid
        cells change, with no Python work per row unless a driver changes cell. Rows are
        applied in a fixed order, so the same call on equal tables leaves equal tables.
        """
        ids = list(driver_ids)
        la, ln, ts, codes = _checked_moves(ids, lats, lngs, ts_us, statuses)
        with self._lock:
            slot_of = self._slot_of
            slots = np.fromiter((slot_of.get(d, -1) for d in ids), dtype=np.int64, count=len(ids))
            known = np.flatnonzero(slots >= 0)
            unknown = list(dict.fromkeys(ids[i] for i in np.flatnonzero(slots < 0).tolist()))
            # Group rows by driver, each group by (time, row): its last row is the newest.
            by_driver = known[np.lexsort((known, ts[known], slots[known]))]
            last = np.ones(by_driver.size, dtype=bool)
            last[:-1] = slots[by_driver[1:]] != slots[by_driver[:-1]]
            newest = by_driver[last]
            cols = self._cols
            win = newest[ts[newest] >= cols.ts[slots[newest]]]
            applied = np.zeros(len(ids), dtype=bool)
            applied[win] = True
            stale = int(known.size - win.size)
            if win.size:
                moved = slots[win]
                cols.lat[moved] = la[win]
                cols.lng[moved] = ln[win]
                cols.ts[moved] = ts[win]
                cols.moved[moved] = True
                fresh = False if codes is None else self._set_statuses(moved, codes[win])
                self._sync_grid(moved, fresh=fresh)
            return Moved(applied, stale, unknown)

    def _set_statuses(
        self, slots: Slots, codes: npt.NDArray[np.int8]
    ) -> npt.NDArray[np.bool_] | bool:
        """Status codes of distinct slots (-1: leave it), constraint bits recomputed as
        ``update_driver`` does; returns which slots changed (for ``_sync_grid``)."""
        change = codes >= 0
        if not change.any():
            return False
        slots = slots[change]
        self._cols.status[slots] = codes[change]
        records = [self._record(s) for s in slots.tolist()]
        self._cols.cbits[slots] = self._constraint_bits(records)
        return change

    def delete_driver(self, driver_id: str) -> bool:
        with self._lock:
            slot = self._slot_of.get(driver_id)
            if slot is None:
                return False
            self._delete_slots([slot])
            return True

    def delete_drivers(
        self, driver_ids: Iterable[str] | None, where: Predicate | None = None
    ) -> int:
        """Delete the live drivers among ``driver_ids`` (every one when None) whose record
        satisfies ``where``; returns how many."""
        with self._lock:
            slots = self._select(driver_ids, where)
            self._delete_slots(slots)
            return len(slots)

    def clear(self) -> None:
        """Remove every driver. The id counter keeps counting: ids are never reused."""
        with self._lock:
            self._delete_slots(list(range(len(self))))

    # -- reads ---------------------------------------------------------------------------------

    def recommend(self, order: Order, query: npt.ArrayLike) -> Recommendation:
        """Candidates for ``order`` by the rules of API.md (``POST /v1/dispatch/recommend``)."""
        names = check_constraints(order.constraints)
        q = self._check_query(query)
        lat, lng, radius = order.pickup.lat, order.pickup.lng, order.radius_km
        with self._lock:
            grid = self._grid
            # Arena rows of the available drivers in the circle (the grid holds no other),
            # ascending: a few contiguous runs, one per cell.
            rows = grid.within_rows(lat, lng, radius)
            keep = ranking.eligible(grid, self._constraints, rows, names, order, self._record)
            best = ranking.rank(
                self._rows(),
                grid,
                self._quant,
                q,
                rows[keep],
                (lat, lng),
                order.k,
                self._ids,
                self._vehicles,
            )
            return Recommendation(best, int(rows.size))

    def recommend_many(
        self, orders: Sequence[Order], queries: Sequence[npt.ArrayLike]
    ) -> list[Recommendation]:
        """``recommend(orders[i], queries[i])`` for each order, bit for bit. With a device
        (``FleetTable(..., device="cuda")``) the batch shares one first pass there
        (``indexes.gpu``): batch concurrent orders into one call. Orders naming a constraint
        registered after the table was built run on the CPU."""
        if len(orders) != len(queries):
            raise ValueError(f"{len(orders)} orders but {len(queries)} query vectors")
        names = [check_constraints(o.constraints) for o in orders]
        qs = self._check_queries(queries)
        if self._device is None:
            return [self.recommend(o, q) for o, q in zip(orders, qs, strict=True)]
        with self._lock:
            self._device.sync(len(self), self._device_columns)
            here = [i for i, nm in enumerate(names) if set(nm) <= set(self._constraints)]
            mine = [orders[i] for i in here]
            batch = self._device_orders(mine, [names[i] for i in here], qs[here])
            done = self._finish_on_device(mine, batch.vectors, self._device.first_pass(batch))
            out: list[Recommendation | None] = [None] * len(orders)
            for i, answer in zip(here, done, strict=True):
                out[i] = answer
            return [self.recommend(orders[i], qs[i]) if r is None else r for i, r in enumerate(out)]

    def records(
        self, driver_ids: Iterable[str] | None = None, where: Predicate | None = None
    ) -> list[DriverRecord]:
        """The current records of the live drivers among ``driver_ids`` (every one, in slot
        order, when None) that satisfy ``where``."""
        with self._lock:
            found = (self._record(s) for s in self._slots(driver_ids))
            return [r for r in found if where is None or where(r)]

    def search(
        self,
        query: npt.ArrayLike,
        k: int,
        *,
        driver_ids: Iterable[str] | None = None,
        where: Predicate | None = None,
    ) -> list[tuple[DriverRecord, float]]:
        """The k drivers of highest inner product (cosine) with ``query``, with their scores,
        among ``driver_ids`` (every one when None) that satisfy ``where``.

        Unrestricted: a FAISS search of the whole flat index (on the GPU replica if any).
        Restricted: scored with the kernel of ``recommend`` rather than a FAISS search with an
        IDSelectorBatch: the scores are then bit-identical to the unrestricted search (the
        selector path rounds differently), and a one-query search with a selector opens an
        OpenMP parallel region that stalled for ~8 ms on a busy 2-core machine. Ties by
        driver_id.
        """
        q = self._check_query(query)
        with self._lock:
            if driver_ids is None and where is None:
                hits = self._search_all(q, k)
            else:
                hits = self._search_slots(q, self._select(driver_ids, where), k)
            return [(self._record(slot), score) for slot, score in hits]

    # -- snapshots -----------------------------------------------------------------------------

    def save(self, directory: Path | str) -> int:
        """Write a crash-safe snapshot (layout in ``indexes.snapshot``); returns the number of
        the last change it holds (``seq``).

        Rows are written in grid-cell order, so a loaded table holds neighbours' vectors next
        to each other (``recommend`` reads its candidates in the grid's arena, in cell order
        live or loaded; the exact scores of the few that pass its first pass read these rows).

        The state is copied without holding the table's lock for long: the columns and the
        slot lists under it (tens of milliseconds at 1,000,000 drivers), then the vectors in
        chunks of ``_SAVE_CHUNK`` rows, each under the lock and only while no vector has
        changed since the columns were copied (``_epoch``); an upsert or delete meanwhile
        restarts the copy, and after ``_SAVE_TRIES`` restarts the copy holds the lock
        throughout (as every save once did: ~2 s at 1,000,000 drivers). The files are written
        without the lock. Saves of one table are serialised.
        """
        with self._save_lock:
            snap, tries = self._copy_state(), 0
            while snap is None:
                tries += 1
                # The last try holds the (reentrant) lock throughout: it cannot fail.
                with self._lock if tries == _SAVE_TRIES else contextlib.nullcontext():
                    snap = self._copy_state()
            snapshot.write(Path(directory), snap)
            return snap.seq

    @classmethod
    def load(
        cls,
        directory: Path | str,
        dim: int,
        *,
        cell_deg: float = CELL_DEG,
        gpu: bool | None = None,
        device: str | None = None,
    ) -> FleetTable:
        """The table saved in ``directory``; an empty table when there is no snapshot."""
        table = cls(dim, cell_deg=cell_deg, gpu=gpu, device=device)
        snap = snapshot.read(Path(directory))
        if snap is None:
            return table
        if snap.dim != dim:
            raise SnapshotError(
                f"snapshot in {directory} holds {snap.dim}-d vectors, expected {dim}-d "
                "(different embedding model?)"
            )
        table._restore(snap)
        return table

    @classmethod
    def from_snapshot(
        cls,
        snap: snapshot.Snapshot,
        *,
        cell_deg: float = CELL_DEG,
        gpu: bool | None = None,
        device: str | None = None,
    ) -> FleetTable:
        """A table holding ``snap`` (of the snapshot's own dimension)."""
        table = cls(snap.dim, cell_deg=cell_deg, gpu=gpu, device=device)
        table._restore(snap)
        return table

    def _copy_state(self) -> snapshot.Snapshot | None:
        """The table as a snapshot in grid-cell row order (see ``save``), or None when a
        vector changed while the vectors were being copied."""
        with self._lock:
            epoch, n, next_id, seq = self._epoch, len(self), self._next_id, self._seq
            cols = self._cols.head(n)
            ids, vehicles, blobs = self._ids[:], self._vehicles[:], self._json[:]
        order = np.argsort(self._grid.cell_keys(cols.lat, cols.lng), kind="stable")
        vectors = np.empty((n, self._dim), dtype=np.float32)
        for start in range(0, n, _SAVE_CHUNK):
            with self._lock:
                if self._epoch != epoch:
                    return None
                chunk = order[start : start + _SAVE_CHUNK]
                np.take(self._rows(), chunk, axis=0, out=vectors[start : start + chunk.size])
            # Python's locks are not fair: without giving up the GIL here this thread takes
            # the lock again before a waiting reader has run, chunk after chunk, and the
            # reader waits for the whole copy (seconds at 1,000,000 drivers).
            time.sleep(0)
        rows = order.tolist()
        return snapshot.Snapshot(
            dim=self._dim,
            next_id=next_id,
            seq=seq,
            vectors=vectors,
            driver_ids=[ids[i] for i in rows],
            vehicle_ids=[vehicles[i] for i in rows],
            records=[blobs[i] for i in rows],
            columns=cols.take(order),
            statuses=STATUSES,
            constraints=self._constraints,
        )

    def _restore(self, snap: snapshot.Snapshot) -> None:
        """Adopt a snapshot (into an empty table)."""
        with self._lock:
            n = len(snap.driver_ids)
            # Size the flat index once, then copy the (memory-mapped) rows into it: adding
            # chunk by chunk regrew and copied the whole array ~log2(n) times.
            self._flat.codes.resize(n * self._flat.code_size)
            self._flat.ntotal = n
            self._rows()[:] = snap.vectors
            self._next_id = snap.next_id
            self._seq = snap.seq
            self._ids = snap.driver_ids
            self._vehicles = snap.vehicle_ids
            self._json = snap.records
            self._slot_of = dict(zip(snap.driver_ids, range(n), strict=True))
            if len(self._slot_of) != n:
                raise SnapshotError(f"snapshot holds a driver_id twice ({n} rows)")
            self._cols = snap.columns
            if snap.statuses != STATUSES:  # saved by a version with another status vocabulary
                self._cols.status[:n] = _status_codes(snap.statuses)[self._cols.status[:n]]
            if snap.constraints != self._constraints:  # another vocabulary: recompute the bits
                self._cols.cbits[:n] = self._constraint_bits([self._record(s) for s in range(n)])
            self._sync_grid(np.arange(n), fresh=True)
            self._vectors_changed()

    # -- internals -----------------------------------------------------------------------------

    def _device_orders(
        self, orders: list[Order], names: list[list[str]], qs: Vectors
    ) -> gpu_module.Orders:
        lats = np.array([o.pickup.lat for o in orders], dtype=np.float64)
        lngs = np.array([o.pickup.lng for o in orders], dtype=np.float64)
        index = self._constraints.index
        masks = [sum(1 << index(n) for n in nm) for nm in names]
        none = (-np.inf, -np.inf, -np.inf)
        return gpu_module.Orders(
            centres=unit_vectors(lats, lngs),
            limits=np.array([math.cos(o.radius_km / EARTH_RADIUS_KM) for o in orders]),
            # as int64 of the same bits: torch has no uint64 `&`
            masks=np.array(masks, dtype=np.uint64).view(np.int64),
            cargo=np.array(
                [
                    none if (c := o.cargo) is None else (c.weight_kg, c.volume_m3, c.height_m)
                    for o in orders
                ],
                dtype=np.float64,
            ).reshape(len(orders), 3),
            vectors=qs,
            ks=np.array([o.k for o in orders], dtype=np.int64),
        )

    def _finish_on_device(
        self, orders: list[Order], qs: Vectors, passed: list[gpu_module.Passed]
    ) -> list[Recommendation]:
        """The answers from a first pass on the device: the haversine test for the drivers
        near each circle, then exact scores (one FAISS call for the batch), distances and the
        ranking of every order's survivors together, on the CPU, as ``recommend``."""
        cols, kept, outside = self._cols, [], []  # outside: how many near the edge are out
        for order, p in zip(orders, passed, strict=True):
            slots, out = p.slots, p.band[:0]
            if p.band.size:  # rare: a driver within ~1e-12 of the circle in cos(d / R)
                lat, lng = order.pickup.lat, order.pickup.lng
                far = haversine_km_many(lat, lng, cols.lat[p.band], cols.lng[p.band])
                out = p.band[far > order.radius_km]
                slots = slots[~np.isin(slots, out)]
            kept.append(slots)
            outside.append(out.size)
        sizes = [s.size for s in kept]
        everyone = np.concatenate(kept) if kept else np.zeros(0, dtype=np.int64)
        sims = ranking.inner_products_many(self._rows(), qs, everyone, sizes)
        far = haversine_km_each(  # every survivor's distance, in one pass
            [(o.pickup.lat, o.pickup.lng) for o in orders],
            sizes,
            cols.lat[everyone],
            cols.lng[everyone],
        )
        best = ranking.best_scored_many(
            everyone,
            sims,
            far,
            sizes,
            [o.k for o in orders],
            self._ids,
            self._vehicles,
        )
        return [
            Recommendation(b, p.inside + p.band.size - gone)
            for b, p, gone in zip(best, passed, outside, strict=True)
        ]

    def _device_columns(self, slots: Slots, with_vectors: bool) -> gpu_module.Columns:
        cols = self._cols
        values = {
            "xyz": unit_vectors(cols.lat[slots], cols.lng[slots]),
            "available": cols.status[slots] == _AVAILABLE,
            "cbits": cols.cbits[slots],
            "cargo": cols.cargo[slots],
        }
        if with_vectors:
            values["vectors"] = self._rows()[slots]
        return values

    def _vectors_changed(self) -> None:
        self._epoch += 1  # a save copying vectors outside the lock starts over
        if self._replica is not None:
            self._replica.invalidate()

    def _rows(self) -> Vectors:
        """The flat index's vectors as a numpy view (valid until the index next grows)."""
        n = self._flat.ntotal
        if n == 0:
            return np.zeros((0, self._dim), dtype=np.float32)
        flat = faiss.rev_swig_ptr(self._flat.get_xb(), n * self._dim)
        return flat.reshape(n, self._dim)

    def _check_vectors(self, vectors: npt.ArrayLike, n: int) -> Vectors:
        try:
            arr = np.ascontiguousarray(vectors, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise VectorError(f"vectors are not a numeric array: {exc}") from exc
        if n == 0 and arr.size == 0:
            return np.zeros((0, self._dim), dtype=np.float32)
        if arr.shape != (n, self._dim):
            raise VectorError(f"vectors must have shape ({n}, {self._dim}), got {arr.shape}")
        if not np.isfinite(arr).all():
            raise VectorError("vectors contain NaN or infinity")
        bad = np.flatnonzero(np.abs(np.linalg.norm(arr, axis=1) - 1.0) > _UNIT_TOLERANCE)
        if bad.size:
            raise VectorError(f"vectors must be L2-normalised; row {int(bad[0])} is not")
        return arr

    def _check_queries(self, queries: Sequence[npt.ArrayLike]) -> Vectors:
        """``_check_query`` of each, checked together (a batch of recommends): one row each."""
        try:
            stacked = np.stack([np.asarray(q, dtype=np.float32) for q in queries])
            return self._check_vectors(stacked, len(queries))
        except (VectorError, ValueError, TypeError):
            checked = [self._check_query(q) for q in queries]  # the error names the bad one
            return np.stack(checked) if checked else np.zeros((0, self._dim), np.float32)

    def _check_query(self, query: npt.ArrayLike) -> Vectors:
        try:
            arr = np.asarray(query, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise VectorError(f"query vector is not numeric: {exc}") from exc
        if arr.ndim != 1:
            raise VectorError(f"query vector must have shape ({self._dim},), got {arr.shape}")
        return self._check_vectors(arr[None, :], 1)[0]

    def _constraint_bits(self, records: Sequence[DriverRecord]) -> npt.NDArray[np.uint64]:
        return constraint_bits(records, self._constraints)

    def _record(self, slot: int) -> DriverRecord:
        """The current record of a slot: the stored JSON with its live status and position."""
        record = DriverRecord.model_validate_json(self._json[slot])
        cols = self._cols
        changes: dict[str, Any] = {}
        status = STATUSES[cols.status[slot]]
        if record.status != status:
            changes["status"] = status
        if cols.moved[slot]:
            # model_construct: the values were validated by update_driver/_positions, move.
            changes["position"] = Position.model_construct(
                lat=float(cols.lat[slot]), lng=float(cols.lng[slot]), ts=datetime_of(cols.ts[slot])
            )
        return record.model_copy(update=changes) if changes else record

    def _delete_slots(self, slots: Iterable[int]) -> None:
        """Swap-remove: the last slot moves into each freed one (largest first, so a slot
        still to delete is never the one moved)."""
        order = sorted(set(slots), reverse=True)
        if not order:
            return
        rows, cols, grid = self._rows(), self._cols, self._grid
        ids, vehicles, blobs, slot_of = self._ids, self._vehicles, self._json, self._slot_of
        for slot in order:
            last = len(ids) - 1
            del slot_of[ids[slot]]
            grid.remove(slot)
            if slot != last:
                rows[slot] = rows[last]
                cols.copy_row(last, slot)
                moved_id = ids[slot] = ids[last]
                vehicles[slot] = vehicles[last]
                blobs[slot] = blobs[last]
                slot_of[moved_id] = slot
                if last in grid:
                    grid.rename(last, slot)  # its arena row (and int8 vector) stays
            cols.clear_row(last)
            if self._device is not None:
                self._device.touch([slot, last], vectors=True)
            ids.pop()
            vehicles.pop()
            blobs.pop()
        n = len(self._ids)
        # Truncate the flat index in O(1): its rows past n are the ones moved or deleted.
        self._flat.codes.resize(n * self._flat.code_size)
        self._flat.ntotal = n
        self._vectors_changed()

    def _sync_grid(self, slots: Slots, fresh: npt.NDArray[np.bool_] | bool = False) -> None:
        """Make the grid hold exactly the available ones of ``slots`` (distinct), at their
        column positions, with what ``recommend`` reads of them: written for those entering
        and for those ``fresh`` marks (their vector, bits or cargo changed)."""
        cols, grid = self._cols, self._grid
        if self._device is not None:
            self._device.touch(slots, vectors=fresh is True)
        available = cols.status[slots] == _AVAILABLE
        inside = grid.contains_many(slots)
        for slot in slots[inside & ~available].tolist():
            grid.remove(slot)
        stay = slots[inside & available]
        grid.move_many(stay, cols.lat[stay], cols.lng[stay])
        enter = ~inside & available
        grid.insert_many(slots[enter], cols.lat[slots[enter]], cols.lng[slots[enter]])
        self._fill_grid(slots[available & (enter | fresh)])

    def _fill_grid(self, slots: Slots) -> None:
        """Write the grid's payload of ``slots`` (in the grid) from the table, in chunks
        that stay in the cache while quantised."""
        rows, cols, grid = self._rows(), self._cols, self._grid
        for start in range(0, slots.size, 4096):
            part = slots[start : start + 4096]
            codes, scale, err = self._quant.encode(rows[part])
            grid.put(part, "codes", codes)
            grid.put(part, "scale", scale)
            grid.put(part, "err", err)
            grid.put(part, "cbits", cols.cbits[part])
            grid.put(part, "cargo", cols.cargo[part])

    def _search_all(self, q: Vectors, k: int) -> list[tuple[int, float]]:
        """(slot, score) of the k best drivers: a FAISS search of the whole flat index."""
        k = min(k, self._flat.ntotal)
        if k <= 0:
            return []
        if self._replica is not None:
            scores, slots = self._replica.search(self._flat, q[None, :], k)
        else:
            scores, slots = self._flat.search(q[None, :], k)
        return [
            (slot, score)
            for score, slot in zip(scores[0].tolist(), slots[0].tolist(), strict=True)
            if slot >= 0
        ]

    def _search_slots(self, q: Vectors, slots: list[int], k: int) -> list[tuple[int, float]]:
        """(slot, score) of the k best among ``slots``, ties by driver_id (see ``search``)."""
        k = min(k, len(slots))
        if k <= 0:
            return []
        idx = np.asarray(slots, dtype=np.int64)
        sims = ranking.inner_products(self._rows(), q, idx)
        best = np.argpartition(-sims, k - 1)[:k] if len(slots) > k else np.arange(len(slots))
        ranked = sorted((-float(sims[i]), self._ids[int(idx[i])], int(idx[i])) for i in best)
        return [(slot, -neg) for neg, _, slot in ranked]

    def _slots(self, driver_ids: Iterable[str] | None) -> list[int]:
        """Slots of the live drivers among ``driver_ids`` (each once), all when None."""
        if driver_ids is None:
            return list(range(len(self)))
        slot_of = self._slot_of
        return [s for d in dict.fromkeys(driver_ids) if (s := slot_of.get(d)) is not None]

    def _select(self, driver_ids: Iterable[str] | None, where: Predicate | None) -> list[int]:
        """Slots of the live drivers among ``driver_ids`` (all when None) satisfying where."""
        slots = self._slots(driver_ids)
        if where is not None:
            slots = [s for s in slots if where(self._record(s))]
        return slots


def _checked_moves(
    ids: list[str],
    lats: npt.ArrayLike,
    lngs: npt.ArrayLike,
    ts_us: npt.ArrayLike,
    statuses: Sequence[str | None] | None,
) -> tuple[
    npt.NDArray[np.float64],
    npt.NDArray[np.float64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int8] | None,
]:
    """``move``'s arguments as arrays (status codes, -1 for None), or a ValueError naming
    the first bad row."""
    la = np.asarray(lats, dtype=np.float64)
    ln = np.asarray(lngs, dtype=np.float64)
    ts = np.asarray(ts_us)
    n = len(ids)
    if not (la.shape == ln.shape == ts.shape == (n,)) or (
        statuses is not None and len(statuses) != n
    ):
        lengths = f"lats {la.shape}, lngs {ln.shape}, ts_us {ts.shape}"
        raise ValueError(
            f"{n} driver ids but {lengths}"
            + ("" if statuses is None else f", {len(statuses)} statuses")
        )
    if n and ts.dtype.kind not in "iu":
        raise ValueError(f"ts_us must be integer microseconds, got {ts.dtype}")
    bad = ~((la >= -90.0) & (la <= 90.0) & (ln >= -180.0) & (ln <= 180.0))
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(
            f"row {row}: position out of range (or not finite): lat={la[row]!r}, lng={ln[row]!r}"
        )
    bad = (ts < MIN_TS_US) | (ts > MAX_TS_US)
    if bad.any():
        row = int(np.argmax(bad))
        raise ValueError(f"row {row}: ts_us {int(ts[row])} is outside the years 1 to 9999")
    ts = ts.astype(np.int64)
    if statuses is None:
        return la, ln, ts, None
    codes = np.full(n, -1, dtype=np.int8)
    for row, status in enumerate(statuses):
        if status is not None:
            code = _STATUS_CODE.get(status)
            if code is None:
                raise ValueError(
                    f"row {row}: status must be one of {', '.join(_STATUS_CODE)}, got {status!r}"
                )
            codes[row] = code
    return la, ln, ts, codes


def _status_codes(names: Sequence[str]) -> npt.NDArray[np.int8]:
    """Today's code of each status name of an older vocabulary."""
    unknown = [s for s in names if s not in _STATUS_CODE]
    if unknown:
        raise SnapshotError(f"snapshot holds unknown statuses {unknown}")
    return np.array([_STATUS_CODE[s] for s in names], dtype=np.int8)


def _replica_for(want: bool | None) -> gpu.Replica | None:
    if want is False:
        return None
    reason = gpu.why_not()
    if reason is None:
        return gpu.Replica()
    if want:
        raise FleetIndexError(f"gpu=True but {reason}")
    return None
