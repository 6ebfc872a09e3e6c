"""The live-fleet vector index: a LlamaIndex vector store on FAISS with real upsert and delete.

Every driver holds one *slot* (a row of the column arrays below, reused after a delete) and
one *FAISS id* (int64 from a persisted counter that only grows, so an id is never handed out
twice: the stock FaissMapVectorStore reuses ``ntotal`` and hides live documents, FACTS.md).
Replacing a driver's vector removes its old FAISS id and adds the new vector under a new id.

Per slot we keep the record, a float32 mirror of its FAISS vector, its status code, its cargo
limits, and the value of every named constraint, so ``recommend`` is a handful of numpy
operations over the drivers the ``GeoGrid`` finds in the radius, never a Python loop over the
fleet. Positions and statuses change in place (``update_driver``, batched
``update_positions``) without touching vectors: the columns and the grid are updated at once,
while the record of a moved driver is rebuilt lazily (``_stale``), the next time it is read.

The store is meant for one thread (the proxy's event loop); an internal lock also makes
``save`` from a worker thread safe (it copies the state under the lock, then writes without it).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, get_args

import faiss
import numpy as np
import numpy.typing as npt
from llama_index.core.schema import BaseNode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)
from pydantic import PrivateAttr

from features.constraints import CONSTRAINTS, check_constraints
from features.models import DriverRecord, Order, Position, Status
from indexes import snapshot
from indexes.errors import FleetIndexError, SnapshotError, VectorError
from indexes.geo import GeoGrid
from indexes.nodes import compile_filters, driver_node, record_from_node

Vectors = npt.NDArray[np.float32]

_STATUS_CODE: dict[str, int] = {s: i for i, s in enumerate(get_args(Status))}
_AVAILABLE = _STATUS_CODE["available"]
_FREE = -1  # status code of an unused slot
_UNIT_TOLERANCE = 1e-3  # |norm - 1| allowed: inner product is cosine only on unit vectors


@dataclass(frozen=True)
class Candidate:
    driver_id: str
    vehicle_id: str
    similarity: float
    distance_km: float


@dataclass(frozen=True)
class Recommendation:
    candidates: list[Candidate]
    considered: int  # available drivers inside the radius, before constraints and cargo


class FleetVectorStore(BasePydanticVectorStore):
    """Drivers, their unit embedding vectors and positions; see the module docstring.

    ``stores_text`` is True in LlamaIndex's sense: ``query`` returns complete nodes (record in
    the metadata), so no docstore is needed and ``VectorStoreIndex.from_vector_store`` accepts
    the store. It keeps no text of its own (the store never embeds).
    """

    stores_text: bool = True
    is_embedding_query: bool = True

    _dim: int = PrivateAttr()
    _lock: threading.RLock = PrivateAttr(default_factory=threading.RLock)
    _save_lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _index: faiss.IndexIDMap2 = PrivateAttr()
    _next_id: int = PrivateAttr(default=0)
    _grid: GeoGrid = PrivateAttr()
    _constraints: tuple[str, ...] = PrivateAttr()
    _slot_of: dict[str, int] = PrivateAttr(default_factory=dict)
    _slot_of_fid: dict[int, int] = PrivateAttr(default_factory=dict)
    _records: list[DriverRecord | None] = PrivateAttr(default_factory=list)
    _free: list[int] = PrivateAttr(default_factory=list)
    _fid: npt.NDArray[np.int64] = PrivateAttr()
    _vectors: Vectors = PrivateAttr()
    _status: npt.NDArray[np.int8] = PrivateAttr()
    _cargo: npt.NDArray[np.float64] = PrivateAttr()  # capacity_kg, cargo_volume_m3, height
    _cbits: npt.NDArray[np.bool_] = PrivateAttr()  # [slot, constraint] -> satisfied
    # True when the slot's record predates a batched move: its position is (grid lat/lng,
    # _ts[slot]); _record() rebuilds it on the next read.
    _stale: npt.NDArray[np.bool_] = PrivateAttr()
    _ts: npt.NDArray[np.object_] = PrivateAttr()  # position timestamp of stale slots

    def __init__(self, dim: int, *, cell_deg: float = 0.05) -> None:
        super().__init__(stores_text=True)
        if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or dim <= 0:
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        self._dim = dim = int(dim)
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._grid = GeoGrid(cell_deg)
        self._constraints = tuple(CONSTRAINTS)
        self._fid = np.full(0, -1, dtype=np.int64)
        self._vectors = np.zeros((0, dim), dtype=np.float32)
        self._status = np.full(0, _FREE, dtype=np.int8)
        self._cargo = np.zeros((0, 3))
        self._cbits = np.zeros((0, len(self._constraints)), dtype=bool)
        self._stale = np.zeros(0, dtype=bool)
        self._ts = np.full(0, None, dtype=object)

    @classmethod
    def class_name(cls) -> str:
        return "FleetVectorStore"

    # -- domain API ----------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        return self._dim

    def __len__(self) -> int:
        return len(self._slot_of)

    def __bool__(self) -> bool:
        # An empty store is still a store: LlamaIndex tests `if vector_store:` and would
        # silently swap an empty one for a SimpleVectorStore.
        return True

    def __eq__(self, other: object) -> bool:
        # Identity: pydantic's field-wise equality would compare numpy arrays and raise.
        return self is other

    __hash__ = object.__hash__

    def __contains__(self, driver_id: object) -> bool:
        return driver_id in self._slot_of

    def driver_ids(self) -> list[str]:
        return list(self._slot_of)

    def get_driver(self, driver_id: str) -> DriverRecord | None:
        with self._lock:
            slot = self._slot_of.get(driver_id)
            return None if slot is None else self._record(slot)

    def get_vector(self, driver_id: str) -> Vectors | None:
        """A copy of the driver's stored (unit) vector."""
        slot = self._slot_of.get(driver_id)
        return None if slot is None else self._vectors[slot].copy()

    def upsert_drivers(self, records: Sequence[DriverRecord], vectors: npt.ArrayLike) -> None:
        """Insert or replace drivers with their unit vectors (row i belongs to records[i]).

        Everything is checked before anything changes. A driver_id repeated in one call: the
        last occurrence wins.
        """
        recs = list(records)
        for rec in recs:
            if not isinstance(rec, DriverRecord):
                raise TypeError(f"expected DriverRecord, got {type(rec).__name__}")
        vecs = self._check_vectors(vectors, len(recs))
        last = {rec.driver_id: i for i, rec in enumerate(recs)}
        if len(last) != len(recs):
            rows = list(last.values())
            recs, vecs = [recs[i] for i in rows], vecs[rows]
        if not recs:
            return
        bits = self._constraint_bits(recs)
        with self._lock:
            slot_of, fid_of = self._slot_of, self._fid
            old_fids = [int(fid_of[s]) for r in recs if (s := slot_of.get(r.driver_id)) is not None]
            new_fids = np.arange(self._next_id, self._next_id + len(recs), dtype=np.int64)
            # Add before removing: should FAISS fail to add, nothing has changed yet.
            self._index.add_with_ids(vecs, new_fids)
            self._next_id += len(recs)
            if old_fids:
                self._index.remove_ids(faiss.IDSelectorBatch(np.asarray(old_fids, dtype=np.int64)))
                slot_of_fid = self._slot_of_fid
                for fid in old_fids:
                    del slot_of_fid[fid]
            slots = self._slots_for([r.driver_id for r in recs])
            self._place(slots, recs, vecs, new_fids, bits)

    def update_driver(
        self, driver_id: str, *, position: Position | None = None, status: str | None = None
    ) -> DriverRecord:
        """Move a driver and/or change its status: no vector work. KeyError if unknown."""
        if status is not None and status not in _STATUS_CODE:
            raise ValueError(f"status must be one of {', '.join(_STATUS_CODE)}, got {status!r}")
        if position is not None and type(position) is not Position:
            position = Position.model_validate(position)
        # The hot path of PATCH: private attributes of a pydantic model cost a __getattr__
        # call each, so they are read once from the private dict.
        priv: Any = self.__pydantic_private__
        with priv["_lock"]:
            slot = priv["_slot_of"].get(driver_id)
            if slot is None:
                raise KeyError(driver_id)
            record = self._record(slot)
            changes: dict[str, Any] = {}
            if position is not None:
                changes["position"] = position
            if status is not None:
                changes["status"] = status
            if not changes:
                return record
            record = record.model_copy(update=changes)
            priv["_records"][slot] = record
            if status is not None:
                priv["_status"][slot] = _STATUS_CODE[status]
                # Constraints read the slowly-changing parts today; recomputed on a status
                # change anyway, so a constraint on status could not go stale.
                priv["_cbits"][slot] = self._constraint_bits([record])[0]
            if position is not None:
                priv["_grid"].move(slot, position.lat, position.lng)
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

        Vectorised: the grid and the columns change now, each moved driver's record is
        rebuilt when it is next read (``get_driver`` returns exactly that record).
        """
        la = np.asarray(lats, dtype=np.float64)
        ln = np.asarray(lngs, dtype=np.float64)
        ids = list(driver_ids)
        if not len(ids) == la.size == ln.size or la.ndim != 1 or ln.ndim != 1:
            raise ValueError(f"{len(ids)} ids, lats of shape {la.shape}, lngs of {ln.shape}")
        if ts is not None:
            ts = Position(lat=0.0, lng=0.0, ts=ts).ts  # validated as PATCH would
        if not ids:
            return
        priv: Any = self.__pydantic_private__
        with priv["_lock"]:
            slot_of = priv["_slot_of"]
            try:
                slots = np.fromiter((slot_of[d] for d in ids), dtype=np.int64, count=len(ids))
            except KeyError as exc:
                raise KeyError(exc.args[0]) from None
            priv["_grid"].move_many(slots, la, ln)  # validates before changing anything
            priv["_ts"][slots] = ts
            priv["_stale"][slots] = True

    def delete_driver(self, driver_id: str) -> bool:
        with self._lock:
            slot = self._slot_of.get(driver_id)
            if slot is None:
                return False
            self._delete_slots([slot])
            return True

    def recommend(self, order: Order, query: npt.ArrayLike) -> Recommendation:
        """Candidates for ``order`` by the rules of API.md (``POST /v1/dispatch/recommend``)."""
        names = check_constraints(order.constraints)
        q = self._check_query(query)
        with self._lock:
            slots, dist = self._grid.within_distances(
                order.pickup.lat, order.pickup.lng, order.radius_km
            )
            available = self._status[slots] == _AVAILABLE
            slots, dist = slots[available], dist[available]
            considered = int(slots.size)
            keep = self._eligible(slots, names, order)
            slots, dist = slots[keep], dist[keep]
            # Similarity over the candidates only: gather their rows of the float32 mirror of
            # the FAISS vectors and score them with FAISS's own kernel (one call). Exact (the
            # float32 values FAISS holds), O(candidates x dim), every candidate gets a score
            # (the tie rules need them all), and each score is bit-identical to what an
            # unrestricted FAISS search reports for that driver, whichever rows come along.
            # Rejected: a search with an IDSelectorBatch scans the whole flat index, returns
            # only its own top-k with ties unordered, and rounds differently; numpy's
            # matrix-vector product (BLAS) rounds a row differently depending on its place in
            # the batch, so a driver's score would drift from one order to the next.
            sims = _inner_products(self._vectors[slots], q)
            return Recommendation(self._top(slots, sims, dist, order.k), considered)

    def save(self, directory: Path | str) -> None:
        """Write a crash-safe snapshot (layout in ``indexes.snapshot``).

        The state is copied under the store's lock (a few ms for 10,000 drivers); the files are
        written without it, so a save from a worker thread does not block the event loop's
        calls. Saves of one store are serialised.
        """
        with self._save_lock:
            with self._lock:
                live = list(self._slot_of.values())
                snap = snapshot.Snapshot(
                    dim=self._dim,
                    next_id=self._next_id,
                    index=_clone(self._index),
                    records=[self._record(s) for s in live],
                    faiss_ids=self._fid[live].tolist(),
                )
            snapshot.write(Path(directory), snap)

    @classmethod
    def load(cls, directory: Path | str, dim: int, *, cell_deg: float = 0.05) -> FleetVectorStore:
        """The store saved in ``directory``; an empty store when there is no snapshot."""
        store = cls(dim, cell_deg=cell_deg)
        snap = snapshot.read(Path(directory))
        if snap is None:
            return store
        if snap.dim != dim:
            raise SnapshotError(
                f"snapshot in {directory} holds {snap.dim}-d vectors, expected {dim}-d "
                "(different embedding model?)"
            )
        store._restore(snap)
        return store

    # -- LlamaIndex API ------------------------------------------------------------------------

    @property
    def client(self) -> faiss.IndexIDMap2:
        """The FAISS index (read it, don't mutate it: the store's maps must stay in step)."""
        return self._index

    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        """Upsert driver nodes: ``id_`` is the driver_id, the record is in the metadata."""
        records = [record_from_node(node) for node in nodes]
        try:
            vectors = [node.get_embedding() for node in nodes]
        except ValueError as exc:
            raise VectorError(f"every node needs an embedding: {exc}") from exc
        if records:
            self.upsert_drivers(records, vectors)
        return [node.node_id for node in nodes]

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """One driver is one document: ``ref_doc_id`` is the driver_id."""
        self.delete_driver(ref_doc_id)

    def delete_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
        **delete_kwargs: Any,
    ) -> None:
        if node_ids is None and filters is None:
            raise FleetIndexError("delete_nodes needs node_ids or filters (use clear() for all)")
        with self._lock:
            self._delete_slots(self._select(node_ids, filters))

    def get_nodes(
        self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None
    ) -> list[BaseNode]:
        with self._lock:
            slots = self._select(node_ids, filters)
            return [driver_node(self._record(s)) for s in slots]

    def clear(self) -> None:
        """Remove every driver. The id counter keeps counting: ids are never reused."""
        with self._lock:
            self._delete_slots(list(self._slot_of.values()))

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """Top ``similarity_top_k`` by inner product (cosine), optionally restricted to
        ``node_ids``/``doc_ids`` (driver ids) and ``filters``."""
        if query.mode != VectorStoreQueryMode.DEFAULT:
            raise FleetIndexError(f"query mode {query.mode.value!r} unsupported; use 'default'")
        if query.query_embedding is None:
            raise VectorError("query needs query_embedding")
        q = self._check_query(query.query_embedding)
        # An empty id list means "no restriction": VectorStoreIndex.as_retriever passes
        # node_ids=[] for every store that keeps its own nodes (as the other such stores do).
        restrict = _intersect(query.node_ids or None, query.doc_ids or None)
        k = query.similarity_top_k
        with self._lock:
            if restrict is None and query.filters is None:
                hits = self._search_all(q, k)
            else:
                hits = self._search_slots(q, self._select(restrict, query.filters), k)
            nodes: list[BaseNode] = [driver_node(self._record(slot)) for slot, _ in hits]
            return VectorStoreQueryResult(
                nodes=nodes,
                similarities=[score for _, score in hits],
                ids=[n.node_id for n in nodes],
            )

    def persist(self, persist_path: str, fs: Any | None = None) -> None:
        """Save a snapshot into the directory ``persist_path`` (local filesystem only)."""
        _require_local(fs)
        self.save(Path(persist_path))

    @classmethod
    def from_persist_path(
        cls, persist_path: str, fs: Any | None = None, *, dim: int | None = None
    ) -> FleetVectorStore:
        """Load a snapshot directory; ``dim`` defaults to the snapshot's own."""
        _require_local(fs)
        if dim is None:
            snap = snapshot.read(Path(persist_path))
            if snap is None:
                raise SnapshotError(f"no snapshot in {persist_path}: pass dim= for an empty store")
            store = cls(snap.dim)
            store._restore(snap)
            return store
        return cls.load(Path(persist_path), dim)

    # -- internals -----------------------------------------------------------------------------

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

    def _check_query(self, query: npt.ArrayLike) -> Vectors:
        try:
            arr = np.asarray(query, dtype=np.float32)
        except (TypeError, ValueError) as exc:
            raise VectorError(f"query vector is not numeric: {exc}") from exc
        if arr.ndim != 1:
            raise VectorError(f"query vector must have shape ({self._dim},), got {arr.shape}")
        return self._check_vectors(arr[None, :], 1)[0]

    def _constraint_bits(self, records: Sequence[DriverRecord]) -> npt.NDArray[np.bool_]:
        preds = [CONSTRAINTS[name] for name in self._constraints]
        bits = np.zeros((len(records), len(preds)), dtype=bool)
        for i, rec in enumerate(records):
            bits[i] = [pred(rec) for pred in preds]
        return bits

    def _record(self, slot: int) -> DriverRecord:
        """The current record of a slot (rebuilt here if a batched move left it stale)."""
        record = self._records[slot]
        assert record is not None, f"slot {slot} is free"
        if self._stale[slot]:
            lat, lng = self._grid.position(slot)
            ts = self._ts[slot]
            # model_construct: the values were validated by update_positions.
            position = Position.model_construct(lat=lat, lng=lng, ts=ts)
            record = record.model_copy(update={"position": position})
            self._records[slot] = record
            self._stale[slot] = False
            self._ts[slot] = None
        return record

    def _base(self, slot: int) -> DriverRecord:
        """The slot's record, possibly stale: for driver_id, vehicle and profile only."""
        record = self._records[slot]
        assert record is not None, f"slot {slot} is free"
        return record

    def _delete_slots(self, slots: list[int]) -> None:
        if not slots:
            return
        fids = self._fid[slots]
        # One O(ntotal) compaction of the flat index for the whole batch.
        self._index.remove_ids(faiss.IDSelectorBatch(fids))
        slot_of, slot_of_fid, records = self._slot_of, self._slot_of_fid, self._records
        for slot, fid in zip(slots, fids.tolist(), strict=True):
            del slot_of[self._base(slot).driver_id]
            del slot_of_fid[fid]
            self._grid.remove(slot)
            records[slot] = None
            self._free.append(slot)
        self._fid[slots] = -1
        self._status[slots] = _FREE
        self._stale[slots] = False
        self._ts[slots] = None

    def _slots_for(self, driver_ids: list[str]) -> list[int]:
        """The slot of each driver, allocating slots for new ones (free slots first)."""
        # Locals: private attributes of a pydantic model cost a __getattr__ call each.
        slot_of, free, records = self._slot_of, self._free, self._records
        slots = []
        for driver_id in driver_ids:
            slot = slot_of.get(driver_id)
            if slot is None:
                if free:
                    slot = free.pop()
                else:
                    slot = len(records)
                    records.append(None)
                slot_of[driver_id] = slot
            slots.append(slot)
        if len(records) > len(self._fid):
            self._grow(len(records))
        return slots

    def _grow(self, need: int) -> None:
        size = max(need, 2 * len(self._fid), 64)

        def grown(old: npt.NDArray[Any], fill: Any) -> npt.NDArray[Any]:
            new = np.full((size, *old.shape[1:]), fill, dtype=old.dtype)
            new[: len(old)] = old
            return new

        self._fid = grown(self._fid, -1)
        self._vectors = grown(self._vectors, 0.0)
        self._status = grown(self._status, _FREE)
        self._cargo = grown(self._cargo, 0.0)
        self._cbits = grown(self._cbits, False)
        self._stale = grown(self._stale, False)
        self._ts = grown(self._ts, None)

    def _place(
        self,
        slots: list[int],
        records: list[DriverRecord],
        vectors: Vectors,
        fids: npt.NDArray[np.int64],
        bits: npt.NDArray[np.bool_],
    ) -> None:
        if not slots:  # an empty snapshot: numpy cannot broadcast [] into (0, 3)
            return
        idx = np.asarray(slots, dtype=np.int64)
        self._fid[idx] = fids
        self._vectors[idx] = vectors
        self._status[idx] = [_STATUS_CODE[r.status] for r in records]
        self._cargo[idx] = [
            (r.vehicle.capacity_kg, r.vehicle.cargo_volume_m3, r.vehicle.cargo_height_m)
            for r in records
        ]
        self._cbits[idx] = bits
        self._stale[idx] = False
        self._ts[idx] = None
        store, slot_of_fid, move = self._records, self._slot_of_fid, self._grid.move
        for slot, rec, fid in zip(slots, records, fids.tolist(), strict=True):
            store[slot] = rec
            slot_of_fid[fid] = slot
            move(slot, rec.position.lat, rec.position.lng)

    def _restore(self, snap: snapshot.Snapshot) -> None:
        """Adopt a snapshot's index and records (into an empty store)."""
        index = snap.index
        vectors = np.zeros((0, self._dim), dtype=np.float32)
        if snap.records:
            # The mirror is rebuilt from the FAISS file, the one place vectors are stored.
            row_of = {fid: row for row, fid in enumerate(snapshot.stored_ids(index).tolist())}
            rows = [row_of[fid] for fid in snap.faiss_ids]
            flat = faiss.downcast_index(index.index)
            vectors = np.ascontiguousarray(flat.reconstruct_n(0, index.ntotal)[rows])
        with self._lock:
            self._index = index
            self._next_id = snap.next_id
            slots = self._slots_for([r.driver_id for r in snap.records])
            fids = np.asarray(snap.faiss_ids, dtype=np.int64)
            self._place(slots, snap.records, vectors, fids, self._constraint_bits(snap.records))

    def _eligible(
        self, slots: npt.NDArray[np.int64], names: list[str], order: Order
    ) -> npt.NDArray[np.bool_]:
        keep = np.ones(slots.size, dtype=bool)
        cols = [self._constraints.index(n) for n in names if n in self._constraints]
        if cols:
            keep &= self._cbits[slots][:, cols].all(axis=1)
        for name in names:
            if name not in self._constraints:  # registered after this store was built
                pred = CONSTRAINTS[name]
                keep &= [pred(self._record(s)) for s in slots.tolist()]
        cargo = order.cargo
        if cargo is not None:
            limits = self._cargo[slots]
            keep &= (
                (limits[:, 0] >= cargo.weight_kg)
                & (limits[:, 1] >= cargo.volume_m3)
                & (limits[:, 2] >= cargo.height_m)
            )
        return keep

    def _top(
        self,
        slots: npt.NDArray[np.int64],
        sims: Vectors,
        dist: npt.NDArray[np.float64],
        k: int,
    ) -> list[Candidate]:
        """The best k by (similarity desc, distance asc, driver_id asc)."""
        if slots.size == 0:
            return []
        pool = np.arange(slots.size)
        if slots.size > k:
            # O(n) selection of the k best similarities plus everyone tied with the k-th.
            kth = -np.partition(-sims, k - 1)[k - 1]
            pool = np.flatnonzero(sims >= kth)
        pool = pool[np.lexsort((dist[pool], -sims[pool]))]
        if pool.size > k:
            # Keep exact (similarity, distance) ties with the k-th: driver_id decides below.
            last = pool[k - 1]
            tied = (sims[pool[k:]] == sims[last]) & (dist[pool[k:]] == dist[last])
            extra = tied.size if tied.all() else int(np.argmin(tied))  # leading run of ties
            pool = pool[: k + extra]
        entries = []
        for i in pool.tolist():
            record = self._base(int(slots[i]))
            entries.append((-float(sims[i]), float(dist[i]), record.driver_id, record))
        entries.sort(key=lambda e: e[:3])
        return [
            Candidate(rec.driver_id, rec.vehicle.vehicle_id, -neg_sim, d)
            for neg_sim, d, _, rec in entries[:k]
        ]

    def _search_all(self, q: Vectors, k: int) -> list[tuple[int, float]]:
        """(slot, score) of the k best drivers: a FAISS search of the whole flat index."""
        k = min(k, self._index.ntotal)
        if k <= 0:
            return []
        scores, fids = self._index.search(q[None, :], k)
        slot_of_fid = self._slot_of_fid
        return [
            (slot_of_fid[fid], score)
            for score, fid in zip(scores[0].tolist(), fids[0].tolist(), strict=True)
            if fid >= 0
        ]

    def _search_slots(self, q: Vectors, slots: list[int], k: int) -> list[tuple[int, float]]:
        """(slot, score) of the k best among ``slots``, ties by driver_id.

        Scored with the kernel of ``recommend`` rather than a FAISS search with an
        IDSelectorBatch: the scores are then bit-identical to the unrestricted search (the
        selector path rounds differently), and a one-query search with a selector opens an
        OpenMP parallel region that stalled for ~8 ms on a busy 2-core machine.
        """
        k = min(k, len(slots))
        if k <= 0:
            return []
        idx = np.asarray(slots, dtype=np.int64)
        sims = _inner_products(self._vectors[idx], q)
        best = np.argpartition(-sims, k - 1)[:k] if len(slots) > k else np.arange(len(slots))
        ranked = sorted(
            (-float(sims[i]), self._base(int(idx[i])).driver_id, int(idx[i])) for i in best
        )
        return [(slot, -neg) for neg, _, slot in ranked]

    def _select(
        self, driver_ids: Iterable[str] | None, filters: MetadataFilters | None
    ) -> list[int]:
        """Slots of the live drivers among ``driver_ids`` (all when None) matching filters."""
        predicate = None if filters is None else compile_filters(filters)
        if driver_ids is None:
            slots = list(self._slot_of.values())
        else:
            slots = [
                s for d in dict.fromkeys(driver_ids) if (s := self._slot_of.get(d)) is not None
            ]
        if predicate is not None:
            slots = [s for s in slots if predicate(self._record(s))]
        return slots


def _inner_products(rows: Vectors, query: Vectors) -> Vectors:
    """rows @ query in float32, row by row, with FAISS's kernel (fvec_inner_products_ny)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    query = np.ascontiguousarray(query, dtype=np.float32)
    out = np.empty(len(rows), dtype=np.float32)
    if len(rows):
        faiss.fvec_inner_products_ny(  # type: ignore[attr-defined]  # missing from the stubs
            faiss.swig_ptr(out), faiss.swig_ptr(query), faiss.swig_ptr(rows), len(query), len(rows)
        )
    return out


def _clone(index: faiss.IndexIDMap2) -> faiss.IndexIDMap2:
    clone = faiss.clone_index(index)
    assert isinstance(clone, faiss.IndexIDMap2)
    return clone


def _intersect(a: list[str] | None, b: list[str] | None) -> list[str] | None:
    if a is None or b is None:
        return a if b is None else b
    allowed = set(b)
    return [x for x in a if x in allowed]


def _require_local(fs: Any | None) -> None:
    if fs is None:
        return
    protocol = getattr(fs, "protocol", ())
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    if "file" not in protocols and "local" not in protocols:
        raise FleetIndexError(f"FleetVectorStore persists to the local filesystem only, not {fs!r}")
