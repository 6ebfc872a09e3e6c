"""Warm-up jobs: stream a file of DriverRecords into the cache and the fleet index.

One loop serves the CLI (direct on the data dir, or through a proxy with ``--url``) and the
``/v1/warmup`` API. The file is read in chunks (constant memory); invalid rows are skipped
and written to a rejects file with their line and reason; every chunk goes to a ``Sink``
(the local services, or ``PUT /v1/fleet/drivers`` on a proxy) as caller ``warmup``, which
rides the batcher's low-priority lane.

Resuming: the job records how many rows of the file it has finished in a checkpoint file
keyed by the file's path, size and mtime (an uploaded body: by its SHA-256, so that the same
body POSTed again resumes), every ``checkpoint_every_s``, past chunks that are
durable: a chunk is done when every call of it returned, and a call returns once its vectors
and entity links are written to the cache store and its fleet change is in the index's change
log, flushed (API.md "Durability"; through a proxy: once it answered 200). The cache's writes
are as durable as its store makes them (LMDB: an fsync a commit by default); a store that
fails is counted and absorbed, and those texts are computed again when next asked. A rerun
after Ctrl-C or kill -9 skips those rows; rows after the last checkpoint are read again, and
their texts are cache hits, so nothing is embedded twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import glob
import hashlib
import itertools
import json
import logging
import os
import re
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import httpx

from engines.base import EngineUnavailableError, QueueFullError
from features.models import DriverRecord
from features.readers import Keep, KeepRaw, Row, iter_rows
from features.text import driver_text
from indexes.snapshot import replace_durably
from proxy.public import public_error
from proxy.services import Services

log = logging.getLogger("fleetcache.warmup")
# A checkpoint is a small file written with an fsync; each costs a job nothing else (until
# 2026-12-03 it also snapshotted the fleet index: 1.9-2.3 s for 200,000 drivers on the
# 2-core box, once per reader at a job's end).
CHECKPOINT_EVERY_S = 5.0
# How often a job waiting for its oldest chunk asks whether it was cancelled. It used to
# finish every chunk in flight first: a stopping server gives its jobs 10 s, and 12 chunks of
# 500 rows (a reader's default) at an engine's 200 rows a second (a test's slow fake one)
# took ~20 s, so the job was killed before it kept its place (tests/test_processes.py).
STOP_POLL_S = 0.1


# a JSONL line's "driver_id" with a string value (used where the line holds no backslash)
_ID_KEY = b'"driver_id"'
_RAW_ID = re.compile(rb'"driver_id"[ \t\r\n]*:[ \t\r\n]*"([^"]*)"')
_EDGE = frozenset(bytes([c]) for c in range(0x21, 0x7F))  # an id's first and last byte


class Sink(Protocol):
    async def upsert(self, records: list[DriverRecord]) -> tuple[int, int, int]:
        """Index the records, durably (see the module docstring); return (indexed,
        embedded, cached)."""
        ...


LIVE = ("queued", "running")  # a job's states before it ends


@dataclass
class WarmupProgress:
    """What a job has done so far; ``/v1/warmup/{id}`` and the progress bar show it."""

    source: str
    state: str = "running"  # running | done | cancelled | failed (a server's job: queued first)
    # rows read from the file, valid or not (skipped resumed rows included); once cancelled,
    # those it finished: where it resumes (its chunks still in flight were abandoned)
    rows: int = 0
    resumed_from: int = 0  # rows skipped because an earlier run finished them
    indexed: int = 0
    embedded: int = 0  # texts sent to the engine
    cached: int = 0  # texts found in the cache (or coalesced)
    rejected: int = 0
    dry_run: bool = False
    error: str | None = None
    started: float = field(default_factory=time.time)
    finished: float | None = None

    @property
    def rate(self) -> float:
        elapsed = (self.finished or time.time()) - self.started
        return (self.rows - self.resumed_from) / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows_per_s": self.rate}


class Checkpoint:
    """``{"source", "size", "mtime_ns", "rows"}`` in a small JSON file, replaced atomically;
    with ``"rejects"``, the run's rejects file (``path``) and its size at ``rows``
    (``bytes``): a resumed run cuts that file back there, so that a row rejected before the
    checkpoint is listed once, even after a kill -9.

    ``sha256``: the source is an uploaded body of that digest, stored under a name of its
    own each time it is sent; the checkpoint follows its bytes (``{"source": "sha256:..."``,
    ``"size"}``), not its file, so the same body sent again resumes where the last left."""

    def __init__(self, file: Path, source: Path, sha256: str | None = None) -> None:
        stat = source.stat()
        self.file = file
        self.key: dict[str, Any] = (
            {"source": f"sha256:{sha256}", "size": stat.st_size}
            if sha256
            else {
                "source": str(source.resolve()),
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
            }
        )

    def _saved(self) -> dict[str, Any]:
        """The saved checkpoint where it is this source's (empty: none, or another file)."""
        try:
            saved = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return {}
        mine = isinstance(saved, dict) and all(saved.get(k) == v for k, v in self.key.items())
        return saved if mine else {}

    def rows_done(self) -> int:
        return int(self._saved().get("rows", 0))

    def save(self, rows: int, rejects: IO[str] | None = None, rejects_at: int = 0) -> None:
        """``rows`` done; ``rejects`` (this run's file, written to its disk first) held
        ``rejects_at`` bytes for them."""
        data: dict[str, Any] = {**self.key, "rows": rows}
        if rejects is not None and (name := _file_name(rejects)) is not None:
            rejects.flush()
            os.fsync(rejects.fileno())
            data["rejects"] = {"path": name, "bytes": rejects_at}
        self.file.parent.mkdir(parents=True, exist_ok=True)
        replace_durably(self.file, json.dumps(data).encode())

    def rejects_kept(self, rejects: IO[str]) -> int:
        """Where a run resumed from this checkpoint cuts ``rejects`` back to: its size at the
        checkpoint where the checkpoint names this file; else its size now (another job's
        file: nothing of it to cut)."""
        size = os.fstat(rejects.fileno()).st_size
        saved = self._saved().get("rejects") or {}
        if saved.get("path") != _file_name(rejects):
            return size
        return min(size, int(saved.get("bytes", size)))

    def clear(self) -> None:
        self.file.unlink(missing_ok=True)


