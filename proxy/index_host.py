"""The fleet index's one owner, and how the workers reach it.

``IndexHost`` owns the ``FleetTable`` (drivers, vectors, positions), its revision, its change
log and its snapshots. Every fleet and dispatch call of every worker reaches this one owner,
so a PATCH through one worker is seen by the next recommend through any other. A server runs
it in its own process (``proxy.processes``) behind an ``RpcServer``; ``create_app`` without
the supervisor runs it in-process. The workers hold an ``IndexService``: the host itself, or
a ``RemoteIndex`` speaking to it over IPC, with the same async methods::

    upsert_drivers(records, vectors)       update_driver(id, position=, status=) -> record
    delete_driver(id) -> bool              get_driver(id) -> record | None
    get_drivers(ids) -> [record | None]    recommend(order, query) -> Recommendation
    count() -> int                         set_ready()      ready, up (properties)

An upsert crosses as ``indexes.Prepared`` (ids, the records' JSON, their column values as raw
array frames), made by the worker that validated the records: the owner parses nothing, which
kept it from bounding warm-ups (23-30 ms of pydantic per 256 records on the 2-core box). Other
records cross as their JSON; vectors and the query as raw float32 frames.

Durability (API.md v1.1): a change is made in the table, numbered, appended to the change log
(``indexes.changelog``) and answered only once the log has it on disk, so the 200 of the
route behind it survives a kill -9. Changes arriving during one fsync share the next. The
table is changed before the flush, on the event loop, so that the table and the log number
and order changes alike; a reader may see a change a moment before it is acknowledged. On
start the table is its last snapshot plus the log replayed after it; a snapshot only shortens
that replay (its segments are then deleted).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import numpy.typing as npt
import orjson
import zmq

from features.models import DriverRecord, Order, Position, Status
from indexes import Candidate, FleetTable, Moved, Prepared, Recommendation, changes, snapshot
from indexes.changelog import ChangeLog, recover
from indexes.changes import Change, Delete, Move, Place, Positions, Update, Upsert
from proxy.board import Board
from proxy.fleet_log import Entry, FleetLog, FleetLogError, FleetLogGap
from proxy.ipc import (
    Blobs,
    Handler,
    NotFoundError,
    RpcClient,
    RpcServer,
    frame_rows,
    rows_frame,
)
from proxy.settings import Settings

log = logging.getLogger("fleetcache.index")
LOG_DIR = "changelog"  # under the index dir, beside the snapshots
Msg = dict[str, Any]
Frames = list[zmq.Frame]
Out = tuple[Msg, Blobs]
FOLLOW_TIMEOUT_S = 5.0  # a published change not applied here by then: 503, retry
RETRY_MIN_S, RETRY_MAX_S = 0.05, 2.0  # the follower's pause after the log failed
MOVE_DTYPES = ("<f8", "<f8", "<i8")  # lats, lngs, ts of a move, as raw frames


class Movement(NamedTuple):
    """What ``PATCH /v1/fleet/positions`` answers (API.md)."""

    updated: int
    stale: int
    unknown: list[str]


class IndexService(Protocol):
    @property
    def ready(self) -> bool: ...

    @property
    def up(self) -> bool: ...

    async def upsert_drivers(
        self, records: Sequence[DriverRecord], vectors: npt.NDArray[np.float32]
    ) -> None: ...

    async def update_driver(
        self, driver_id: str, *, position: Position | None, status: Status | None
    ) -> DriverRecord: ...

    async def move(self, batch: Positions) -> Movement: ...

    async def delete_driver(self, driver_id: str) -> bool: ...

    async def get_driver(self, driver_id: str) -> DriverRecord | None: ...

    async def get_drivers(self, driver_ids: Sequence[str]) -> list[DriverRecord | None]: ...

    async def recommend(self, order: Order, query: npt.NDArray[np.float32]) -> Recommendation: ...

    async def count(self) -> int: ...

    async def set_ready(self) -> None: ...


class IndexHost:
    """The table and what belongs to it: revision, readiness, change log, snapshots. KeyError
    for an unknown driver on update; ``ChangeLogError`` (a 500) for a change once the log
    failed a write."""

    def __init__(
        self,
        settings: Settings,
        table: FleetTable,
        board: Board,
        changelog: ChangeLog,
        fleet_log: FleetLog | None = None,
    ) -> None:
        self.settings = settings
        self.table = table
        self.board = board
        # flushes, records, bytes: what durability costs (also in facts()["log"])
        self.changelog = changelog
        self.fleet_log = fleet_log
        self.revision = 0  # bumped on every change; a snapshot is skipped when unchanged
        self._saved = 0
        self._ready = not settings.demo_drivers  # the demo fleet's loader sets it
        self.up = True
        # shared mode: the requests waiting for their change to come back from the log
        self._waiting: dict[str, asyncio.Future[DriverRecord | Moved | None]] = {}
        self._log_problem: str | None = None  # why the shared log is not followed now
        self._log_broken: str | None = None  # ... for good: it disagrees with the table
        self._published_at = -float("inf")  # when a snapshot was last offered to the log
        # FLEETCACHE_INDEX_DEVICE: recommends waiting for the next batch, batches run
        self._recommends: list[tuple[Order, Any, asyncio.Future[Recommendation]]] = []
        self.recommend_batches = 0
        self._publish()

    @property
    def ready(self) -> bool:
        return self._ready

    def _changed(self, by: int = 1) -> None:
        self.revision += by
        self._publish()

    def _set_problem(self, reason: str | None) -> None:
        self._log_problem = reason
        self._publish()

    def _break_log(self, reason: str) -> None:
        log.error("fleet log: %s; fleet writes are refused until a restart", reason)
        self._log_broken = reason
        self._publish()

    def _publish(self) -> None:
        self.board.gauge("fleet.drivers", len(self.table))
        self.board.gauge("fleet.seq", self.table.seq)
        following = self._log_problem is None and self._log_broken is None
        self.board.gauge("fleet.log_following", following)

    async def upsert_drivers(
        self, records: Sequence[DriverRecord], vectors: npt.NDArray[np.float32]
    ) -> None:
        await self.upsert_prepared(Prepared.of(records), vectors)

    async def upsert_prepared(self, prepared: Prepared, vectors: npt.NDArray[np.float32]) -> None:
        if prepared.ids:
            seq, vocabulary = self.table.seq + 1, self.table.vocabulary
            await self._change(Upsert.of(seq, prepared, vectors, vocabulary))

    async def update_driver(
        self, driver_id: str, *, position: Position | None, status: Status | None
    ) -> DriverRecord:
        if driver_id not in self.table:
            raise KeyError(driver_id)
        place = None if position is None else Place.of(position)
        record = await self._change(Update(self.table.seq + 1, driver_id, place, status))
        if record is None:  # shared log: another replica deleted it first
            raise KeyError(driver_id)
        assert isinstance(record, DriverRecord)
        return record

    async def move(self, batch: Positions) -> Movement:
        moved = await self._change(Move.of(self.table.seq + 1, batch))
        assert isinstance(moved, Moved)
        return Movement(int(moved.applied.sum()), moved.stale, moved.unknown)

    async def delete_driver(self, driver_id: str) -> bool:
        if driver_id not in self.table:
            return False
        await self._change(Delete(self.table.seq + 1, driver_id))
        return True

    async def _change(self, change: Change) -> DriverRecord | Moved | None:
        """Make ``change`` in the table, then wait until the log has it on disk. With a
        shared log: publish it there, then wait until ``follow`` has applied it."""
        if self.fleet_log is not None:
            return await self._publish_change(self.fleet_log, change)
        result = changes.apply(self.table, change)
        self._changed()
        await self.changelog.append(change)
        return result

    async def _publish_change(self, fleet_log: FleetLog, change: Change) -> Any:
        if problem := self._log_broken or self._log_problem:
            raise FleetLogError(problem)
        token = fleet_log.token()
        waiter = self._waiting[token] = asyncio.get_running_loop().create_future()
        try:
            applied = self.table.seq  # the follower may apply it before publish returns
            if await fleet_log.publish(change, token) <= applied:
                self._break_log("the fleet log numbers anew changes this replica applied")
                raise FleetLogError(f"{self._log_broken} (was its Redis emptied?)")
            async with asyncio.timeout(FOLLOW_TIMEOUT_S):
                return await waiter
        except TimeoutError:
            raise FleetLogError(
                "the change is on the fleet log but not yet applied here; retry"
            ) from None
        finally:
            del self._waiting[token]

    async def catch_up(self) -> None:
        """At start: apply what the shared log holds beyond the table (a new replica: all of
        it), so that the replica is ready only once current. Unreachable: start from the
        local state; ``follow`` catches up when the log is back."""
        assert self.fleet_log is not None
        started, first = time.perf_counter(), self.table.seq
        try:
            last = await self.fleet_log.last_seq()
            if last < first:
                self._break_log(
                    f"the fleet log ends at change {last}, before this replica's table "
                    f"(change {first}): start it on an empty data dir, or on its own log"
                )
                return
            while entries := await self.fleet_log.read(self.table.seq, block_ms=None):
                await self.apply_entries(entries)
        except FleetLogGap as exc:
            self._break_log(f"{exc}, and no snapshot published after it")
            return
        except FleetLogError as exc:
            log.error("fleet log: %s; serving the local fleet until it answers", exc)
            return
        log.info(
            "fleet log: %d changes applied in %.2f s (now at change %d)",
            self.table.seq - first,
            time.perf_counter() - started,
            self.table.seq,
        )

    async def follow(self) -> None:
        """Shared mode, for ever: apply the log's changes after the table's last, in order,
        each written to the local change log too (a restart then reads only what is new)."""
        assert self.fleet_log is not None
        pause = RETRY_MIN_S
        while self._log_broken is None:
            try:
                entries = await self.fleet_log.read(self.table.seq)
                await self.apply_entries(entries)
            except FleetLogGap as exc:
                self._break_log(f"{exc}: restart the server to start from the published snapshot")
            except FleetLogError as exc:
                if self._log_problem != str(exc):
                    log.error("fleet log: %s (retrying)", exc)
                self._set_problem(str(exc))
                await asyncio.sleep(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            if self._log_problem is not None:
                log.warning("fleet log: following again after change %d", self.table.seq)
                self._set_problem(None)
            pause = RETRY_MIN_S

    async def apply_entries(self, entries: Sequence[Entry]) -> None:
        done: list[tuple[Entry, Any]] = []
        try:
            for entry in entries:
                done.append((entry, changes.apply(self.table, entry.change, unknown_ok=True)))
        except Exception as exc:  # an entry this version cannot apply: stop before it
            log.exception("fleet log: change %d cannot be applied", entry.change.seq)
            raise FleetLogError(f"change {entry.change.seq} cannot be applied here") from exc
        finally:
            if done:
                self._changed(len(done))
                await self._settle(done)

    async def _settle(self, done: list[tuple[Entry, Any]]) -> None:
        """Write applied entries to the local log (one flush), then answer their writers."""
        appends = [asyncio.ensure_future(self.changelog.append(e.change)) for e, _ in done]
        results = await asyncio.gather(*appends, return_exceptions=True)
        for (entry, result), logged in zip(done, results, strict=True):
            waiter = self._waiting.get(entry.by)
            if waiter is None or waiter.done():
                continue
            if isinstance(logged, BaseException):
                waiter.set_exception(logged)
            else:
                waiter.set_result(result)

    async def get_driver(self, driver_id: str) -> DriverRecord | None:
        return self.table.get_driver(driver_id)

    async def get_drivers(self, driver_ids: Sequence[str]) -> list[DriverRecord | None]:
        return [self.table.get_driver(i) for i in driver_ids]

    async def recommend(self, order: Order, query: npt.NDArray[np.float32]) -> Recommendation:
        """With FLEETCACHE_INDEX_DEVICE the recommends that arrive together (within one turn
        of the event loop) share one first pass there (``FleetTable.recommend_many``)."""
        if self.settings.index_device is None:
            return self.table.recommend(order, query)
        waiter = asyncio.get_running_loop().create_future()
        self._recommends.append((order, query, waiter))
        if len(self._recommends) == 1:
            asyncio.get_running_loop().call_soon(self._recommend_batch)
        return await waiter

    def _recommend_batch(self) -> None:
        batch, self._recommends = self._recommends, []
        self.recommend_batches += 1
        try:
            answers = self.table.recommend_many([o for o, _, _ in batch], [q for _, q, _ in batch])
        except Exception as exc:
            for _, _, waiter in batch:
                if not waiter.done():
                    waiter.set_exception(exc)
            return
        for (_, _, waiter), answer in zip(batch, answers, strict=True):
            if not waiter.done():
                waiter.set_result(answer)

    async def count(self) -> int:
        return len(self.table)

    async def set_ready(self) -> None:
        if not self._ready:
            self._ready = True
            log.info("ready: %d drivers in the fleet index", len(self.table))

    def facts(self) -> dict[str, Any]:
        return {
            "ready": self._ready,
            "drivers": len(self.table),
            "revision": self.revision,
            "log": self.changelog.facts(),
            "seq": self.table.seq,
            "recommend_batches": self.recommend_batches,
            "fleet_log": None
            if self.fleet_log is None
            else {
                "following": self._log_problem is None and self._log_broken is None,
                "problem": self._log_broken or self._log_problem,
            },
        }

    async def snapshot(self) -> None:
        """Save the table when it changed since the last save (off the event loop), then
        delete the log segments it holds: the changes after it go to a fresh segment."""
        if self.revision != self._saved:
            revision = self.revision
            await self.changelog.rotate()
            seq = await asyncio.to_thread(self.table.save, self.settings.index_dir)
            self._saved = revision
            await self.changelog.drop_covered(seq)
            await self._publish_snapshot(seq)

    async def _publish_snapshot(self, seq: int) -> None:
        """Shared mode: offer the snapshot just saved to replicas that start behind the
        stream (``FleetLog.publish_snapshot``), at most every
        FLEETCACHE_FLEET_SNAPSHOT_PUBLISH_S."""
        every_s = self.settings.fleet_snapshot_publish_s
        if self.fleet_log is None or time.monotonic() - self._published_at < every_s:
            return
        live = await asyncio.to_thread(snapshot.live_dir, self.settings.index_dir)
        assert live is not None  # a save just made it
        try:
            if await self.fleet_log.publish_snapshot(live, seq, every_s=every_s):
                log.info("fleet log: published the snapshot of change %d", seq)
            self._published_at = time.monotonic()
        except FleetLogError as exc:
            log.warning("fleet log: snapshot not published (%s); the next one retries", exc)

    async def snapshot_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.snapshot_interval_s)
            try:
                await self.snapshot()
            except Exception:
                log.exception("fleet index snapshot failed; the next one retries")


@contextlib.asynccontextmanager
async def open_index_host(settings: Settings, board: Board, dim: int) -> AsyncIterator[IndexHost]:
    """The table of ``dim``-d vectors loaded from its last snapshot plus the change log after
    it, snapshotted periodically and on the way out."""
    table, changelog, replayed = await _load(settings, dim)
    fleet_log = None if settings.fleet_log_url is None else FleetLog(settings.fleet_log_url)
    if fleet_log is not None and await _fetch_published(fleet_log, settings, table.seq):
        await changelog.close()
        await asyncio.to_thread(_replace_index_dir, settings.index_dir)
        table, changelog, replayed = await _load(settings, dim)
    host = IndexHost(settings, table, board, changelog, fleet_log)
    host.revision = replayed  # the next periodic snapshot holds them
    tasks = [asyncio.create_task(host.snapshot_periodically(), name="index-snapshots")]
    if fleet_log is not None:
        await host.catch_up()
        tasks.append(asyncio.create_task(host.follow(), name="fleet-log"))
    try:
        yield host
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            await host.snapshot()
        finally:
            await changelog.close()
            if fleet_log is not None:
                await fleet_log.close()


async def _load(settings: Settings, dim: int) -> tuple[FleetTable, ChangeLog, int]:
    """The local table (its last snapshot plus its change log), the log, changes replayed."""
    started = time.perf_counter()
    device = settings.index_device
    table = await asyncio.to_thread(FleetTable.load, settings.index_dir, dim, device=device)
    loaded = table.seq
    changelog, replayed = await asyncio.to_thread(recover, table, settings.index_dir / LOG_DIR)
    log.info(
        "fleet index loaded: %d drivers in %.2f s (snapshot of change %d, %d changes replayed)",
        len(table),
        time.perf_counter() - started,
        loaded,
        replayed,
    )
    return table, changelog, replayed


def _incoming(index_dir: Path) -> Path:
    return index_dir.with_name(index_dir.name + ".incoming")


async def _fetch_published(fleet_log: FleetLog, settings: Settings, seq: int) -> bool:
    """A table older than the stream's first change (a new replica, or one down for long):
    fetch the published snapshot beside the index dir (``_replace_index_dir`` swaps it in).
    False when the table can follow the stream as it is, or nothing fits (then ``catch_up``
    says why)."""
    try:
        first = await fleet_log.first_seq()
        if seq + 1 >= first:
            return False
        manifest = await fleet_log.manifest()
        if manifest is None or manifest["seq"] + 1 < first:
            return False
        incoming = _incoming(settings.index_dir)
        await asyncio.to_thread(shutil.rmtree, incoming, ignore_errors=True)
        started = time.perf_counter()
        await fleet_log.fetch_snapshot(manifest, incoming)
    except FleetLogError as exc:
        log.error("fleet log: %s; starting from the local fleet", exc)
        return False
    log.info(
        "fleet log: fetched the published snapshot of change %d in %.2f s (this table: %d)",
        manifest["seq"],
        time.perf_counter() - started,
        seq,
    )
    return True


def _replace_index_dir(index_dir: Path) -> None:
    """The fetched snapshot becomes the index dir; the old one (snapshots and change log,
    older than it) goes. A crash in between leaves one of them whole."""
    old = index_dir.with_name(index_dir.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if index_dir.exists():
        index_dir.rename(old)
    _incoming(index_dir).rename(index_dir)
    shutil.rmtree(old, ignore_errors=True)


# -- over IPC ------------------------------------------------------------------------------


def _record_json(record: DriverRecord | None) -> bytes | None:
    return None if record is None else record.model_dump_json().encode()


def _record(raw: bytes | None) -> DriverRecord | None:
    return None if raw is None else DriverRecord.model_validate_json(raw)


def index_handlers(host: IndexHost) -> dict[str, Handler]:
    """The ops of ``RemoteIndex``, served by the index process."""
    dim = host.table.dim

    async def ping(message: Msg, blobs: Frames) -> Out:
        return host.facts(), ()

    async def upsert(message: Msg, blobs: Frames) -> Out:
        n = len(message["ids"])
        arrays = {
            name: np.frombuffer(frame.buffer, dtype=np.dtype(dtype)).reshape(n, *shape)
            for (name, dtype, shape), frame in zip(message["fields"], blobs[1:], strict=True)
        }
        prepared = Prepared(message["ids"], message["vehicle_ids"], message["records"], arrays)
        await host.upsert_prepared(prepared, frame_rows(blobs[0], dim))
        return {"upserted": n}, ()

    async def update(message: Msg, blobs: Frames) -> Out:
        position = message.get("position")
        try:
            record = await host.update_driver(
                message["driver_id"],
                position=None if position is None else Position.model_validate(position),
                status=message.get("status"),
            )
        except KeyError:
            raise NotFoundError(message["driver_id"]) from None
        return {"record": _record_json(record)}, ()

    async def move(message: Msg, blobs: Frames) -> Out:
        lats, lngs, ts = (
            np.frombuffer(f.buffer, dtype=t) for f, t in zip(blobs, MOVE_DTYPES, strict=True)
        )
        batch = Positions(message["ids"], lats, lngs, ts, message["statuses"])
        return (await host.move(batch))._asdict(), ()

    async def delete(message: Msg, blobs: Frames) -> Out:
        return {"deleted": await host.delete_driver(message["driver_id"])}, ()

    async def get(message: Msg, blobs: Frames) -> Out:
        records = await host.get_drivers(message["driver_ids"])
        return {"records": [_record_json(r) for r in records]}, ()

    async def recommend(message: Msg, blobs: Frames) -> Out:
        order = Order.model_validate_json(message["order"])
        answer = await host.recommend(order, frame_rows(blobs[0], dim)[0])
        candidates = [
            (c.driver_id, c.vehicle_id, c.similarity, c.distance_km) for c in answer.candidates
        ]
        return {"candidates": candidates, "considered": answer.considered}, ()

    async def set_ready(message: Msg, blobs: Frames) -> Out:
        await host.set_ready()
        return {}, ()

    return {
        "ping": ping,
        "upsert": upsert,
        "update": update,
        "move": move,
        "delete": delete,
        "get": get,
        "recommend": recommend,
        "set_ready": set_ready,
    }


class RemoteIndex:
    """An ``IndexService`` in another process (see ``index_handlers``)."""

    def __init__(self, client: RpcClient) -> None:
        self.client = client

    @property
    def up(self) -> bool:
        return self.client.up

    @property
    def ready(self) -> bool:
        return self.client.up and bool(self.client.facts.get("ready"))

    async def upsert_drivers(
        self, records: Sequence[DriverRecord], vectors: npt.NDArray[np.float32]
    ) -> None:
        prepared = Prepared.of(records)
        fields = [(n, a.dtype.str, list(a.shape[1:])) for n, a in prepared.fields.items()]
        frames = [
            memoryview(np.ascontiguousarray(a).data).cast("B") for a in prepared.fields.values()
        ]
        await self.client.call(
            "upsert",
            [rows_frame(vectors), *frames],
            ids=prepared.ids,
            vehicle_ids=prepared.vehicle_ids,
            records=prepared.blobs,
            fields=fields,
        )

    async def update_driver(
        self, driver_id: str, *, position: Position | None, status: Status | None
    ) -> DriverRecord:
        moved = None if position is None else orjson.loads(position.model_dump_json())
        try:
            reply, _ = await self.client.call(
                "update", driver_id=driver_id, position=moved, status=status
            )
        except NotFoundError:
            raise KeyError(driver_id) from None
        record = _record(reply["record"])
        assert record is not None
        return record

    async def move(self, batch: Positions) -> Movement:
        arrays = (batch.lats, batch.lngs, batch.ts_us)
        frames = [
            memoryview(np.ascontiguousarray(a, dtype=t).data).cast("B")
            for a, t in zip(arrays, MOVE_DTYPES, strict=True)
        ]
        reply, _ = await self.client.call(
            "move", frames, ids=list(batch.ids), statuses=batch.statuses
        )
        return Movement(reply["updated"], reply["stale"], reply["unknown"])

    async def delete_driver(self, driver_id: str) -> bool:
        reply, _ = await self.client.call("delete", driver_id=driver_id)
        return bool(reply["deleted"])

    async def get_driver(self, driver_id: str) -> DriverRecord | None:
        return (await self.get_drivers([driver_id]))[0]

    async def get_drivers(self, driver_ids: Sequence[str]) -> list[DriverRecord | None]:
        reply, _ = await self.client.call("get", driver_ids=list(driver_ids))
        return [_record(raw) for raw in reply["records"]]

    async def recommend(self, order: Order, query: npt.NDArray[np.float32]) -> Recommendation:
        reply, _ = await self.client.call(
            "recommend", [rows_frame(query[None, :])], order=order.model_dump_json().encode()
        )
        candidates = [Candidate(*c) for c in reply["candidates"]]
        return Recommendation(candidates, int(reply["considered"]))

    async def count(self) -> int:
        return int(self.client.facts.get("drivers", 0))

    async def set_ready(self) -> None:
        await self.client.call("set_ready")


def serve_index(host: IndexHost, bind: str) -> RpcServer:
    return RpcServer(bind, index_handlers(host))
