"""The fleet index's change log: a change is on disk (fsynced) before its caller is answered.

Layout (``<index dir>/changelog``)::

    segment-00000000000000000001.log    frames (``indexes.changes``) of changes 1, 2, ...
    segment-00000000000000000413.log    the next segment: its changes are numbered 413 on
    LOCK                                flock'ed by the one owner (a second one is refused)

A segment is named by the number of the first change it may hold, and holds the changes up
to the next segment's name, in order; the last one is appended to. ``rotate`` starts a new
segment, and once a snapshot holds every change up to ``seq``, ``drop_covered(seq)`` deletes
the segments before it: a file delete, never a rewrite. The owner rotates before each
snapshot, so the log holds about the changes since the last one.

Group commit: ``append`` queues its change and waits; one committer task writes everything
queued in one ``write`` and one ``fdatasync`` in a worker thread (never on the event loop),
and whatever arrives meanwhile goes in the next flush together. ``flushes``, ``records`` and
``bytes`` count what it did.

Recovery (``recover``): the table loaded from its snapshot replays every change numbered after
its ``seq``. A crash in the middle of an append leaves the last segment with a frame cut short
(or a crc that fails): the file is truncated there, with a warning naming the bytes dropped;
that change was never acknowledged. A bad frame anywhere else, or an intact one that cannot
be decoded, is a ``ChangeLogError``: changes after it were acknowledged, so nothing is cut.

A failed write or fsync leaves the file in an unknown state (and Linux may have dropped the
dirty pages: a later fsync would succeed without them), so the log refuses every later
change (``ChangeLogError``) until the owner restarts and recovers from what is on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import logging
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

from indexes import changes
from indexes.changes import Change
from indexes.errors import ChangeLogError
from indexes.snapshot import fsync_path
from indexes.table import FleetTable

log = logging.getLogger("fleetcache.index")
PREFIX = "segment-"
SUFFIX = ".log"
LOCK_FILE = "LOCK"


@dataclass(frozen=True)
class _Rotate:
    first: int  # the name of the new segment


@dataclass(frozen=True)
class _Drop:
    seq: int  # delete the segments holding no change after this one


_Item = Change | _Rotate | _Drop


class ChangeLog:
    """Appends to the segments in ``directory`` (see the module docstring); ``last_seq``: the
    number of the last change already in the table (the next append's is one more); ``lock``:
    the file descriptor holding the directory's lock (``recover`` takes it)."""

    def __init__(self, directory: Path, last_seq: int, lock: int) -> None:
        self.directory = directory
        self.last_seq = last_seq
        self.flushes = 0  # write + fdatasync calls
        self.records = 0  # changes written
        self.bytes = 0
        self._lock = lock
        self._segments = segment_names(directory)  # first seqs, ascending
        if not self._segments:
            self._segments.append(last_seq + 1)
        self._fd = self._open(self._segments[-1])
        self._queue: list[_Item] = []
        self._flushed: asyncio.Future[None] | None = None  # of the changes queued now
        self._committer: asyncio.Task[None] | None = None
        self._broken: str | None = None

    async def append(self, change: Change) -> None:
        """Return once ``change`` (numbered after every change appended before) is on disk."""
        if change.seq <= self.last_seq:
            raise ValueError(f"change {change.seq} is not after change {self.last_seq}")
        self.last_seq = change.seq
        await self._submit(change)

    async def rotate(self) -> None:
        """Start a new segment for the changes after those appended so far (nothing once the
        log is broken: a snapshot is then worth saving all the more)."""
        if self._broken is None:
            await self._submit(_Rotate(self.last_seq + 1))

    async def drop_covered(self, seq: int) -> None:
        """Delete the segments whose every change is numbered ``seq`` or less (a snapshot
        holds them); the segment appended to stays."""
        if self._broken is None:
            await self._submit(_Drop(seq))

    async def close(self) -> None:
        """Flush what is queued, then close the file."""
        if self._committer is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._committer)
        self._broken = self._broken or "closed"
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock)  # releases the lock
            self._fd = -1

    def facts(self) -> dict[str, int]:
        return {
            "flushes": self.flushes,
            "records": self.records,
            "bytes": self.bytes,
            "last_seq": self.last_seq,
            "segments": len(self._segments),
        }

    # -- the committer -------------------------------------------------------------------------

    async def _submit(self, item: _Item) -> None:
        if self._broken is not None:
            raise ChangeLogError(f"the fleet change log takes no more changes: {self._broken}")
        loop = asyncio.get_running_loop()
        if self._flushed is None:
            self._flushed = loop.create_future()
        flushed = self._flushed
        self._queue.append(item)
        if self._committer is None or self._committer.done():
            self._committer = loop.create_task(self._commit(), name="fleet-change-log")
        # shielded: a caller that goes away must not cancel the others' flush
        await asyncio.shield(flushed)

    async def _commit(self) -> None:
        while self._queue:
            batch, self._queue = self._queue, []
            flushed, self._flushed = self._flushed, None
            assert flushed is not None
            try:
                await asyncio.to_thread(self._write, batch)
            except BaseException as exc:  # cancelled too: the thread may have written part
                self._break(f"{type(exc).__name__}: {exc}", flushed)
                if not isinstance(exc, Exception):
                    raise
                return
            flushed.set_result(None)

    def _break(self, reason: str, flushed: asyncio.Future[None]) -> None:
        self._broken = reason
        log.error("fleet change log: a write failed, refusing every later change: %s", reason)
        error = ChangeLogError(f"fleet change log write failed: {reason}")
        for future in (flushed, self._flushed):
            if future is not None and not future.done():
                future.set_exception(error)
        self._queue, self._flushed = [], None

    # -- files (in the committer's thread) ----------------------------------------------------

    def _write(self, batch: list[_Item]) -> None:
        frames: list[bytes] = []
        for item in batch:
            if isinstance(item, _Rotate):
                self._flush(frames)
                self._start_segment(item.first)
            elif isinstance(item, _Drop):
                self._drop(item.seq)
            else:
                frames.append(changes.encode(item))
        self._flush(frames)

    def _flush(self, frames: list[bytes]) -> None:
        if not frames:
            return
        data = memoryview(b"".join(frames))
        while data:
            data = data[os.write(self._fd, data) :]
        os.fdatasync(self._fd)
        self.flushes += 1
        self.records += len(frames)
        self.bytes += sum(map(len, frames))
        frames.clear()

    def _start_segment(self, first: int) -> None:
        if os.fstat(self._fd).st_size == 0:
            return  # the segment appended to is still empty: it serves
        fd = self._open(first)
        os.close(self._fd)
        self._fd = fd
        self._segments.append(first)

    def _drop(self, seq: int) -> None:
        # A segment holds changes numbered below the next one's name.
        covered = [a for a, b in itertools.pairwise(self._segments) if b <= seq + 1]
        for first in covered:
            segment_path(self.directory, first).unlink(missing_ok=True)
        if covered:
            fsync_path(self.directory)
            self._segments = self._segments[len(covered) :]

    def _open(self, first: int) -> int:
        path = segment_path(self.directory, first)
        created = not path.exists()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if created:
            fsync_path(self.directory)  # the new name survives a crash
        return fd


