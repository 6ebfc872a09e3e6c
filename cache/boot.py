"""The boot guard of an LMDB environment written without an fsync at every commit.

Without that fsync (``LmdbByteStore(sync=False)``, ``FLEETCACHE_LMDB_FSYNC_EVERY_S``) LMDB
stays whole through a process crash (its writes are in the OS page cache, which outlives the
process) but not through an OS crash or a power loss: pages reach the disk in any order, and
the B-tree may be torn. A cache can afford to lose its entries, never to read a torn tree.
So the directory records who may have left unsynced pages behind:

- ``boot``: ``clean``, or the id of the boot (``/proc/sys/kernel/random/boot_id``) during
  which a process opened the environment for unsynced writes and has not closed it since;
- ``boot.lock``: held exclusively while ``boot`` is read or written;
- ``open.lock``: held shared by every process that has the environment open.

On open, ``boot`` naming another boot means the OS went down while unsynced writes may have
been in flight: data.mdb and lock.mdb are removed (logged) and the cache starts empty. The
last process to close (it can take ``open.lock`` exclusively) after an fsync writes
``clean``. A process killed in this boot leaves ``boot`` as it is, which is right: its
writes are whole in the page cache; the next reboot empties the cache instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_CLEAN = "clean"


def current_boot_id() -> str:
    """This boot's id (Linux)."""
    try:
        return BOOT_ID.read_text().strip()
    except OSError as exc:
        raise RuntimeError(f"an LMDB cache without fsync needs the OS's boot id: {exc}") from exc


class BootGuard:
    """Held for as long as one store has the environment in ``directory`` open (above).
    ``unsynced``: this store commits without fsync. ``emptied``: whether opening removed
    entries an OS crash may have torn."""

    def __init__(self, directory: Path, *, unsynced: bool) -> None:
        self.directory = directory
        self._unsynced = unsynced
        self._open = os.open(directory / "open.lock", os.O_RDWR | os.O_CREAT, 0o644)
        with self._marker_locked():
            seen = self._read()
            boot = current_boot_id() if unsynced or seen != _CLEAN else ""
            self.emptied = seen not in (_CLEAN, boot)
            if self.emptied:
                for name in ("data.mdb", "lock.mdb"):
                    (directory / name).unlink(missing_ok=True)
                log.warning(
                    "%s: the OS restarted while this cache had unsynced writes (boot %s); "
                    "its entries were removed, the cache starts empty",
                    directory,
                    seen,
                )
            self._write(boot if unsynced else _CLEAN if self.emptied else seen)
            fcntl.flock(self._open, fcntl.LOCK_SH)

    def release(self, synced: bool) -> None:
        """The store closed (``synced``: after an fsync of its data); the last one out of an
        environment with nothing unsynced left marks it clean."""
        try:
            with self._marker_locked():
                try:
                    fcntl.flock(self._open, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return  # others still have it open
                if synced:
                    self._write(_CLEAN)
        finally:
            os.close(self._open)  # releases open.lock

    def _read(self) -> str:
        try:
            return (self.directory / "boot").read_text().strip() or _CLEAN
        except FileNotFoundError:
            return _CLEAN

    def _write(self, value: str) -> None:
        if self._read() == value:
            return
        tmp = self.directory / "boot.tmp"
        tmp.write_text(value + "\n")
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(self.directory / "boot")
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself reaches the disk before any unsynced commit
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _marker_locked(self) -> Iterator[None]:
        """``boot.lock`` held exclusively inside."""
        fd = os.open(self.directory / "boot.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
