"""kill -9 during writes: whatever the store holds afterwards decodes to the right vector.

A child process writes batches of entries through the real stores (``build_store``: LMDB on
disk, or Redis as a pipelined client) and reports each batch once ``mset`` returned; the test
SIGKILLs it mid-way and reopens the store. A batch is one LMDB write transaction, or one
Redis ``MSET``: each is atomic, so the count must be a whole number of batches, at least the
ones reported.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cache import codec
from cache.stores import build_store
from tests.redis_server import (  # noqa: F401  (pytest fixtures)
    RedisServer,
    redis_server_fixture,
    redis_session_fixture,
)

REPO = Path(__file__).resolve().parents[1]
DIM = 384
BATCH = 1_000
MiB = 1 << 20


def vector(i: int) -> np.ndarray:
    """Distinct per entry and cheap, so that the child spends its time inside ``mset``."""
    return np.arange(i, i + DIM, dtype=np.float32)


def python_child(code: str, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
    """``python -c code args`` in this repository, its stdout (and ``stdin``) piped, text."""
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        text=True,
    )


def open_store(kind: str, target: str):  # type: ignore[no-untyped-def]
    if kind == "lmdb":
        return build_store("lmdb", memory_bytes=0, data_dir=target, map_size=512 * MiB)
    return build_store("redis", memory_bytes=0, redis_url=target, redis_timeout_s=5.0)


def write_until_killed(kind: str, target: str) -> None:
    """The child: batches of BATCH entries, forever; one line on stdout per finished batch."""
    store = open_store(kind, target)
    for start in range(0, 10**9, BATCH):
        store.mset([(f"ns:{i:09d}", codec.encode(vector(i))) for i in range(start, start + BATCH)])
        assert store.store_errors == 0
        print(start + BATCH, flush=True)


@pytest.mark.parametrize("kind", ["lmdb", pytest.param("redis", marks=pytest.mark.redis)])
def test_kill_9_during_writes_leaves_no_entry_that_decodes_wrongly(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if kind == "lmdb":
        target = str(tmp_path / "data")
    else:
        target = request.getfixturevalue("redis_server").url
    child = python_child(
        "import sys; from tests.test_cache_crash import write_until_killed as w; "
        "w(sys.argv[1], sys.argv[2])",
        kind,
        target,
    )
    assert child.stdout is not None
    reported = 0
    try:
        for _ in range(random.randint(3, 6)):
            line = child.stdout.readline()
            assert line, "the writer died before it was killed"
            reported = int(line)
        # kill while the next batch is being encoded or written
        os.kill(child.pid, signal.SIGKILL)
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    store = open_store(kind, target)
    assert store.store is not None
    keys = sorted(store.store.yield_keys())
    # The child may finish a few more batches between its report and the kill.
    assert reported <= len(keys) <= reported + 20 * BATCH
    assert len(keys) % BATCH == 0, "a batch was written in part"
    assert keys == [f"ns:{i:09d}" for i in range(len(keys))]
    for start in range(0, len(keys), BATCH):
        part = keys[start : start + BATCH]
        for key, value in zip(part, store.mget(part), strict=True):
            assert value is not None
            np.testing.assert_array_equal(codec.decode(value, DIM), vector(int(key[3:])))
    assert store.store_errors == 0
    store.close()
