"""FLEETCACHE_LMDB_FSYNC_EVERY_S: an LMDB cache without an fsync at every commit keeps its
entries through a process crash and a clean restart, and starts empty after an OS restart
that found it open for such writes (``cache.boot``: its tree may be torn)."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import pytest

from cache import boot
from cache.stores import LmdbByteStore
from proxy.services import build_tiers
from tests.conftest import make_settings
from tests.test_cache_crash import python_child

ENTRIES = [(f"ns:{i:04d}", bytes([i % 251]) * 64) for i in range(500)]


def reboot(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a store opened from now on sees: another boot."""
    monkeypatch.setattr(boot, "current_boot_id", lambda: "a-boot-after-a-crash")


def test_an_os_restart_while_unsynced_writes_were_open_empties_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    crashed = LmdbByteStore(tmp_path, sync=False)
    crashed.mset(ENTRIES)
    # The OS goes down with ``crashed`` open: it never closes.
    reboot(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="cache.boot"):
        store = LmdbByteStore(tmp_path, sync=False)
    assert store.emptied_at_open
    assert store.mget([k for k, _ in ENTRIES[:3]]) == [None, None, None]
    assert "entries were removed" in caplog.text
    store.mset(ENTRIES[:10])  # and it serves on, as a cache
    assert store.mget([ENTRIES[0][0]]) == [ENTRIES[0][1]]
    store.close()


def test_a_clean_close_keeps_the_entries_through_a_restart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = LmdbByteStore(tmp_path, sync=False, sync_every_s=0.05)
    first.mset(ENTRIES)
    time.sleep(0.3)
    assert first.syncs >= 1  # the timer's fsyncs ran
    first.close()
    assert (tmp_path / "boot").read_text().strip() == "clean"
    reboot(monkeypatch)
    store = LmdbByteStore(tmp_path, sync=False)
    assert not store.emptied_at_open
    assert store.mget([k for k, _ in ENTRIES]) == [v for _, v in ENTRIES]
    store.close()


def test_only_the_last_store_to_close_marks_the_cache_clean(tmp_path: Path) -> None:
    """Another process (LMDB opens an environment once per process) holds it open while this
    one closes: still unsynced-dirty until that one closes too."""
    other = python_child(
        "import sys; from cache.stores import LmdbByteStore; "
        "s = LmdbByteStore(sys.argv[1], sync=False); print('open', flush=True); "
        "sys.stdin.readline(); s.close(); print('closed', flush=True)",
        str(tmp_path),
        stdin=True,
    )
    assert other.stdin is not None and other.stdout is not None
    try:
        assert other.stdout.readline().strip() == "open"
        mine = LmdbByteStore(tmp_path, sync=False)
        mine.mset(ENTRIES[:5])
        mine.close()
        assert (tmp_path / "boot").read_text().strip() == boot.current_boot_id()
        other.stdin.write("\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "closed"
        assert (tmp_path / "boot").read_text().strip() == "clean"
    finally:
        other.kill()
        other.wait(timeout=30)
        other.stdin.close()
        other.stdout.close()


def test_a_store_with_fsync_at_every_commit_also_refuses_a_torn_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default mode opening a directory that an unsynced writer left open when the OS
    went down (say, after the setting was turned off) empties it too."""
    crashed = LmdbByteStore(tmp_path, sync=False)
    crashed.mset(ENTRIES)
    reboot(monkeypatch)
    store = LmdbByteStore(tmp_path)  # sync=True
    assert store.emptied_at_open
    assert store.mget([ENTRIES[0][0]]) == [None]
    store.close()
    assert (tmp_path / "boot").read_text().strip() == "clean"


def write_unsynced_until_killed(target: str) -> None:
    """The child of the next test: one line on stdout per batch that ``mset`` returned."""
    store = LmdbByteStore(target, sync=False, sync_every_s=0.5)
    for start in range(0, 10**6, 100):
        store.mset([(f"ns:{i:07d}", b"v" * 512) for i in range(start, start + 100)])
        print(start + 100, flush=True)


def test_kill_9_of_an_unsynced_writer_loses_no_acknowledged_entry(tmp_path: Path) -> None:
    """A process crash is not an OS crash: the page cache holds every committed write."""
    child = python_child(
        "import sys; from tests.test_cache_boot import write_unsynced_until_killed as w; "
        "w(sys.argv[1])",
        str(tmp_path),
    )
    assert child.stdout is not None
    reported = 0
    try:
        for _ in range(20):
            reported = int(child.stdout.readline())
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
    store = LmdbByteStore(tmp_path, sync=False)
    assert not store.emptied_at_open  # the same boot: nothing torn
    keys = [f"ns:{i:07d}" for i in range(reported)]
    assert all(v == b"v" * 512 for v in store.mget(keys))
    store.close()


def test_the_setting_reaches_the_store(tmp_path: Path) -> None:
    tiers = build_tiers(make_settings(tmp_path / "timed", lmdb_fsync_every_s=2.0))
    store = tiers.store
    assert isinstance(store, LmdbByteStore)
    assert store._syncer is not None and not store._env.flags()["sync"]
    tiers.close()
    plain = build_tiers(make_settings(tmp_path / "plain"))
    assert isinstance(plain.store, LmdbByteStore)
    assert plain.store._syncer is None and plain.store._env.flags()["sync"]
    plain.close()