@dataclass(frozen=True)
class Shard:
    """One of ``count`` readers of one file, keeping the rows whose driver id hashes to
    ``index`` (a row without one: its line number). All the rows of one driver go to one
    shard, in file order, so the file's later row still wins. Each shard reads the whole file
    and validates only its own rows."""

    index: int
    count: int

    def keeps(self, line: int, data: Any) -> bool:
        """By the id as validation makes it (stripped: " D1" is driver D1)."""
        driver_id = data.get("driver_id") if isinstance(data, dict) else None
        key = zlib.crc32(str(driver_id).strip().encode()) if driver_id is not None else line
        return key % self.count == self.index

    def keeps_raw(self, line: int, raw: bytes) -> bool | None:
        """``keeps`` from a JSONL line's bytes, without parsing it, when they hold one
        ``"driver_id"`` with a string value and no backslash (no escape anywhere: the id's
        bytes between the quotes are its UTF-8, as ``keeps`` hashes them, and no other key
        can spell ``driver_id``), the id beginning and ending with a printable ASCII
        character (nothing for ``keeps`` to strip); else None (parsed, then ``keeps``). Every
        reader decides a line alike, so each line, valid or not, is one reader's. Fleet
        files' lines all take this way: a reader parses only its own (about 1/N of them)."""
        at = raw.find(_ID_KEY)  # find, not in or count: the fastest of the three on these lines
        if at < 0 or raw.find(_ID_KEY, at + len(_ID_KEY)) >= 0 or raw.find(b"\\") >= 0:
            return None
        found = _RAW_ID.match(raw, at)
        driver_id = found.group(1) if found is not None else b""
        if not (driver_id[:1] in _EDGE and driver_id[-1:] in _EDGE):
            return None
        return zlib.crc32(driver_id) % self.count == self.index

    @property
    def suffix(self) -> str:
        return f".shard{self.index}of{self.count}" if self.count > 1 else ""


