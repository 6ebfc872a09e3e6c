"""Crash-safe snapshots of the fleet index in a directory.

Layout (``dir`` is what ``FleetTable.save`` is given), format 3::

    dir/CURRENT                      name of the live snapshot, e.g. "snapshot-00000007"
    dir/snapshot-00000007/
        vectors.npy                  float32 (count, dim): row i is driver i's unit vector
        columns.npz                  per-driver columns (``Columns``, the int64 ``ts`` of
                                     every row included) plus offsets (count + 1 byte
                                     offsets into records.bin)
        records.bin                  the drivers' record JSON, back to back
        ids.json                     {"driver_ids", "vehicle_ids"}
        meta.json                    {"format": 3, "dim", "next_id", "count", "statuses",
                                      "constraints", "seq"} (the names behind status codes
                                     and constraint bits; the number of the last change
                                     held, ``FleetTable.seq``: 0 when written before it was)

Loading reads arrays and one blob: no record is parsed (the store parses a record when it is
read). Older formats still load: format 2 (the same, but ``ts`` only for moved rows, as ISO
times under ``"ts"`` in ids.json: the others' times are read from their record JSON) and
format 1 (``index.faiss`` of an IndexIDMap2, ``records.jsonl``, ``faiss_ids`` in meta.json;
every record parsed). Any other format is a ``SnapshotError``.

A save writes a complete new ``snapshot-N`` directory (every file fsynced), then points
``CURRENT`` at it with ``os.replace`` (atomic), then removes older snapshot directories. A crash
at any moment leaves ``CURRENT`` naming a complete snapshot; leftovers of an interrupted save
are ignored by ``read`` and removed by the next save.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import IO, Any, get_args

import faiss
import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from features.models import DriverRecord, Status
from indexes.columns import (
    MAX_TS_US,
    MIN_TS_US,
    NO_TS,
    Columns,
    timestamp_us,
    timestamps_of_json,
)
from indexes.errors import SnapshotError

FORMAT = 3
CURRENT = "CURRENT"
PREFIX = "snapshot-"
VECTORS_FILE = "vectors.npy"
COLUMNS_FILE = "columns.npz"
RECORDS_FILE = "records.bin"
IDS_FILE = "ids.json"
META_FILE = "meta.json"
# Format 1
V1_INDEX_FILE = "index.faiss"
V1_RECORDS_FILE = "records.jsonl"


@dataclass(frozen=True)
class Snapshot:
    """Everything a table is rebuilt from; row i of every part belongs to driver_ids[i]."""

    dim: int
    next_id: int
    vectors: npt.NDArray[np.float32]  # (count, dim); memory-mapped when read
    driver_ids: list[str]
    vehicle_ids: list[str]
    records: list[bytes]  # record JSON
    columns: Columns
    statuses: tuple[str, ...]  # status code -> name
    constraints: tuple[str, ...]  # constraint bit -> name
    seq: int = 0  # the last change held (the change log replays those after it)


def write(root: Path, snap: Snapshot) -> Path:
    """Write ``snap`` as the new live snapshot under ``root``; returns its directory."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        live = _current_name(root)
    except SnapshotError:
        live = None  # a broken pointer: the snapshot written now replaces it
    _remove_snapshots(root, keep=live)  # debris of saves that died midway
    target = root / f"{PREFIX}{_next_generation(root, live):08d}"
    target.mkdir()
    try:
        _write_files(target, snap)
        make_live(root, target)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (root / f"{CURRENT}.tmp").unlink()
        raise
    _remove_snapshots(root, keep=target.name)
    return target


def make_live(root: Path, target: Path) -> None:
    """Point ``CURRENT`` of ``root`` at the complete snapshot directory ``target`` (its files
    written), durably: the directory and its entry on disk first, then the pointer replaced
    atomically (the commit point), then the replacement itself on disk."""
    fsync_path(target)
    fsync_path(root)  # the new directory's entry is durable before CURRENT names it
    replace_durably(root / CURRENT, (target.name + "\n").encode())


def live_dir(root: Path) -> Path | None:
    """The live snapshot's directory under ``root`` (None: no snapshot yet)."""
    name = _current_name(root)
    return None if name is None else root / name


def read(root: Path) -> Snapshot | None:
    """The live snapshot under ``root``, or None when there is none (a fresh data dir)."""
    path = live_dir(root)
    if path is None:
        return None
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        fmt = meta.get("format")
        if fmt in (2, FORMAT):
            snap = _read_v2(path, meta)
        elif fmt == 1:
            snap = _read_v1(path, meta)
        else:
            raise SnapshotError(
                f"{path}: unknown snapshot format {fmt!r} (this version reads formats 1 to 3)"
            )
    except SnapshotError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, ValidationError) as exc:
        raise SnapshotError(f"{path}: unreadable snapshot: {exc}") from exc
    _check(path, snap)
    return snap


