"""Crash-safe snapshots of the fleet index in a directory.

Layout (``dir`` is what ``FleetVectorStore.save`` is given)::

    dir/CURRENT                      name of the live snapshot, e.g. "snapshot-00000007"
    dir/snapshot-00000007/
        index.faiss                  faiss.write_index of the IndexIDMap2(IndexFlatIP(dim))
        records.jsonl                one DriverRecord.model_dump(mode="json") per line
        meta.json                    {"format", "dim", "next_id", "count", "faiss_ids"}
                                     (faiss_ids[i] is the FAISS id of records.jsonl line i)

A save writes a complete new ``snapshot-N`` directory (every file fsynced), then points
``CURRENT`` at it with ``os.replace`` (atomic), then removes older snapshot directories. A crash
at any moment leaves ``CURRENT`` naming a complete snapshot; leftovers of an interrupted save
are ignored by ``read`` and removed by the next save.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
import numpy.typing as npt
from pydantic import ValidationError

from features.models import DriverRecord
from indexes.errors import SnapshotError

FORMAT = 1
CURRENT = "CURRENT"
PREFIX = "snapshot-"
INDEX_FILE = "index.faiss"
RECORDS_FILE = "records.jsonl"
META_FILE = "meta.json"


@dataclass(frozen=True)
class Snapshot:
    """Everything a store is rebuilt from. ``index`` is an IndexIDMap2 no one else mutates."""

    dim: int
    next_id: int
    index: faiss.IndexIDMap2
    records: list[DriverRecord]
    faiss_ids: list[int]


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
    pointer = root / f"{CURRENT}.tmp"
    try:
        _write_files(target, snap)
        _fsync(target)
        _fsync(root)  # the new directory's entry is durable before CURRENT names it
        _write_durably(pointer, (target.name + "\n").encode())
        os.replace(pointer, root / CURRENT)  # the commit point
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            pointer.unlink()
        raise
    _fsync(root)
    _remove_snapshots(root, keep=target.name)
    return target


def read(root: Path) -> Snapshot | None:
    """The live snapshot under ``root``, or None when there is none (a fresh data dir)."""
    name = _current_name(root)
    if name is None:
        return None
    path = root / name
    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise SnapshotError(f"{path}: unknown snapshot format {meta.get('format')!r}")
        index = faiss.read_index(str(path / INDEX_FILE))
        if not isinstance(index, faiss.IndexIDMap2):
            raise SnapshotError(f"{path}: {INDEX_FILE} holds a {type(index).__name__}")
        with (path / RECORDS_FILE).open("rb") as fh, _gc_paused():
            records = [DriverRecord.model_validate_json(line) for line in fh if line.strip()]
        snap = Snapshot(
            dim=int(meta["dim"]),
            next_id=int(meta["next_id"]),
            index=index,
            records=records,
            faiss_ids=[int(i) for i in meta["faiss_ids"]],
        )
    except SnapshotError:
        raise
    except (OSError, RuntimeError, ValueError, KeyError, TypeError, ValidationError) as exc:
        raise SnapshotError(f"{path}: unreadable snapshot: {exc}") from exc
    _check(path, snap)
    return snap


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while many records are built: its full passes walk every object
    built so far (4x slower for 10,000 records). Records hold no cycles."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def stored_ids(index: faiss.IndexIDMap2) -> npt.NDArray[np.int64]:
    return faiss.vector_to_array(index.id_map).astype(np.int64, copy=False)


def _check(path: Path, snap: Snapshot) -> None:
    index = snap.index
    if index.d != snap.dim:
        raise SnapshotError(f"{path}: index dim {index.d} but meta says {snap.dim}")
    ids = snap.faiss_ids
    if not len(snap.records) == len(ids) == index.ntotal:
        raise SnapshotError(
            f"{path}: {len(snap.records)} records, {len(ids)} ids, {index.ntotal} vectors"
        )
    if len(set(ids)) != len(ids) or set(ids) != set(stored_ids(index).tolist()):
        raise SnapshotError(f"{path}: FAISS ids do not match the id map")
    if ids and (min(ids) < 0 or max(ids) >= snap.next_id):
        raise SnapshotError(f"{path}: ids outside [0, next_id={snap.next_id})")
    if len({r.driver_id for r in snap.records}) != len(snap.records):
        raise SnapshotError(f"{path}: duplicate driver_id in {RECORDS_FILE}")


def _write_files(target: Path, snap: Snapshot) -> None:
    faiss.write_index(snap.index, str(target / INDEX_FILE))
    _fsync(target / INDEX_FILE)
    lines = b"".join(r.model_dump_json().encode() + b"\n" for r in snap.records)
    _write_durably(target / RECORDS_FILE, lines)
    meta = {
        "format": FORMAT,
        "dim": snap.dim,
        "next_id": snap.next_id,
        "count": len(snap.records),
        "faiss_ids": snap.faiss_ids,
    }
    _write_durably(target / META_FILE, json.dumps(meta).encode())


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


def _write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(path: Path) -> None:
    """fsync a file or a directory (a directory's entries: the names we just created)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