def checkpoint_for(
    data_dir: Path, source: Path, shard: Shard | None = None, sha256: str | None = None
) -> Checkpoint:
    """The checkpoint of ``source`` (one per shard: each keeps its own place), named by the
    file's name and a tag of its whole path (two files of one name in two directories had
    one checkpoint file, each clearing the other's place); of an uploaded body of digest
    ``sha256``, named by it (``Checkpoint``)."""
    suffix = shard.suffix if shard is not None else ""
    file = data_dir / "warmup" / f"{checkpoint_stem(source, sha256)}{suffix}.checkpoint.json"
    return Checkpoint(file, source, sha256)


def checkpoint_stem(source: Path, sha256: str | None = None) -> str:
    """What every checkpoint file of ``source`` (any shard count) begins with."""
    if sha256:
        return f"sha256-{sha256[:32]}"
    tag = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:8]
    return f"{source.name}.{tag}"


def checkpoint_files(data_dir: Path, source: Path, sha256: str | None = None) -> list[Path]:
    """Every checkpoint file of ``source`` (any shard count) in ``data_dir``; its name may
    hold glob's own characters (``fleet[2026].jsonl``: a pattern of it found none)."""
    stem = glob.escape(checkpoint_stem(source, sha256))
    return sorted((data_dir / "warmup").glob(f"{stem}*.checkpoint.json"))


def rejects_part(rejects: str | Path, index: int) -> Path:
    """Reader ``index``'s part of a job's rejects file (``<rejects>.part<index>``)."""
    return Path(f"{rejects}.part{index}")


def rejects_parts(rejects: Path) -> list[Path]:
    """The readers' parts of a rejects file (``rejects_part``) that are there."""
    return sorted(rejects.parent.glob(f"{glob.escape(rejects.name)}.part*"))


def _file_name(out: IO[str] | None) -> str | None:
    """The resolved path of a file on disk (None for anything else: a StringIO)."""
    name = getattr(out, "name", None)
    return str(Path(name).resolve()) if isinstance(name, str) else None


RAMP = (8, 4, 2)  # a job's first chunks: 1/8, 1/4 and 1/2 of its chunk size, then whole