# -- formats 3 and 2 -------------------------------------------------------------------------


def _write_files(target: Path, snap: Snapshot) -> None:
    _write_with(target / VECTORS_FILE, lambda fh: np.save(fh, snap.vectors))
    lengths = np.fromiter((len(r) for r in snap.records), dtype=np.int64, count=len(snap.records))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    cols = {**snap.columns.arrays(), "offsets": offsets}
    _write_with(target / COLUMNS_FILE, lambda fh: np.savez(fh, allow_pickle=False, **cols))
    write_durably(target / RECORDS_FILE, b"".join(snap.records))
    ids = {"driver_ids": snap.driver_ids, "vehicle_ids": snap.vehicle_ids}
    write_durably(target / IDS_FILE, json.dumps(ids).encode())
    meta = {
        "format": FORMAT,
        "dim": snap.dim,
        "next_id": snap.next_id,
        "count": len(snap.driver_ids),
        "statuses": list(snap.statuses),
        "constraints": list(snap.constraints),
        "seq": snap.seq,
    }
    write_durably(target / META_FILE, json.dumps(meta).encode())


def _read_v2(path: Path, meta: dict[str, Any]) -> Snapshot:
    count, dim = int(meta["count"]), int(meta["dim"])
    vectors = np.load(path / VECTORS_FILE, mmap_mode="r")
    if vectors.dtype != np.float32 or vectors.shape != (count, dim):
        raise SnapshotError(
            f"{path}: {VECTORS_FILE} holds {vectors.dtype} {vectors.shape}, "
            f"expected float32 ({count}, {dim})"
        )
    with np.load(path / COLUMNS_FILE) as npz:
        arrays = {name: npz[name] for name in npz.files}
    offsets = arrays.pop("offsets")
    ids = json.loads((path / IDS_FILE).read_bytes())
    blob = (path / RECORDS_FILE).read_bytes()
    if len(offsets) != count + 1 or offsets[0] != 0 or offsets[-1] != len(blob):
        raise SnapshotError(
            f"{path}: {RECORDS_FILE} holds {len(blob)} bytes, its offsets say {offsets[-1:]}"
        )
    if (np.diff(offsets) < 0).any():
        raise SnapshotError(f"{path}: {RECORDS_FILE} offsets go backwards")
    bounds = offsets.tolist()
    with _gc_paused():
        records = [blob[a:b] for a, b in itertools.pairwise(bounds)]
    if meta["format"] == 2:
        arrays["ts"] = _format_2_ts(ids["ts"], arrays["moved"], records)
    columns = Columns(**arrays)
    for name, a in columns.arrays().items():
        if len(a) != count:
            raise SnapshotError(f"{path}: column {name} has {len(a)} rows, expected {count}")
    return Snapshot(
        dim=dim,
        next_id=int(meta["next_id"]),
        vectors=vectors,
        driver_ids=ids["driver_ids"],
        vehicle_ids=ids["vehicle_ids"],
        records=records,
        columns=columns,
        statuses=tuple(meta["statuses"]),
        constraints=tuple(meta["constraints"]),
        seq=int(meta.get("seq", 0)),
    )


def _format_2_ts(
    moved_ts: dict[str, str], moved: npt.NDArray[np.bool_], records: list[bytes]
) -> npt.NDArray[np.int64]:
    """The ``ts`` column of a format 2 snapshot: moved rows' times were saved as ISO times
    (none saved: no time), the others' are in their record JSON."""
    ts = np.full(len(records), NO_TS, dtype=np.int64)
    still = np.flatnonzero(~moved[: len(records)])
    ts[still] = timestamps_of_json([records[i] for i in still.tolist()])
    for row, iso in moved_ts.items():
        ts[int(row)] = timestamp_us(datetime.fromisoformat(iso))
    return ts


# -- format 1 (read only) ---------------------------------------------------------------------


