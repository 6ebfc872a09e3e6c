"""``fleetcache serve`` as a real process tree for tests: supervisor, engine, index, workers.

``FleetcacheServer(tmp_path, workers=2, **settings).start()`` runs the CLI on a free loopback
port with the fake engine and waits for ``/readyz``; ``stop()`` sends SIGTERM (as an operator
would) and waits for the whole tree to exit. ``pids()`` reads ``/v1/stats`` ``processes``;
``descendants(pid)`` finds a whole tree; ``crash(pid)`` kills it all at once (a power cut).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import free_port

REPO = Path(__file__).resolve().parents[1]


class FleetcacheServer:
    def __init__(self, workdir: Path, *, workers: int = 2, **settings: Any) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("FLEETCACHE_")},
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "FLEETCACHE_ENGINE": "fake",
            "FLEETCACHE_DATA_DIR": str(workdir / "data"),
            "FLEETCACHE_MAX_DELAY_MS": "1",
            "FLEETCACHE_MEMORY_CACHE_MB": "16",
            "FLEETCACHE_LMDB_MAP_SIZE_GB": "0.25",
            **{f"FLEETCACHE_{k.upper()}": str(v) for k, v in settings.items()},
        }
        self.log = workdir / "serve.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 90.0) -> FleetcacheServer:
        command = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(self.port)]
        command += ["--workers", str(self.workers), "--log-level", "warning"]
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                command, cwd=self.workdir, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 60.0, in_a_row: int = 8) -> None:
        """Until ``in_a_row`` answers of /readyz in a row are 200, each on a new connection:
        the kernel hands each to one worker (SO_REUSEPORT), and a worker is ready once its
        own engine and index clients are, so one 200 does not say the others are (seen in a
        CI run on a loaded 2-core box: the first fleet call after a restart reached a worker
        whose index client was not up yet, 503)."""
        deadline = time.monotonic() + timeout_s
        last, ready = "", 0
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"fleetcache serve exited:\n{self.log.read_text()}")
            with contextlib.suppress(httpx.TransportError):
                response = httpx.get(f"{self.url}/readyz", timeout=2)
                ready = ready + 1 if response.status_code == 200 else 0
                if ready >= in_a_row:
                    return
                last = response.text
                if ready:
                    continue
            time.sleep(0.1)
        raise AssertionError(f"not ready after {timeout_s} s: {last}\n{self.log.read_text()}")

    def stats(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/v1/stats", timeout=10)
        assert response.status_code == 200, response.text
        return dict(response.json())

    def pids(self) -> dict[str, Any]:
        return dict(self.stats()["processes"])

    def stop(self, timeout_s: float = 60.0) -> int:
        process, self.process = self.process, None
        if process is None:
            return 0
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
            raise AssertionError(
                f"serve did not stop in {timeout_s} s:\n{self.log.read_text()}"
            ) from None

    def __enter__(self) -> FleetcacheServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def crash(pid: int) -> None:
    """The tree of ``pid`` dies at once: every process is stopped (SIGSTOP) before any is
    killed, so none sees another die and reacts (a child gets SIGTERM when its parent dies,
    and an index owner given SIGTERM saves its snapshot on the way out)."""
    tree = [pid, *descendants(pid)]
    for signum in (signal.SIGSTOP, signal.SIGKILL):
        for member in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(member, signum)


def stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat after the command name: its state, its parent's pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def parent_of(pid: int) -> int:
    return int(stat_fields(pid)[1])


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            children.setdefault(int(stat_fields(entry.name)[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cpus_of(pid: int) -> set[str]:
    """The CPU lists every thread of ``pid`` may run on (``Cpus_allowed_list``; a thread
    that ends while read is left out)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    found.add(line.split(":", 1)[1].strip())
    return found
