"""Warm-up jobs: stream a file of DriverRecords into the cache and the fleet index.

One loop serves the CLI (direct on the data dir, or through a proxy with ``--url``) and the
``/v1/warmup`` API. The file is read in chunks (constant memory); invalid rows are skipped
and written to a rejects file with their line and reason; every chunk goes to a ``Sink``
(the local services, or ``PUT /v1/fleet/drivers`` on a proxy) as caller ``warmup``, which
rides the batcher's low-priority lane.

Resuming: after a chunk is durable (cache written, index snapshotted or upserted on the
proxy) the job records how many rows of the file it has finished in a checkpoint file keyed
by the file's path, size and mtime. A rerun after Ctrl-C or kill -9 skips those rows; rows
after the last checkpoint are read again, and their texts are cache hits, so nothing is
embedded twice.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import httpx

from features.models import DriverRecord
from features.readers import Row, iter_rows
from features.text import driver_text
from proxy.services import Services

log = logging.getLogger("fleetcache.warmup")


class Sink(Protocol):
    async def upsert(self, records: list[DriverRecord]) -> tuple[int, int, int]:
        """Index the records; return (indexed, embedded, cached)."""
        ...

    async def commit(self) -> None:
        """Make everything upserted so far durable before the checkpoint moves."""
        ...


@dataclass
class WarmupProgress:
    """What a job has done so far; ``/v1/warmup/{id}`` and the progress bar show it."""

    source: str
    state: str = "running"  # running | done | cancelled | failed
    rows: int = 0  # rows read from the file, valid or not (skipped resumed rows included)
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
    """``{"source", "size", "mtime_ns", "rows"}`` in a small JSON file, replaced atomically."""

    def __init__(self, file: Path, source: Path) -> None:
        stat = source.stat()
        self.file = file
        self.key = {
            "source": str(source.resolve()),
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }

    def rows_done(self) -> int:
        try:
            saved = json.loads(self.file.read_text())
        except (OSError, ValueError):
            return 0
        same = all(saved.get(k) == v for k, v in self.key.items())
        return int(saved.get("rows", 0)) if same else 0

    def save(self, rows: int) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp")
        with tmp.open("w") as out:
            json.dump({**self.key, "rows": rows}, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, self.file)

    def clear(self) -> None:
        self.file.unlink(missing_ok=True)


def checkpoint_for(data_dir: Path, source: Path) -> Checkpoint:
    return Checkpoint(data_dir / "warmup" / f"{source.name}.checkpoint.json", source)


def read_chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    while chunk := list(itertools.islice(rows, size)):
        yield chunk


async def run_warmup(
    path: Path,
    sink: Sink | None,
    progress: WarmupProgress,
    *,
    chunk_size: int = 500,
    checkpoint: Checkpoint | None = None,
    rejects: IO[str] | None = None,
    commit_every_s: float = 5.0,
    on_progress: Callable[[WarmupProgress], None] | None = None,
    cancelled: Callable[[], bool] = lambda: False,
) -> WarmupProgress:
    """Run one job to its end (``sink=None`` is a dry run: validate and count only)."""
    skip = checkpoint.rows_done() if checkpoint else 0
    progress.resumed_from = skip
    rows = iter_rows(path)
    chunks = read_chunks(rows, chunk_size)
    last_commit = time.monotonic()

    async def next_chunk() -> list[Row] | None:  # file reading stays off the event loop
        return await asyncio.to_thread(next, chunks, None)

    stopped = False
    try:
        while (chunk := await next_chunk()) is not None:
            if stopped := cancelled():
                break
            fresh = chunk[max(0, skip - progress.rows) :]
            progress.rows += len(chunk)
            records = [row.record for row in fresh if row.record is not None]
            for row in fresh:
                if row.record is None:
                    progress.rejected += 1
                    if rejects is not None:
                        rejects.write(json.dumps({"line": row.line, "error": row.error}) + "\n")
            if records and sink is not None:
                indexed, embedded, cached = await sink.upsert(records)
                progress.indexed += indexed
                progress.embedded += embedded
                progress.cached += cached
            elif sink is None:
                progress.indexed += len(records)
            if sink is not None and checkpoint and time.monotonic() - last_commit > commit_every_s:
                await sink.commit()
                checkpoint.save(progress.rows)
                last_commit = time.monotonic()
            if on_progress:
                on_progress(progress)
        if sink is not None:
            await sink.commit()
        if checkpoint and sink is not None:  # the state changes only once the place is kept
            checkpoint.save(progress.rows) if stopped else checkpoint.clear()
        progress.state = "cancelled" if stopped else "done"
    except asyncio.CancelledError:
        progress.state = "cancelled"
        raise
    except Exception as exc:
        progress.state, progress.error = "failed", str(exc)
        raise
    finally:
        progress.finished = time.time()
        if rejects is not None:
            rejects.flush()
    return progress


class LocalSink:
    """Straight into this process's services (the CLI's direct mode and the API's jobs)."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def upsert(self, records: list[DriverRecord]) -> tuple[int, int, int]:
        n, result = await self.services.upsert_drivers(records, "warmup")
        return n, result.misses, result.not_sent

    async def commit(self) -> None:
        await asyncio.to_thread(self.services.snapshot)