def recover(table: FleetTable, directory: Path) -> tuple[ChangeLog, int]:
    """Replay onto ``table`` (loaded from its snapshot) every logged change numbered after its
    ``seq``, cut a torn tail off the last segment, and open the log for appends. Returns the
    log and how many changes were replayed."""
    directory.mkdir(parents=True, exist_ok=True)
    lock = _lock(directory)
    try:
        names = segment_names(directory)
        replayed = 0
        for i, first in enumerate(names):
            replayed += _replay(table, segment_path(directory, first), last=i == len(names) - 1)
        return ChangeLog(directory, table.seq, lock), replayed
    except BaseException:
        os.close(lock)
        raise


def _replay(table: FleetTable, path: Path, *, last: bool) -> int:
    replayed, end = 0, 0
    with path.open("rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            return 0
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for frame_end, payload in changes.frames(data):
                end = frame_end
                change = changes.decode(payload)
                if change.seq <= table.seq:
                    continue  # the snapshot holds it
                if change.seq != table.seq + 1:
                    log.warning(
                        "fleet change log: changes %d to %d are missing before %s",
                        table.seq + 1,
                        change.seq - 1,
                        path.name,
                    )
                changes.apply(table, change, unknown_ok=True)
                replayed += 1
    if end < size:
        if not last:
            raise ChangeLogError(
                f"fleet change log: {path.name} is unreadable from byte {end} of {size}, "
                "and later segments follow it"
            )
        log.warning(
            "fleet change log: dropped %d bytes of a change cut short at the end of %s "
            "(a crash during its append; it was never acknowledged)",
            size - end,
            path.name,
        )
        os.truncate(path, end)
        fsync_path(path)
    return replayed


def _lock(directory: Path) -> int:
    """An exclusive lock on the log (held while the file stays open; the kernel drops it when
    the process dies): a second owner of one index dir would interleave its changes."""
    fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ChangeLogError(
            f"another process owns the fleet change log in {directory.name} "
            "(one index owner per data dir)"
        ) from None
    return fd


def owned_elsewhere(directory: Path) -> bool:
    """Whether another process owns the log in ``directory`` now (a server on its data dir)."""
    if not (directory / LOCK_FILE).exists():
        return False
    try:
        fd = _lock(directory)
    except ChangeLogError:
        return True
    os.close(fd)
    return False


def segment_names(directory: Path) -> list[int]:
    """The first change number of each segment in ``directory``, ascending."""
    names = []
    for path in directory.glob(f"{PREFIX}*{SUFFIX}"):
        with contextlib.suppress(ValueError):
            names.append(int(path.name[len(PREFIX) : -len(SUFFIX)]))
    return sorted(names)


def segment_path(directory: Path, first: int) -> Path:
    return directory / f"{PREFIX}{first:020d}{SUFFIX}"
