"""Warm-up jobs of ``fleetcache serve``, each in a process of its own (ARCHITECTURE.md).

A job reads, validates and renders its file and writes the cache off the serving processes:
the HTTP workers only start it and read its progress. It is a client of the engine process
(misses on the warm-up lane, below every dispatch miss) and of the fleet index owner, like a
worker, and runs at a lower CPU priority than the workers (``nice``), so that cached dispatch
lookups keep their cores.

Its state lives in files under ``<data dir>/warmup/jobs/`` (kept across restarts)::

    <id>.json      the progress (``WarmupProgress``) plus pid, server and parameters,
                   replaced atomically about twice a second by the job
    <id>.cancel    present: stop now (the checkpoint keeps the place)
    .start.lock    held by the worker starting a job

A job is forked by the server's job starter (``starter_main``), a process that imported what
a job runs once, when the server started, where a fresh interpreter (``python -m proxy.jobs``,
which a worker still starts when the starter does not answer) spent ~2.2 s of a job's start
importing it on the H200; on 2 cores a job's first rows came 0.70 s after its POST against
1.51 (docs/BENCHMARKS.md, 2026-12-05).

Any worker answers ``GET /v1/warmup/{id}`` from the file. A job whose process is gone while
its file says ``queued`` or ``running`` (the server was stopped or died) reads as ``failed``
("server restarted"); the same POST resumes it from its checkpoint. A job started from an
uploaded body removes the upload when it ends (the next start removes that of a job killed
outright). Workers start jobs one at a time (a lock on the jobs dir), and none while a job of
the same checkpoint is live: that POST is a 409.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import heapq
import importlib
import itertools
import json
import logging
import multiprocessing
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from proxy.board import Boards, owner_alive
from proxy.cores import lower, pin_threads, usable_cores
from proxy.ipc import ServiceUnavailableError
from proxy.processes import ENGINE_GC_THRESHOLDS, ChildSpec, frozen_heap
from proxy.public import public_error
from proxy.settings import Settings
from proxy.warmup import (
    CHECKPOINT_EVERY_S,
    LIVE,
    JobRunning,
    Shard,
    WarmupProgress,
    checkpoint_files,
    checkpoint_for,
    rejects_part,
    rejects_parts,
    shown_source,
)

log = logging.getLogger("fleetcache.warmup")
SPEC_FILE = "spec.json"  # written by the supervisor into the run dir: what a job is told
NICE = 10
# How often a job's state file (and each reader's report to it) is rewritten, and at once when
# its first rows are indexed: what /v1/warmup/{id} and a benchmark's timeline of the job read
# (at 0.5 s a job's first rows showed up to half a second late, a fifth of a 4 s job).
PROGRESS_EVERY_S = 0.1
# Records per cache call of a job: larger than the in-process 64 (no dispatch request shares
# this loop), so fewer round trips to the engine and the index; measured 7.6k vs 6.9k
# features/s alone on the 2-core box (512 vs 64).
JOB_SLICE = 256
_PROGRESS_FIELDS = {f.name for f in fields(WarmupProgress)}
# A reader's collector (``frozen_heap``): it allocates a few hundred containers a record
# (validation, texts, ids) and keeps a chunk's records alive while their slices run, so at the
# default thresholds (700) the collector walked them again and again. A reader's own work
# (reading 1 line in 3, validating, rendering, tokenizing, the index's columns) over 30,000
# drivers, ``bench/reader_bench.py`` on the 2-core box: 76.5 us a feature at the default,
# 50.5 with the heap frozen and these thresholds, the engine process's (medians of 5 runs).
READER_GC_THRESHOLDS = ENGINE_GC_THRESHOLDS
# The job process forks its shards (``run_job``): no thread may run in it then, not even
# numpy's BLAS pool (a shard does no large linear algebra) or the background thread of
# pyarrow's jemalloc.
NO_THREADS = {
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "JE_ARROW_MALLOC_CONF": "background_thread:false",
}
STARTER_NAME = "fleetcache-jobs"  # the starter's and its jobs' process name (``ps``, ``top``)
STARTER_SOCKET = "job-starter.sock"  # in the run dir: a worker sends a job id, gets its pid
STARTER_REPLY_S = 10.0  # a fork takes milliseconds; silence this long means it never will
STARTER_PASSED_S = 60.0  # after a silence, a worker starts jobs itself this long
START_LOCK = ".start.lock"  # in the jobs dir: held by the worker starting a job


def lower_priority(pid: int) -> None:
    """Process ``pid`` (a job) at ``NICE`` below this one (a worker), at most 19: the workers
    keep their cores. The worker sets it right after the job's exec, so that the job's start
    (1-3 s of imports) does not compete with them either.

    A job runs in a process group of its own (no signal to the server's group, a terminal's
    ^C or a worker's end, reaches it) but in the server's session: where the kernel groups
    the processes of each session (``CONFIG_SCHED_AUTOGROUP``, on in this box's kernel as in
    many distributions') a nice value only ranks a process within its session's group, so
    a job in a session of its own took a whole group's share of the cores beside the
    server's, whatever its nice (``perf sched``, 2-core box, docs/BENCHMARKS.md 2026-12-05)."""
    lower(pid, NICE)


def jobs_dir(settings: Settings) -> Path:
    return settings.data_dir / "warmup" / "jobs"


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """``path`` replaced at once. The worker that starts a job and the job itself both write
    its state file, at the same moment when the job is forked (ms after its POST): each
    writes its own temporary file (one shared name let one's rename take the other's away,
    a 500 to the POST once in seven jobs in bench/serve_bench.py, 2026-12-05)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def life_lock(directory: Path, job_id: str) -> Path:
    """The file a job and its readers hold locked while any of them lives (``run_job``)."""
    return directory / f"{job_id}.lock"


def _held(path: Path) -> bool:
    """Whether some process holds ``path`` locked (a job's ``life_lock``)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # none: the job ended, or has not begun (its pid says)
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it this probe's own lock
    return False


def _alive(pid: int) -> bool:
    """Running: not gone, and not a zombie (dead, its parent not having waited for it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):  # no /proc: as kill says
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


class ProcessJobs:
    """The worker's view of the server's jobs: the same surface as ``WarmupJobs``."""

    def __init__(self, settings: Settings, run_dir: Path) -> None:
        self.settings = settings
        self.run_dir = run_dir
        self.server = run_dir.name  # which server run a job file belongs to
        self.dir = jobs_dir(settings)
        self._starter_passed_until = 0.0  # monotonic: the starter was silent, not asked now

    async def start(
        self, services: Any, path: Path, *, chunk_size: int = 500, upload: str | None = None
    ) -> str:
        """Start a job over ``path`` (an uploaded body of digest ``upload``: removed when the
        job ends); ``JobRunning`` while a job of the same source (its checkpoint) is live."""
        self.dir.mkdir(parents=True, exist_ok=True)
        job_id = f"w{int(time.time())}-{os.urandom(3).hex()}"
        state = {
            **asdict(WarmupProgress(source=shown_source(path, self.settings), state="queued")),
            "pid": 0,
            "server": self.server,
            "path": str(path),
            "chunk_size": chunk_size,
            "upload": upload,
            "checkpoint": str(checkpoint_for(self.settings.data_dir, path, sha256=upload).file),
        }
        # off the event loop: a starter that does not answer must not hold the worker's
        # requests, nor another worker's start this one's
        await asyncio.to_thread(self._start, job_id, state)
        return job_id

    def _start(self, job_id: str, state: dict[str, Any]) -> None:
        """One start at a time over the server's workers (a lock on the jobs dir): none
        begins while another job of its source is live, and a job is forked before the next
        start looks."""
        with (self.dir / START_LOCK).open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            try:
                self._refuse_a_second(state["checkpoint"])
                _write_json(self.dir / f"{job_id}.json", state)
            except BaseException:  # no state names this POST's upload: nothing would remove it
                if state["upload"]:
                    Path(state["path"]).unlink(missing_ok=True)
                raise
            try:
                asked = time.monotonic() >= self._starter_passed_until
                pid = (self._from_starter(job_id) if asked else None) or self._from_scratch(job_id)
            except ServiceUnavailableError as exc:
                # the start lock is held while the starter is waited for: the next starts of
                # this worker do not wait for it again a while
                self._starter_passed_until = time.monotonic() + STARTER_PASSED_S
                # the starter took the id and may fork the job yet: the job reads this and
                # does not run (run_job); the next POST starts another
                failed = {"state": "failed", "error": str(exc), "finished": time.time()}
                _write_json(self.dir / f"{job_id}.json", {**state, **failed})
                raise
            lower_priority(pid)  # a no-op for a job of the starter, which runs there already
            # the job reads and writes its state only once this lock is let go (run_job)
            _write_json(self.dir / f"{job_id}.json", {**state, "pid": pid})

    def _refuse_a_second(self, checkpoint: str) -> None:
        """``JobRunning`` where a live job has ``checkpoint``; the jobs that died (with their
        server, or killed) settled on the way, as their end would have: their rejects merged,
        their uploads, locks and ``.cancel`` files removed."""
        for file in self.dir.glob("*.json"):
            try:
                state = self._read(file.stem)
            except (OSError, ValueError):
                continue
            progress = self._judged(file.stem, state)
            if progress.state in LIVE and state.get("checkpoint") == checkpoint:
                raise JobRunning(file.stem)
            if progress.state == "failed":
                with contextlib.suppress(OSError, ValueError):  # not this POST's to fail
                    life_lock(self.dir, file.stem).unlink(missing_ok=True)
                    (self.dir / f"{file.stem}.cancel").unlink(missing_ok=True)  # a DELETE's
                    self._settle_rejects(file.stem, state)
                    if state.get("upload"):
                        Path(state["path"]).unlink(missing_ok=True)

    def _settle_rejects(self, job_id: str, state: dict[str, Any]) -> None:
        """A job killed outright (the OOM killer) left its readers' rejects in their parts:
        each cut back to the place its checkpoint kept (the job that resumes it lists the
        rows from there), then merged into the job's file, as its end would have done."""
        rejects = self.dir.parent / f"{job_id}.rejects.jsonl"
        parts = rejects_parts(rejects)
        if not parts:
            return
        places = checkpoint_files(self.settings.data_dir, Path(state["path"]), state.get("upload"))
        _cut_to_places(parts, places)
        _merge_rejects(rejects, parts, self.settings.max_rejects)

    def _from_starter(self, job_id: str) -> int | None:
        """The pid of the job forked by the server's job starter, or None when it did not
        fork it: not there (not started yet, restarting, an app without a supervisor), gone
        before it took the job id (the kernel resets a connection it never accepted), or it
        said so (0). ``ServiceUnavailableError`` (a 503 to the POST) when it took the id and
        then closed or was silent for ``STARTER_REPLY_S``: it may fork the job yet."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as starter:
            starter.settimeout(STARTER_REPLY_S)
            try:
                starter.connect(str(self.run_dir / STARTER_SOCKET))
            except (FileNotFoundError, ConnectionRefusedError, BlockingIOError, TimeoutError):
                return None  # it never took the id (not there, or its backlog full)
            try:
                starter.sendall(job_id.encode() + b"\n")
                reply = starter.recv(32)
            except (ConnectionResetError, BrokenPipeError):  # gone before it read the id
                return None
            except TimeoutError:
                reply = None
        if not reply:  # it took the id (it may yet fork the job): a second one must not run
            said = "did not answer in time" if reply is None else "stopped"
            raise ServiceUnavailableError(
                f"the job starter {said} while it started job {job_id}: that job will not "
                "run; POST again",
                "job_starter",
            )
        return int(reply) or None

    def _from_scratch(self, job_id: str) -> int:
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy.jobs", str(self.run_dir), job_id],
            process_group=0,  # not a child of this worker's fate: a worker restart leaves
            stdin=subprocess.DEVNULL,  # the job running (its session: ``lower_priority``)
            env={**os.environ, **NO_THREADS},
        )
        # waited for, so that it does not stay a zombie of this worker once it ends
        threading.Thread(target=process.wait, name=f"wait-{job_id}", daemon=True).start()
        return process.pid

    def _read(self, job_id: str) -> dict[str, Any]:
        return dict(json.loads((self.dir / f"{job_id}.json").read_text()))

    def _progress(self, job_id: str) -> WarmupProgress | None:
        try:
            state = self._read(job_id)
        except (OSError, ValueError):
            return None
        return self._judged(job_id, state)

    def _judged(self, job_id: str, state: dict[str, Any]) -> WarmupProgress:
        """The job's progress from its state file; a job it shows running whose process is
        gone, and its readers too (its ``life_lock`` free: killed outright, its readers stop
        after it, keeping their places), is ``failed`` ("server restarted", or, in this
        server's run, its process killed: by the OOM killer, say), finished when it last
        wrote its state, which every read agrees on."""
        progress = WarmupProgress(**{k: v for k, v in state.items() if k in _PROGRESS_FIELDS})
        ours = state.get("server") == self.server
        if (
            progress.state in LIVE
            and not (ours and state.get("pid") and _alive(state["pid"]))
            and not _held(life_lock(self.dir, job_id))  # its readers, stopping after it
        ):
            progress.state = "failed"
            progress.error = (
                "the job's process died (resumable: POST the job again)"
                if ours
                else "server restarted"
            )
            with contextlib.suppress(OSError):  # gone meanwhile: no time to give
                progress.finished = (
                    progress.finished or (self.dir / f"{job_id}.json").stat().st_mtime
                )
        return progress

    def get(self, job_id: str) -> WarmupProgress | None:
        if not job_id.replace("-", "").isalnum():
            return None
        return self._progress(job_id)

    def all(self) -> dict[str, WarmupProgress]:
        out = {}
        for path in sorted(self.dir.glob("*.json")):
            progress = self._progress(path.stem)
            if progress is not None:
                out[path.stem] = progress
        return out

    def cancel(self, job_id: str) -> WarmupProgress | None:
        progress = self.get(job_id)
        if progress is not None and progress.state in LIVE:
            (self.dir / f"{job_id}.cancel").touch()  # the job removes it as it ends
        return progress

    async def aclose(self) -> None:
        """Jobs belong to the server, not to this worker: the supervisor stops them."""


def stop_jobs(settings: Settings, server: str, grace_s: float = 10.0) -> None:
    """SIGTERM every running job of this server run (the supervisor, on its way out)."""
    pids = []
    for path in jobs_dir(settings).glob("*.json"):
        with contextlib.suppress(OSError, ValueError):
            state = json.loads(path.read_text())
            if state.get("server") == server and state.get("state") in LIVE:
                pid = int(state.get("pid") or 0)
                if pid and _alive(pid):
                    os.kill(pid, signal.SIGTERM)
                    pids.append(pid)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# -- the job process -----------------------------------------------------------------------


class DispatchTraffic:
    """Lookups by every caller but warm-up, over the whole server: one counter of the boards
    (``cache.dispatch_lookups``, each process's ``CacheStats.dispatch_lookups``), read at
    most every ``every_s``; the job's pacing watches it change."""

    def __init__(self, boards: Boards, every_s: float = 0.1) -> None:
        self.boards = boards
        self.every_s = every_s
        self._read_at = -every_s
        self._lookups = 0

    def lookups(self) -> int:
        if time.monotonic() - self._read_at >= self.every_s:
            self._lookups = int(self.boards.scalar("cache.dispatch_lookups"))
            self._read_at = time.monotonic()
        return self._lookups


@dataclass(frozen=True)
class JobOptions:
    """What every shard of one job is told (picklable: shards may be spawned)."""

    path: str
    chunk_size: int
    checkpoint_every_s: float
    rejects: str  # the job's rejects file; shard i writes <rejects>.part<i>, merged at the end
    cancel_file: str  # present: stop
    upload: str | None = None  # an uploaded body's SHA-256: its checkpoint follows it


def shard_count(settings: Settings, cores: int | None = None) -> int:
    """``FLEETCACHE_WARMUP_PROCESSES``: reader processes of one warm-up job. ``auto``: one
    per two usable cores (``proxy.cores``), at most 8. A shard is one interpreter reading,
    validating, rendering and tokenizing its rows, bound by its GIL (~150 us of CPU a
    feature on the H200 machine): on its 12 server cores 6 shards warmed 24-30k features/s
    where 3 warmed 19k, and cached lookups beside the job kept their p99 (docs/BENCHMARKS.md,
    2026-12-03). The job runs 10 below its worker's priority: the workers keep their cores."""
    if settings.warmup_processes != "auto":
        return int(settings.warmup_processes)
    return max(1, min(8, (cores or usable_cores()) // 2))


async def run_shard(
    spec: ChildSpec,
    options: JobOptions,
    shard: Shard,
    progress: WarmupProgress,
    on_progress: Callable[[WarmupProgress], None],
    stopped: Callable[[], bool],
) -> WarmupProgress:
    """One shard of a job: a client of the engine and the index, its own checkpoint."""
    from proxy.services import open_worker_services
    from proxy.warmup import LocalSink, run_warmup

    # No memory tier: a reader never looks its own vectors up again, and its LRU (up to
    # FLEETCACHE_MEMORY_CACHE_MB a reader) held every vector and link it wrote, unread.
    settings = spec.load_settings().model_copy(update={"memory_cache_mb": 0.0})
    path, cancel_file = Path(options.path), Path(options.cancel_file)
    async with open_worker_services(settings, spec.cluster("job")) as services:
        silent = await services.wait_answering(120.0)
        if silent:
            raise RuntimeError(f"the {' and the '.join(silent)} process is not answering")
        traffic = DispatchTraffic(services.boards)
        with _rejects_part(options, shard) as rejects, frozen_heap(READER_GC_THRESHOLDS):
            return await run_warmup(
                path,
                LocalSink(
                    services,
                    min(JOB_SLICE, settings.max_queue),
                    dispatch_lookups=traffic.lookups,
                    max_lag_s=None,
                ),
                progress,
                chunk_size=options.chunk_size * shard.count,  # ~chunk_size of its own rows
                depth=settings.warmup_depth,
                checkpoint=checkpoint_for(settings.data_dir, path, shard, options.upload),
                rejects=rejects,
                checkpoint_every_s=options.checkpoint_every_s,
                on_progress=on_progress,
                cancelled=lambda: stopped() or cancel_file.exists(),
                shard=shard,
                max_rejects=settings.max_rejects,  # merged: the first of them, to the cap
            )


def import_shard_code() -> None:
    """What a shard runs, imported once by the job process: forked, a shard starts in
    milliseconds, where a spawned one imported all of it again (2-3 s of a 6 s job on the
    H200)."""
    importlib.import_module("proxy.services")


class ProgressDue:
    """Whether a job's progress is to be passed on now: ``forced`` (its last), every
    ``every_s``, and at once when its first rows are indexed (a job's start is timed there)."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._last, self._rows_shown = float("-inf"), False

    def __call__(self, progress: WarmupProgress, forced: bool = False) -> bool:
        first_rows = progress.indexed > 0 and not self._rows_shown
        if not (forced or first_rows or self.clock() - self._last >= self.every_s):
            return False
        self._last, self._rows_shown = self.clock(), progress.indexed > 0
        return True


def shard_main(spec: ChildSpec, options: JobOptions, shard: Shard, reports: Any) -> None:
    """A shard in a process of its own: its progress goes to ``reports`` (a queue)."""
    from proxy.processes import become_child

    # Forked from the job process's event loop: a signal must not reach that loop through
    # the socket both now hold, and SIGTERM stops this one until its own loop handles it.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    become_child("job", spec.log_level)
    progress = WarmupProgress(source=options.path)
    due = ProgressDue(PROGRESS_EVERY_S / 2)

    def report(p: WarmupProgress, final: bool = False) -> None:
        if due(p, final):
            reports.put((shard.index, asdict(p), final))

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await run_shard(spec, options, shard, progress, report, stop.is_set)

    try:
        asyncio.run(run())
    except Exception as exc:
        log.exception("warm-up shard %d failed", shard.index)
        progress.state, progress.error = "failed", public_error(exc)
    finally:
        progress.finished = progress.finished or time.time()
        report(progress, final=True)


def combined(parts: list[WarmupProgress], into: WarmupProgress) -> WarmupProgress:
    """The job's progress from its shards': every shard reads every row (``rows``: the
    slowest); what each did with its own rows adds up. Running while any shard runs (a job
    read ``failed`` while its other shards ran on: the next POST settled their files under
    them, and took their source for free); then failed if one failed, cancelled if one
    stopped, else done."""
    into.rows = min(p.rows for p in parts)
    into.resumed_from = min(p.resumed_from for p in parts)
    for name in ("indexed", "embedded", "cached", "rejected"):
        setattr(into, name, sum(getattr(p, name) for p in parts))
    states = {p.state for p in parts}
    failed = [p for p in parts if p.state == "failed"]
    if states & set(LIVE):
        into.state = "running"
    elif failed:
        into.state, into.error = "failed", failed[0].error
    elif "cancelled" in states:
        into.state = "cancelled"
    else:
        into.state = "done"
    if into.state != "running":
        into.finished = max((p.finished or time.time()) for p in parts)
    return into


async def run_sharded(
    spec: ChildSpec,
    options: JobOptions,
    progress: WarmupProgress,
    shards: int,
    on_progress: Callable[[WarmupProgress], None] = lambda p: None,
    stopped: Callable[[], bool] = lambda: False,
    start_method: str = "spawn",
    merge_stopped: bool = True,
) -> WarmupProgress:
    """A warm-up job over ``shards`` reader processes (one: in this process), their progress
    combined into ``progress``; their rejects merged into ``options.rejects`` at the end.
    ``start_method``: how the shards start ("fork" only from a process running no thread).
    ``merge_stopped=False``: a job stopped with its place kept leaves its readers' rejects
    where they are, for the run that resumes it (``fleetcache warmup FILE`` run again: the
    same files) to cut back to its checkpoint; a server's resumed job is another job, with
    a rejects file of its own."""
    progress.state, progress.started = "running", time.time()  # rates from the first row
    try:
        if shards == 1:
            await run_shard(spec, options, Shard(0, 1), progress, on_progress, stopped)
            return progress
        return await _start_shards(
            spec, options, progress, shards, on_progress, stopped, start_method
        )
    finally:
        if merge_stopped or progress.state in ("done", "failed"):
            settings = spec.load_settings()
            parts = [rejects_part(options.rejects, i) for i in range(shards)]
            if progress.state != "done":  # the job that resumes it lists the rest again
                places = checkpoint_files(settings.data_dir, Path(options.path), options.upload)
                _cut_to_places(parts, places)
            _merge_rejects(Path(options.rejects), parts, settings.max_rejects)


async def _start_shards(
    spec: ChildSpec,
    options: JobOptions,
    progress: WarmupProgress,
    shards: int,
    on_progress: Callable[[WarmupProgress], None],
    stopped: Callable[[], bool],
    start_method: str,
) -> WarmupProgress:
    ctx: Any = multiprocessing.get_context(start_method)  # its Process (stubs: per literal)
    reports = ctx.Queue()
    parts = [WarmupProgress(source=progress.source, state="queued") for _ in range(shards)]
    finals: set[int] = set()
    processes = [
        ctx.Process(
            target=shard_main, args=(spec, options, Shard(i, shards), reports), name=f"shard{i}"
        )
        for i in range(shards)
    ]
    # Forked, a shard inherits this process's heap, imports and all. Frozen here, its own
    # ``frozen_heap`` collects none of it: each reader walked it again at its start (84-101
    # ms on the 2-core box, 60-140 ms on the H200) and wrote to every page it touched.
    with frozen_heap() if start_method == "fork" else contextlib.nullcontext():
        for process in processes:
            process.start()
    try:
        while len(finals) < shards:
            # stopped, or a shard failed: the others keep their place and stop (they ran on
            # to their end, the job failed once they were done)
            if stopped() or any(parts[i].state == "failed" for i in finals):
                for process in processes:
                    if process.pid and process.exitcode is None:
                        os.kill(process.pid, signal.SIGTERM)
            try:
                index, state, final = await asyncio.to_thread(reports.get, True, 0.25)
            except queue.Empty:
                dead = [i for i, p in enumerate(processes) if p.exitcode not in (None, 0)]
                dead = [i for i in dead if i not in finals]  # killed before it could say
                for i in dead:
                    parts[i].state, parts[i].error = "failed", f"shard {i} died"
                    finals.add(i)
                if dead:
                    on_progress(combined(parts, progress))
                continue
            parts[index] = WarmupProgress(**state)
            if final:
                finals.add(index)
            on_progress(combined(parts, progress))
    finally:
        for process in processes:  # stopped early (Ctrl-C): they keep their checkpoints
            if process.exitcode is None and process.pid and len(finals) < shards:
                os.kill(process.pid, signal.SIGTERM)
        for process in processes:
            process.join(10)
            if process.exitcode is None:
                process.kill()
                process.join(5)
    return combined(parts, progress)


def _rejects_part(options: JobOptions, shard: Shard) -> IO[str]:
    """Opened to append: ``run_warmup`` cuts it back to what its checkpoint kept (nothing on a
    first run)."""
    return rejects_part(options.rejects, shard.index).open("a")


def _cut_to_places(parts: list[Path], places: list[Path]) -> None:
    """Each reader's rejects part (of ``parts``, those there) cut back to its size at the
    place its checkpoint kept (``places``; none kept: nothing, that reader's rows are read
    again), so that the job that resumes from those places lists each rejected row once
    with this one. A reader that stopped cut its own already; one that failed, or died, did
    not; one that finished cleared its checkpoint, and its rows are read again."""
    kept: dict[str, int] = {}  # part -> its size at its checkpoint
    for place in places:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            saved = json.loads(place.read_text())["rejects"]
            kept[saved["path"]] = int(saved["bytes"])
    for part in parts:
        with contextlib.suppress(FileNotFoundError):  # that reader rejected nothing
            os.truncate(part, min(kept.get(str(part.resolve()), 0), part.stat().st_size))


def _merge_rejects(rejects: Path, parts: list[Path], cap: int) -> None:
    """The readers' rejects (``parts``, those there) appended to ``rejects`` in the file's
    line order, the first ``cap`` of them, as one reader lists them (each reader lists its
    own in order, up to ``cap``). A line a killed reader left half-written is dropped."""
    parts = [part for part in parts if part.exists()]
    with rejects.open("a") as out, contextlib.ExitStack() as opened:
        readers = [_rejected(opened.enter_context(part.open())) for part in parts]
        out.writelines(line for _, line in itertools.islice(heapq.merge(*readers), cap))
    for part in parts:
        part.unlink()


def _rejected(lines: IO[str]) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of each whole line of a reader's rejects."""
    for line in lines:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if line.endswith("\n"):
                yield int(json.loads(line)["line"]), line


class ServerWatch:
    """Whether the server a job belongs to is gone: its supervisor no longer holds its
    board's lock (kill -9; a stopping server SIGTERMs its jobs itself). A job outlives a
    worker and the job starter on purpose, not its server: left running, it waited out its
    engine calls for minutes, then wrote its own error over the "server restarted" a new
    server showed, beside the job that resumed it. Checked at most every ``every_s``; a job
    with no supervisor when it started (none to watch) is never told so."""

    def __init__(self, run_dir: Path, every_s: float = 1.0) -> None:
        boards = sorted((run_dir / "boards").glob("supervisor-*.board"))
        self.watched = [path for path in boards if owner_alive(path)]
        self.every_s = every_s
        self._checked, self._gone = time.monotonic(), False

    def gone(self) -> bool:
        if self.watched and not self._gone and time.monotonic() - self._checked >= self.every_s:
            self._gone = not any(owner_alive(path) for path in self.watched)
            self._checked = time.monotonic()
        return self._gone


async def run_job(run_dir: Path, job_id: str) -> None:
    """The job process of a server's warm-up job (its state file is its answer)."""
    spec = ChildSpec(**json.loads((run_dir / SPEC_FILE).read_text()))
    # every CPU of the server, whoever started it: its starter (so there already) or a
    # worker (on the workers' CPUs); its readers, forked below, are counted and run there
    pin_threads(spec.cpus.everything())
    settings = spec.load_settings()
    directory = jobs_dir(settings)
    state_file, cancel_file = directory / f"{job_id}.json", directory / f"{job_id}.cancel"
    with (directory / START_LOCK).open("a") as lock:
        # the worker that starts it holds this until it has written the job's pid, or given
        # it up (its starter silent): neither write is lost to this one, nor the reverse
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = {**json.loads(state_file.read_text()), "pid": os.getpid()}
        if state["state"] not in LIVE:  # given up: the POST said so, and another may run
            return
        # held by this process and every reader it forks (one open file), while any of them
        # lives: a job killed outright is live until its readers have stopped (``_judged``)
        life = life_lock(directory, job_id).open("a")
        fcntl.flock(life, fcntl.LOCK_EX)
        _write_json(state_file, state)
    progress = WarmupProgress(source=state["source"])  # as the worker showed it
    due = ProgressDue(PROGRESS_EVERY_S)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    def save(force: bool = False) -> None:
        if due(progress, force):
            _write_json(state_file, {**state, **asdict(progress)})

    path = Path(state["path"])
    options = JobOptions(
        path=str(path),
        chunk_size=int(state["chunk_size"]),
        checkpoint_every_s=CHECKPOINT_EVERY_S,
        rejects=str(directory.parent / f"{job_id}.rejects.jsonl"),
        cancel_file=str(cancel_file),
        upload=state.get("upload"),
    )
    import_shard_code()
    server = ServerWatch(run_dir)
    try:
        save(force=True)
        await run_sharded(
            spec,
            options,
            progress,
            shard_count(settings),
            lambda p: save(),
            lambda: stop.is_set() or server.gone(),
            start_method="fork",
        )
        if progress.state == "cancelled" and server.gone():
            progress.state, progress.error = "failed", "server restarted"  # as a new one says
        elif progress.state == "cancelled" and stop.is_set():
            progress.state, progress.error = "failed", "server stopped (resumable)"
    except Exception as exc:
        log.exception("warm-up job %s failed", job_id)
        progress.state, progress.error = "failed", public_error(exc)
        progress.finished = time.time()
    finally:
        save(force=True)
        _clean_up(cancel_file, path if state.get("upload") else None, life_lock(directory, job_id))
        life.close()


def _clean_up(*paths: Path | None) -> None:
    for path in paths:
        if path is not None:
            path.unlink(missing_ok=True)


def starter_main(spec: ChildSpec) -> None:
    """The server's job starter (a child of the supervisor, started with ``NO_THREADS`` in
    its environment): everything a job runs imported once, its heap frozen, then one job
    forked per job id a worker sends to ``<run dir>/job-starter.sock``, its pid sent back.
    It runs no thread and no event loop, so that a fork of it is safe; its jobs reap
    themselves (``SIGCHLD`` ignored) and outlive it, in sessions of their own, as those of
    ``python -m proxy.jobs`` do."""
    from engines.batcher import name_thread
    from proxy.processes import become_child

    # every CPU of the server, the engine's own too (CpuPlan): its jobs, born below the
    # workers' and the engine's priority, take what the others leave
    become_child("job", "warning")
    name_thread(STARTER_NAME)  # its main thread: the process, as ``ps`` and its forks show it
    lower_priority(os.getpid())  # its jobs are born below the workers
    import_shard_code()
    run_dir = Path(spec.run_dir)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    (run_dir / STARTER_SOCKET).unlink(missing_ok=True)  # a previous starter's
    listener.bind(str(run_dir / STARTER_SOCKET))
    listener.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    gc.collect()
    gc.freeze()  # a job's collections leave the imports alone, and their pages shared
    while True:
        connection, _ = listener.accept()
        with connection:
            connection.settimeout(STARTER_REPLY_S)
            with contextlib.suppress(OSError):
                job_id = connection.recv(64).decode(errors="replace").strip()
                pid = -1
                with contextlib.suppress(OSError):  # no memory, no process left
                    if job_id.replace("-", "").isalnum():
                        pid = os.fork()
                if pid == 0:
                    listener.close()
                    connection.close()
                    _forked_job(run_dir, job_id)
                connection.sendall(f"{max(pid, 0)}\n".encode())  # 0: the worker starts it


def _forked_job(run_dir: Path, job_id: str) -> None:
    """A job forked by the starter; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # a group of its own, the server's session (``lower_priority``)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # it waits for its own shards
        asyncio.run(run_job(run_dir, job_id))
        code = 0
    except BaseException:
        log.exception("warm-up job %s failed to run", job_id)
    finally:
        logging.shutdown()
        os._exit(code)


def main() -> None:
    from proxy.processes import setup_logging

    run_dir, job_id = Path(sys.argv[1]), sys.argv[2]
    setup_logging("warning", "job")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(run_job(run_dir, job_id))


if __name__ == "__main__":
    main()