class RemoteSink:
    """Through a running proxy: ``PUT /v1/fleet/drivers`` as caller ``warmup``."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def upsert(self, records: list[DriverRecord]) -> tuple[int, int, int]:
        body = {"drivers": [r.model_dump(mode="json") for r in records]}
        response = await self.client.put("/v1/fleet/drivers", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"the proxy answered {response.status_code}: {response.text}")
        embedded, cached = (int(response.headers[h]) for h in ("X-Cache-Misses", "X-Cache-Hits"))
        return response.json()["upserted"], embedded, cached

    async def commit(self) -> None:
        """Each PUT is applied when it answers; the proxy snapshots its own index."""


@dataclass
class _Job:
    progress: WarmupProgress
    task: asyncio.Task[WarmupProgress] | None = None
    cancel_requested: bool = False


class WarmupJobs:
    """The server's warm-up jobs (``/v1/warmup``): each runs as a task on the event loop."""

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._ids = itertools.count(1)

    def start(self, services: Services, path: Path, *, chunk_size: int = 500) -> str:
        job_id = f"w{next(self._ids)}-{int(time.time())}"
        job = _Job(WarmupProgress(source=str(path)))
        rejects_file = services.settings.data_dir / "warmup" / f"{job_id}.rejects.jsonl"
        rejects_file.parent.mkdir(parents=True, exist_ok=True)

        async def run() -> WarmupProgress:
            with rejects_file.open("w") as rejects:
                return await run_warmup(
                    path,
                    LocalSink(services),
                    job.progress,
                    chunk_size=chunk_size,
                    checkpoint=checkpoint_for(services.settings.data_dir, path),
                    rejects=rejects,
                    cancelled=lambda: job.cancel_requested,
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
        """Stop at the next chunk; the checkpoint keeps the place for a later run."""
        job = self._jobs.get(job_id)
        if job is not None:
            job.cancel_requested = True
        return job.progress if job else None

    async def aclose(self) -> None:
        for job in self._jobs.values():
            job.cancel_requested = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)


def _log_failure(task: asyncio.Task[WarmupProgress]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("warm-up job %s failed: %s", task.get_name(), task.exception())


async def coverage(services: Services, driver_ids: list[str]) -> dict[str, Any]:
    """The share of a roster whose current features are already cached (nothing counted).

    A driver the index does not know has no current features here, so it is not covered.
    """
    ids = list(dict.fromkeys(driver_ids))
    records = [services.index.get_driver(i) for i in ids]
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
    services.last_coverage = result
    return result