def _read_v1(path: Path, meta: dict[str, Any]) -> Snapshot:
    index = faiss.read_index(str(path / V1_INDEX_FILE))
    if not isinstance(index, faiss.IndexIDMap2):
        raise SnapshotError(f"{path}: {V1_INDEX_FILE} holds a {type(index).__name__}")
    with (path / V1_RECORDS_FILE).open("rb") as fh, _gc_paused():
        lines = [line.rstrip(b"\n") for line in fh if line.strip()]
        records = [DriverRecord.model_validate_json(line) for line in lines]
    fids = [int(i) for i in meta["faiss_ids"]]
    stored = faiss.vector_to_array(index.id_map).astype(np.int64).tolist()
    if not len(records) == len(fids) == index.ntotal or set(fids) != set(stored):
        raise SnapshotError(
            f"{path}: {len(records)} records, {len(fids)} ids, {index.ntotal} vectors "
            "(or FAISS ids that do not match the id map)"
        )
    row_of = {fid: row for row, fid in enumerate(stored)}
    flat = faiss.downcast_index(index.index)
    vectors = flat.reconstruct_n(0, index.ntotal)[[row_of[f] for f in fids]]
    statuses: tuple[str, ...] = get_args(Status)
    columns = Columns.empty(len(records))
    bits = np.zeros(len(records), dtype=np.uint64)  # no vocabulary below: the store computes
    code = {s: i for i, s in enumerate(statuses)}
    fields = Columns.fields_of(records, bits, code)
    columns.put(np.arange(len(records)), np.asarray(fids, dtype=np.int64), fields, lines)
    return Snapshot(
        dim=int(meta["dim"]),
        next_id=int(meta["next_id"]),
        vectors=np.ascontiguousarray(vectors.reshape(len(records), index.d), dtype=np.float32),
        driver_ids=[r.driver_id for r in records],
        vehicle_ids=[r.vehicle.vehicle_id for r in records],
        records=lines,
        columns=columns,
        statuses=statuses,
        constraints=(),
    )


# -- checks and files -------------------------------------------------------------------------


def _check(path: Path, snap: Snapshot) -> None:
    n = len(snap.driver_ids)
    if len(snap.vehicle_ids) != n or len(snap.records) != n:
        raise SnapshotError(f"{path}: {n} driver ids, {len(snap.records)} records")
    # Duplicate driver ids are caught by the store while it builds its id map.
    fid = np.sort(snap.columns.fid)
    if n and ((np.diff(fid) == 0).any() or fid[0] < 0 or fid[-1] >= snap.next_id):
        raise SnapshotError(f"{path}: vector ids repeat or lie outside [0, {snap.next_id})")
    status = snap.columns.status
    if n and (status.min() < 0 or status.max() >= len(snap.statuses)):
        raise SnapshotError(f"{path}: status codes outside {list(snap.statuses)}")
    lat, lng = snap.columns.lat, snap.columns.lng
    if not ((lat >= -90.0) & (lat <= 90.0) & (lng >= -180.0) & (lng <= 180.0)).all():
        raise SnapshotError(f"{path}: positions out of range")
    ts = snap.columns.ts
    if ((ts != NO_TS) & ((ts < MIN_TS_US) | (ts > MAX_TS_US))).any():
        raise SnapshotError(f"{path}: position times out of range")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while many objects are built: its full passes walk every object
    built so far (4x slower for 10,000 records). Nothing built here holds a cycle."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _current_name(root: Path) -> str | None:
    try:
        name = (root / CURRENT).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not name.startswith(PREFIX) or "/" in name or not (root / name).is_dir():
        raise SnapshotError(f"{root / CURRENT} names no snapshot directory: {name!r}")
    return name


def _generation(name: str) -> int:
    try:
        return int(name.removeprefix(PREFIX))
    except ValueError:
        return 0


def _next_generation(root: Path, live: str | None) -> int:
    names = [p.name for p in root.iterdir() if p.name.startswith(PREFIX)]
    if live:
        names.append(live)
    return 1 + max((_generation(n) for n in names), default=0)


def _remove_snapshots(root: Path, keep: str | None) -> None:
    for p in root.iterdir():
        if p.name.startswith(PREFIX) and p.name != keep:
            shutil.rmtree(p, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        (root / f"{CURRENT}.tmp").unlink()


def write_durably(path: Path, *pieces: bytes) -> None:
    """Create ``path`` holding ``pieces`` one after another, fsynced before it returns."""
    _write_with(path, lambda fh: fh.writelines(pieces))


def replace_durably(path: Path, content: bytes) -> None:
    """Replace ``path`` with ``content`` atomically (a reader sees the old file or the new,
    never part of one) and durably: ``PATH.tmp`` written and fsynced, renamed over it, the
    rename itself fsynced (its directory)."""
    tmp = path.with_name(f"{path.name}.tmp")
    write_durably(tmp, content)
    os.replace(tmp, path)
    fsync_path(path.parent)


def _write_with(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    with path.open("wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: the names we just created)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