def read_chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    """``rows`` in chunks of ``size``, the first ones smaller (``RAMP``): the engine gets a
    job's first texts after an eighth of a chunk's reading, validating and rendering, not a
    whole one's (all readers of a job start together, sharing the cores)."""
    sizes = itertools.chain((max(1, size // part) for part in RAMP), itertools.repeat(size))
    while chunk := list(itertools.islice(rows, next(sizes))):
        yield chunk


async def run_warmup(
    path: Path,
    sink: Sink | None,
    progress: WarmupProgress,
    *,
    chunk_size: int = 500,
    depth: int = 3,
    checkpoint: Checkpoint | None = None,
    rejects: IO[str] | None = None,
    checkpoint_every_s: float = CHECKPOINT_EVERY_S,
    on_progress: Callable[[WarmupProgress], None] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
    shard: Shard | None = None,
    max_rejects: int | None = None,
) -> WarmupProgress:
    """Run one job to its end (``sink=None`` is a dry run: validate and count only); with
    ``shard``, only its share of the rows (``rows`` still counts every row read). At most
    ``max_rejects`` invalid rows are written to ``rejects`` (``rejected`` counts them all).

    Pipelined: the next chunk is read and validated in a thread while up to ``depth``
    chunks are in the sink at once (so the engine's batcher always has work queued). The
    checkpoint only moves past chunks that finished together with every chunk before them.
    ``cancelled()`` true: the job stops within ``STOP_POLL_S``, its chunks still in the sink
    abandoned (read again when it resumes), its place kept.
    """
    if depth < 1:
        raise ValueError(f"depth must be at least 1, got {depth}")
    skip = checkpoint.rows_done() if checkpoint else 0
    progress.resumed_from = skip
    written = 0  # bytes in ``rejects``: those of the rows before ``skip``, then this run's
    if checkpoint and sink is not None and rejects is not None and _file_name(rejects):
        written = checkpoint.rejects_kept(rejects) if skip else 0
        rejects.truncate(written)  # rows after the checkpoint are read (and rejected) again
        rejects.seek(0, 2)
    keep: Keep | None = None
    keep_raw: KeepRaw | None = None
    if shard is not None and shard.count > 1:
        keep, keep_raw = shard.keeps, shard.keeps_raw
    chunks = read_chunks(iter_rows(path, keep=keep, keep_raw=keep_raw), chunk_size)
    # (end row, bytes in rejects at its end, its task)
    in_sink: deque[tuple[int, int, asyncio.Task[tuple[int, int, int]]]] = deque()
    done_rows, done_rejects = skip, written  # every row before done_rows is durable
    last_checkpoint = time.monotonic()

    def next_chunk() -> asyncio.Future[list[Row] | None]:  # reading stays off the event loop
        return asyncio.ensure_future(asyncio.to_thread(next, chunks, None))

    async def finish_oldest() -> None:
        nonlocal done_rows, done_rejects, last_checkpoint
        end, at, task = in_sink[0]
        while not task.done():  # cancelled meanwhile: stop now, not after every chunk in flight
            await asyncio.wait([task], timeout=STOP_POLL_S)
            if not task.done() and cancelled():
                raise _Stopped
        in_sink.popleft()
        indexed, embedded, cached = task.result()
        progress.indexed += indexed
        progress.embedded += embedded
        progress.cached += cached
        done_rows, done_rejects = end, at
        if (
            sink is not None
            and checkpoint
            and time.monotonic() - last_checkpoint > checkpoint_every_s
        ):
            # fsyncs: off the loop
            await asyncio.to_thread(checkpoint.save, done_rows, rejects, done_rejects)
            last_checkpoint = time.monotonic()
        if on_progress:
            on_progress(progress)

    stopped = False
    reading = next_chunk()
    try:
        try:
            while (chunk := await reading) is not None:
                if cancelled():
                    raise _Stopped
                reading = next_chunk()
                fresh = chunk[max(0, skip - progress.rows) :]
                progress.rows += len(chunk)
                records = [row.record for row in fresh if row.record is not None]
                written += _reject(fresh, progress, rejects, max_rejects)
                if records and sink is not None:
                    task = asyncio.create_task(sink.upsert(records))
                else:
                    progress.indexed += len(records) if sink is None else 0
                    task = asyncio.create_task(_nothing())
                in_sink.append((progress.rows, written, task))
                while in_sink and (len(in_sink) >= depth or in_sink[0][2].done()):
                    await finish_oldest()
            while in_sink:
                await finish_oldest()
        except _Stopped:
            stopped, progress.rows = True, done_rows  # where it resumes
        if checkpoint and sink is not None:  # the state changes only once the place is kept
            if stopped:
                checkpoint.save(done_rows, rejects, done_rejects)
                if rejects is not None and _file_name(rejects):  # the rows it resumes from
                    rejects.truncate(done_rejects)  # are read, and listed, again
            else:
                checkpoint.clear()
        progress.state = "cancelled" if stopped else "done"
    except asyncio.CancelledError:
        progress.state = "cancelled"
        raise
    except Exception as exc:
        progress.state, progress.error = "failed", public_error(exc)
        raise
    finally:
        reading.cancel()
        await _abandon([task for _, _, task in in_sink])
        progress.finished = time.time()
        if rejects is not None:
            rejects.flush()
    return progress


def _reject(
    rows: list[Row], progress: WarmupProgress, rejects: IO[str] | None, cap: int | None
) -> int:
    """Count the invalid ``rows`` and write them (at most ``cap`` in all); the bytes written."""
    written = 0
    for row in rows:
        if row.error is not None:
            progress.rejected += 1
            if rejects is not None and (cap is None or progress.rejected <= cap):
                line = json.dumps({"line": row.line, "error": row.error}) + "\n"  # ASCII
                written += rejects.write(line)
    return written


class _Stopped(Exception):
    """The job was cancelled: its chunks still in the sink are abandoned (read again when it
    resumes: the checkpoint is only past chunks that finished with all those before them)."""


async def _nothing() -> tuple[int, int, int]:
    """The sink's part of a chunk without valid records (or of a dry run)."""
    return 0, 0, 0


async def _abandon(tasks: list[asyncio.Task[tuple[int, int, int]]]) -> None:
    """Cancel the chunks still in the sink after a failure or a stop, and collect their
    outcome."""
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


class LocalSink:
    """Straight into ``services`` (the CLI's direct mode, the API's jobs: in one process, or
    the job process of a server).

    A chunk goes to the cache in calls of at most ``slice_size`` records ("slices"); their
    texts are rendered in a thread. A driver id already in an unfinished slice waits for
    it, so the file's later row wins (link and index) as it would one chunk at a time.

    Pacing: with no dispatch lookup in the last ``live_s`` seconds every slice of a chunk
    starts at once (full speed). While dispatch traffic is live, a slice starts only when
    fewer than ``paced_slices`` are unfinished (enough to keep one full batch queued at the
    batcher) and the event loop answers a yield within ``max_lag_s`` (waiting for that at most
    ``max_wait_s`` per slice, so that a job still progresses on a loop that is never quiet,
    e.g. a CPU engine keeping every core busy): asyncio's ready queue
    is first come first served, so every warm-up step queued before a dispatch request's
    next step delays it. Measured (fake engine, 2 cores): with ~100 slices in flight a
    yield took 3.5 ms at p50 and 30 ms at p99 during a warm-up, 0.2/0.8 ms idle. A job in its
    own process shares no loop with dispatch (``max_lag_s=None``: no such wait) and learns of
    dispatch traffic from ``dispatch_lookups`` (the whole server's count, from the boards).

    A slice that finds the engine or the index unavailable (their process restarting) or the
    queue full waits and tries again, doubling its wait up to 10 s, for ``give_up_s`` at most.
    """

    def __init__(
        self,
        services: Services,
        slice_size: int = 64,
        *,
        live_s: float = 1.0,
        max_lag_s: float | None = 0.002,
        max_wait_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
        dispatch_lookups: Callable[[], int] | None = None,
        give_up_s: float = 300.0,
    ) -> None:
        self.services = services
        self.give_up_s = give_up_s
        self._dispatch_lookups = dispatch_lookups or (lambda: services.embedder.dispatch_lookups)
        self.slice_size = slice_size
        self.live_s = live_s
        self.max_lag_s = max_lag_s
        self.max_wait_s = max_wait_s
        self.paced_slices = -(-services.settings.max_batch_size // slice_size) + 1
        self.paced = 0  # slices that waited for dispatch traffic (progress, tests)
        self._clock = clock
        self._holder: dict[str, asyncio.Task[tuple[int, int]]] = {}  # driver id -> its slice
        self._slices: set[asyncio.Task[tuple[int, int]]] = set()  # unfinished slices
        self._admit = asyncio.Lock()  # slices start in file order, one chunk after another
        self._slice_done = asyncio.Event()
        self._dispatch_seen: tuple[int, float] | None = None  # (lookups, when they changed)

    async def upsert(self, records: list[DriverRecord]) -> tuple[int, int, int]:
        size, parts = self.slice_size, []
        async with self._admit:
            texts = await asyncio.to_thread(lambda: [driver_text(r) for r in records])
            for i in range(0, len(records), size):
                await self._pace()
                part = records[i : i + size]
                ids = [r.driver_id for r in part]
                before = {task for d in ids if (task := self._holder.get(d)) is not None}
                task = asyncio.create_task(self._upsert(part, texts[i : i + size], before))
                task.add_done_callback(functools.partial(self._release, ids))
                self._holder.update(dict.fromkeys(ids, task))
                self._slices.add(task)
                parts.append(task)
        counts = await asyncio.gather(*parts)
        return len(records), sum(c[0] for c in counts), sum(c[1] for c in counts)

    def dispatch_live(self) -> bool:
        """Whether a lookup by any caller but ``warmup`` happened in the last ``live_s``
        seconds."""
        lookups = self._dispatch_lookups()
        now = self._clock()
        if self._dispatch_seen is None:  # those before the job started tell nothing
            self._dispatch_seen = (lookups, float("-inf"))
        elif lookups != self._dispatch_seen[0]:
            self._dispatch_seen = (lookups, now)
        return now - self._dispatch_seen[1] <= self.live_s

    async def _pace(self) -> None:
        """Wait, while dispatch traffic is live, for room among the slices and a quiet loop."""
        waited, lag_waited = False, 0.0
        while self.dispatch_live():
            if len(self._slices) >= self.paced_slices:
                self._slice_done.clear()
                await self._slice_done.wait()
            elif (
                self.max_lag_s is not None
                and lag_waited < self.max_wait_s
                and await _loop_lag() > self.max_lag_s
            ):
                await asyncio.sleep(self.max_lag_s)
                lag_waited += self.max_lag_s
            else:
                break
            waited = True
        self.paced += waited

    async def _upsert(
        self, records: list[DriverRecord], texts: list[str], before: set[asyncio.Task[Any]]
    ) -> tuple[int, int]:
        if before:
            await asyncio.wait(before)
        backoff, waited = 0.5, 0.0
        while True:
            try:
                _, result = await self.services.upsert_drivers(records, "warmup", texts)
                self.services.publish()  # its tiers' counters, as a worker's after a request
                return result.misses, result.not_sent
            except (EngineUnavailableError, QueueFullError) as exc:
                # the engine or the index process restarting, or a full queue: wait, as
                # ``warmup --url`` does for 503 and 429, rather than fail the whole job
                if waited >= self.give_up_s:
                    raise
                log.warning("warm-up slice waits %.1f s: %s", backoff, exc)
                await asyncio.sleep(backoff)
                waited += backoff
                backoff = min(backoff * 2, 10.0)

    def _release(self, ids: list[str], task: asyncio.Task[tuple[int, int]]) -> None:
        for driver_id in ids:
            if self._holder.get(driver_id) is task:
                del self._holder[driver_id]
        self._slices.discard(task)
        self._slice_done.set()


async def _loop_lag() -> float:
    """Seconds until the event loop comes back to a task that yields: the time every
    callback ready before it takes to run."""
    started = time.perf_counter()
    await asyncio.sleep(0)
    return time.perf_counter() - started


class RemoteSink:
    """Through a running proxy: ``PUT /v1/fleet/drivers`` as caller ``warmup``.

    A busy or restarting server is waited for, not given up on: 429 and 503 are retried after
    their ``Retry-After`` (else a backoff from ``first_wait_s`` doubling to ``max_wait_s``),
    and so is a connection the server dropped or refused (it restarts), until ``give_up_s``
    of waiting in a row. Rows are only counted done once the server answered 200 for them.
    """

    RETRIED = frozenset({429, 502, 503, 504})

    def __init__(
        self,
        client: httpx.AsyncClient,
        *,
        first_wait_s: float = 0.5,
        max_wait_s: float = 10.0,
        give_up_s: float = 300.0,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self.client = client
        self.first_wait_s = first_wait_s
        self.max_wait_s = max_wait_s
        self.give_up_s = give_up_s
        self.retries = 0
        self._sleep = sleep

    async def _put(self, body: dict[str, Any]) -> httpx.Response:
        backoff, waited = self.first_wait_s, 0.0
        while True:
            try:
                response = await self.client.put("/v1/fleet/drivers", json=body)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                why, wait = f"connection failed ({type(exc).__name__})", backoff
            else:
                if response.status_code not in self.RETRIED:
                    return response
                why, wait = f"the proxy answered {response.status_code}", backoff
                retry_after = response.headers.get("Retry-After", "")
                if retry_after.replace(".", "", 1).isdigit():
                    wait = min(float(retry_after), self.max_wait_s)
            if waited + wait > self.give_up_s:
                raise RuntimeError(f"{why}; still failing after {waited:.0f} s of retries")
            self.retries += 1
            await self._sleep(wait)
            waited += wait
            backoff = min(backoff * 2, self.max_wait_s)

    async def upsert(self, records: list[DriverRecord]) -> tuple[int, int, int]:
        body = {"drivers": [r.model_dump(mode="json") for r in records]}
        response = await self._put(body)
        if response.status_code != 200:
            raise RuntimeError(f"the proxy answered {response.status_code}: {response.text}")
        embedded, cached = (int(response.headers[h]) for h in ("X-Cache-Misses", "X-Cache-Hits"))
        return len(records), embedded, cached  # rows, as in-process (a repeated id counts)


class JobRunning(Exception):
    """A job of the same source (the same checkpoint) is queued or running: two at once would
    both write its checkpoint, and each skip rows the other kept."""

    def __init__(self, job_id: str) -> None:
        super().__init__(job_id)
        self.job_id = job_id


@dataclass
class _Job:
    progress: WarmupProgress
    checkpoint: Path
    task: asyncio.Task[WarmupProgress] | None = None
    cancel_requested: bool = False


class WarmupJobs:
    """The server's warm-up jobs (``/v1/warmup``): each runs as a task on the event loop."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._ids = itertools.count(1)

    async def start(
        self, services: Services, path: Path, *, chunk_size: int = 500, upload: str | None = None
    ) -> str:
        """Start a job over ``path`` (an uploaded body of digest ``upload``: removed at the
        end); ``JobRunning`` while a job of the same source runs."""
        checkpoint = checkpoint_for(services.settings.data_dir, path, sha256=upload)
        for job_id, running in self._jobs.items():
            live = running.progress.state in LIVE and not (running.task and running.task.done())
            if running.checkpoint == checkpoint.file and live:  # (done: it failed before a state)
                raise JobRunning(job_id)
        job_id = f"w{next(self._ids)}-{int(time.time())}"
        job = _Job(WarmupProgress(source=shown_source(path, services.settings)), checkpoint.file)
        rejects_file = services.settings.data_dir / "warmup" / f"{job_id}.rejects.jsonl"
        rejects_file.parent.mkdir(parents=True, exist_ok=True)

        async def run() -> WarmupProgress:
            with rejects_file.open("w") as rejects, _removed_after(path if upload else None):
                return await run_warmup(
                    path,
                    LocalSink(services),
                    job.progress,
                    chunk_size=chunk_size,
                    depth=services.settings.warmup_depth,
                    checkpoint=checkpoint,
                    rejects=rejects,
                    cancelled=lambda: job.cancel_requested,
                    max_rejects=services.settings.max_rejects,
                )

        job.task = asyncio.create_task(run(), name=f"warmup-{job_id}")
        job.task.add_done_callback(_log_failure)
        self._jobs[job_id] = job
        return job_id

    def get(self, job_id: str) -> WarmupProgress | None:
        job = self._jobs.get(job_id)
        return job.progress if job else None

    def all(self) -> dict[str, WarmupProgress]:
        return {job_id: job.progress for job_id, job in self._jobs.items()}

    def cancel(self, job_id: str) -> WarmupProgress | None:
        """Stop now (the chunks in flight are abandoned); the checkpoint keeps the place for a
        later run."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.cancel_requested = True
        return job.progress if job else None

    async def aclose(self) -> None:
        for job in self._jobs.values():
            job.cancel_requested = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)


def shown_source(path: Path, settings: Any) -> str:
    """A job's file as its answers show it: relative to the data dir (no server paths)."""
    with contextlib.suppress(ValueError):
        return str(path.resolve().relative_to(settings.data_dir.resolve()))
    return path.name


@contextlib.contextmanager
def _removed_after(path: Path | None) -> Iterator[None]:
    try:
        yield
    finally:
        if path is not None:
            path.unlink(missing_ok=True)


def _log_failure(task: asyncio.Task[WarmupProgress]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("warm-up job %s failed: %s", task.get_name(), task.exception())


async def coverage(services: Services, driver_ids: list[str]) -> dict[str, Any]:
    """The share of a roster whose current features are already cached (nothing counted).

    A driver the index does not know has no current features here, so it is not covered.
    """
    ids = list(dict.fromkeys(driver_ids))
    records = await services.index.get_drivers(ids)
    known = [(i, r) for i, r in zip(ids, records, strict=True) if r is not None]
    cached = await services.embedder.acontains([driver_text(r) for _, r in known])
    missing = [i for i, r in zip(ids, records, strict=True) if r is None]
    missing += [i for (i, _), hit in zip(known, cached, strict=True) if not hit]
    result = {
        "roster": len(ids),
        "known": len(known),
        "cached": sum(cached),
        "share": sum(cached) / len(ids) if ids else 0.0,
        "not_covered": missing[:100],
        "at": time.time(),
    }
    services.save_coverage(result)
    return result
