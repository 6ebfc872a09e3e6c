"""One fleet change as a record: what the fleet index's change log (``indexes.changelog``)
holds, and what the region's shared log on a Redis stream will carry (ARCHITECTURE.md,
"Scale-out beyond one machine"; issue 13), in one format.

Every change has ``seq``, its number: one more than the last change the table applied
(``FleetTable.seq``). Four kinds, each a msgpack array led by its tag (msgspec)::

    ["upsert", seq, ids, vehicle_ids, records, vocabulary, fields, dim, vectors]
        records     the drivers' JSON as upserted (bytes each)
        fields      [[name, numpy dtype str, shape, bytes], ...]: ``Prepared.fields``, the
                    column values the validating worker computed
        vocabulary  ``FleetTable.vocabulary`` of the table that made ``fields``
        vectors     float32 little-endian rows, (len(ids), dim)
    ["update", seq, driver_id, [lat, lng, ts ISO 8601 | null] | null, status | null]
    ["move", seq, ids, lats, lngs, ts, statuses | null]
        lats, lngs  float64 little-endian, one per id; ts int64 little-endian, microseconds
                    since the Unix epoch (UTC); statuses: a status or null per id
    ["delete", seq, driver_id]

An upsert carries the column values so that applying it parses no record: replaying 20,000
drivers (384-d, 200 upserts of 100; 41.5 MB of log, ~2.1 kB a driver of which 49 bytes are
columns) took 0.10-0.11 s that way against 0.29-0.30 s re-validating their JSON (2-core box).
Status codes and constraint bits mean something under one vocabulary only; a change made
under another (another version's log or replica) has its fields recomputed from the JSON.

A *frame* is one change behind an 8-byte header, the unit of a log file (and of a stream
entry)::

    0  4  n: length of the payload (little-endian uint32, > 0)
    4  4  crc32 (zlib) of those four bytes and the payload
    8  n  payload: the msgpack array above

A frame cut short or whose crc does not match ends the readable part of a file (``frames``).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from datetime import datetime
from typing import Any, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from features.models import DriverRecord, Position, Status
from indexes.errors import ChangeLogError
from indexes.table import FleetTable, Moved, Prepared

HEADER = struct.Struct("<II")
_LENGTH = struct.Struct("<I")
MAX_PAYLOAD = 1 << 31  # a larger length is a corrupt header, not a change


class Upsert(msgspec.Struct, tag="upsert", array_like=True, frozen=True):
    seq: int
    ids: list[str]
    vehicle_ids: list[str]
    records: list[bytes]
    vocabulary: int
    fields: list[tuple[str, str, tuple[int, ...], bytes]]
    dim: int
    vectors: bytes

    @classmethod
    def of(
        cls, seq: int, prepared: Prepared, vectors: npt.NDArray[np.float32], vocabulary: int
    ) -> Upsert:
        rows = np.ascontiguousarray(vectors, dtype="<f4")
        columns = [
            (name, a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes())
            for name, a in prepared.fields.items()
        ]
        return cls(
            seq=seq,
            ids=list(prepared.ids),
            vehicle_ids=list(prepared.vehicle_ids),
            records=list(prepared.blobs),
            vocabulary=vocabulary,
            fields=columns,
            dim=rows.shape[1] if rows.ndim == 2 else 0,
            vectors=rows.tobytes(),
        )

    def prepared(self, vocabulary: int) -> Prepared:
        """The records as the table keeps them (their fields recomputed from the JSON when
        they were made under another vocabulary)."""
        if vocabulary != self.vocabulary:
            return Prepared.of([DriverRecord.model_validate_json(r) for r in self.records])
        fields = {
            name: np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape)
            for name, dtype, shape, data in self.fields
        }
        return Prepared(list(self.ids), list(self.vehicle_ids), list(self.records), fields)

    def rows(self) -> npt.NDArray[np.float32]:
        return np.frombuffer(self.vectors, dtype="<f4").reshape(len(self.ids), self.dim)


class Place(msgspec.Struct, array_like=True, frozen=True):
    lat: float
    lng: float
    ts: str | None

    @classmethod
    def of(cls, position: Position) -> Place:
        ts = None if position.ts is None else position.ts.isoformat()
        return cls(position.lat, position.lng, ts)

    def position(self) -> Position:
        ts = None if self.ts is None else datetime.fromisoformat(self.ts)
        return Position(lat=self.lat, lng=self.lng, ts=ts)


class Update(msgspec.Struct, tag="update", array_like=True, frozen=True):
    seq: int
    driver_id: str
    position: Place | None
    status: Status | None


class Positions(NamedTuple):
    """A batch of ``PATCH /v1/fleet/positions``, the arguments of ``FleetTable.move``."""

    ids: list[str]
    lats: npt.NDArray[np.float64]
    lngs: npt.NDArray[np.float64]
    ts_us: npt.NDArray[np.int64]  # microseconds since the Unix epoch, UTC
    statuses: list[Status | None] | None


class Move(msgspec.Struct, tag="move", array_like=True, frozen=True):
    """``PATCH /v1/fleet/positions``: the whole batch as sent; applying it again to an equal
    table skips the same stale and unknown rows (``FleetTable.move``)."""

    seq: int
    ids: list[str]
    lats: bytes
    lngs: bytes
    ts: bytes
    statuses: list[Status | None] | None

    @classmethod
    def of(cls, seq: int, batch: Positions) -> Move:
        return cls(
            seq=seq,
            ids=list(batch.ids),
            lats=batch.lats.astype("<f8").tobytes(),
            lngs=batch.lngs.astype("<f8").tobytes(),
            ts=batch.ts_us.astype("<i8").tobytes(),
            statuses=None if batch.statuses is None else list(batch.statuses),
        )

    def batch(self) -> Positions:
        return Positions(
            self.ids,
            np.frombuffer(self.lats, dtype="<f8"),
            np.frombuffer(self.lngs, dtype="<f8"),
            np.frombuffer(self.ts, dtype="<i8"),
            self.statuses,
        )


class Delete(msgspec.Struct, tag="delete", array_like=True, frozen=True):
    seq: int
    driver_id: str


Change = Upsert | Update | Move | Delete

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Change)


def apply(
    table: FleetTable, change: Change, *, unknown_ok: bool = False
) -> DriverRecord | Moved | None:
    """Make ``change`` in ``table`` as change number ``change.seq``; returns an update's new
    record, a move's outcome. ``unknown_ok``: an update of a driver the table lacks is
    numbered and skipped (replay; the table raises KeyError otherwise)."""
    with table.applying(change.seq):
        if isinstance(change, Upsert):
            table.upsert_prepared(change.prepared(table.vocabulary), change.rows())
        elif isinstance(change, Delete):
            table.delete_driver(change.driver_id)
        elif isinstance(change, Move):
            return table.move(*change.batch())
        elif not unknown_ok or change.driver_id in table:
            position = None if change.position is None else change.position.position()
            return table.update_driver(change.driver_id, position=position, status=change.status)
    return None


def encode(change: Change) -> bytes:
    """``change`` as a frame."""
    payload = _encoder.encode(change)
    length = _LENGTH.pack(len(payload))
    return length + _LENGTH.pack(zlib.crc32(payload, zlib.crc32(length))) + payload


def decode(payload: bytes) -> Change:
    """The change in a frame's payload (one that passed its crc)."""
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        # Intact (its crc matched) yet unreadable: written by another version. Not a torn
        # tail to cut off: the changes after it were acknowledged.
        raise ChangeLogError(f"a change this version cannot read: {exc}") from exc


def frames(data: Any, start: int = 0) -> Iterator[tuple[int, bytes]]:
    """(end offset, payload) of each whole frame in ``data`` (bytes, an mmap) from
    ``start``; stops before the first frame that is cut short or fails its crc."""
    offset, size = start, len(data)
    while offset + HEADER.size <= size:
        length, crc = HEADER.unpack_from(data, offset)
        end = offset + HEADER.size + length
        if not 0 < length < MAX_PAYLOAD or end > size:
            return
        payload = data[offset + HEADER.size : end]
        if zlib.crc32(payload, zlib.crc32(_LENGTH.pack(length))) != crc:
            return
        yield end, payload
        offset = end
