"""A real ``redis-server`` for tests: a free loopback port, a temp dir, no persistence.

``RedisServer(workdir).start()`` launches ``redis-server --save "" --appendonly no --port N
--bind 127.0.0.1`` and waits until it answers PING; ``stop()`` kills it (SIGKILL by default:
a crash, as the fault tests want) and ``start()`` again brings it back on the same port. The
pytest fixtures skip, with the reason, when the ``redis-server`` binary is missing
(``apt-get install -y redis-server``).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REDIS_SERVER = "redis-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server process on ``127.0.0.1:port``, restartable on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, *, durable: bool = False) -> None:
        binary = shutil.which(REDIS_SERVER)
        if binary is None:
            raise FileNotFoundError(
                f"{REDIS_SERVER} not found on PATH (apt-get install -y redis-server)"
            )
        self.binary = binary
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        # durable: an append-only file fsynced on every write (the fleet log's Redis)
        self.durable = durable
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.running:
            return self
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        args += ["--save", "", "--dir", str(self.workdir)]
        if self.durable:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
            args += ["--maxmemory-policy", "noeviction"]
        else:
            args += ["--appendonly", "no"]
        args += ["--logfile", str(self.workdir / "redis.log"), "--protected-mode", "no"]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while not _ping(self.port):
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                log = self.workdir / "redis.log"
                err += log.read_text() if log.exists() else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self, sig: signal.Signals = signal.SIGKILL) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
        proc.wait(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()

    def flush(self) -> None:
        """Empty every database (between tests sharing one server)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(b"FLUSHALL\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise RuntimeError("FLUSHALL failed")

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_or_skip(workdir: Path) -> RedisServer:
    """A started server, or ``pytest.skip`` with the reason when redis-server is missing."""
    try:
        return RedisServer(workdir).start()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


# A test module registers these by importing the ``*_fixture`` functions; the fixture names
# differ from the function names so that test parameters do not shadow the imports.
@pytest.fixture(scope="session", name="redis_session")
def redis_session_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One server for the whole session; tests that share it must use ``redis_server``."""
    server = start_or_skip(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop(signal.SIGTERM)


@pytest.fixture(name="redis_server")
def redis_server_fixture(redis_session: RedisServer) -> RedisServer:
    """The session's server, emptied for this test."""
    redis_session.start()  # a previous test may have stopped it
    redis_session.flush()
    return redis_session


@pytest.fixture(name="own_redis")
def own_redis_fixture(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of this test's own, which the test may kill and restart."""
    server = start_or_skip(tmp_path / "redis")
    yield server
    server.stop()
