"""The engine process's LMDB writes, in a child process of their own.

``FLEETCACHE_LMDB_WRITER=process``, or ``auto`` (the default) with 4 usable cores or more
(``proxy.engine_host.lmdb_writer``). py-lmdb lets go of the GIL around every ``put`` and takes
it back after, so a thread of the engine process writing back 256 rows hands the interpreter
to and from the event loop that drives the device 256 times, and the loop, the batcher's
threads and the writes share one GIL. Here a child process with an interpreter of its own
owns the write transactions; reads stay local (LMDB readers never wait for the writer). The
engine's write-backs send their rows unencoded (``amset_rows``: a float32 frame each, their
keys and expiry, and the entries written with them, such as links), those of one turn of its
event loop (one batch's requests) in one message: the child encodes them, checks each call's
keys (a bad one fails that call alone) and writes them with the calls that arrived
meanwhile, in one transaction with one fsync. Other writes (``amset``) are grouped here, one
message a group::

    engine process                                 writer child (writer_main)
      TieredByteStore                                LmdbByteStore.amset: group commit
        LmdbWriterStore.amset_rows: a turn's calls -- keys, rows, links -->  encode_many,
                                                                keys checked per call
        LmdbWriterStore.amset: group ---- keys, values ------>  (one transaction a group)
        reads, deletes: its own transactions  <------ ack (the entries are committed)

Measured on the H200 (``bench/serve_bench.py``, 8 workers, all new texts, docs/BENCHMARKS.md,
2026-12-02), the child when it was sent encoded entries (bc7df02): 31,458 new texts/s against
22,315 with the thread on that machine's disk, 37,123 against 25,904 on tmpfs (no write-back
at all: 53,254). Encoding in the child took the engine's loop from 11.8 to 10.8 us of CPU a
new text on the 2-core box (``bench/engine_bench.py --writer process``), 19-21 to 18 on the
H200; one message a turn instead of one a call, 10.7 to 9.8 on the 2-core box.
The first form (a message per write-back, encoded, 2026-12-01) served less than the thread.

A partitioned store (``FLEETCACHE_LMDB_PARTITIONS``, ``LmdbByteStore``) gets one writer
process a partition below the child (``PartitionWriters``): the child encodes and checks as
above, then sends each partition's entries to its writer (the links of all first, then the
rest: ``cache.stores.POINTER_PREFIX``), and each commits its own with its own fsync, beside
the others. Threads of one process could not (``LmdbByteStore``); processes on the H200's
disk took 4-5x one environment's entries a second with 8 (docs/BENCHMARKS.md). The messages
that arrive while the partitions write go out together in the next write (``GroupCommit``),
not each to every partition in two phases of its own.

The child dies with the engine process (PDEATHSIG) and the engine starts another on the next
write after it exited (a partition's writer, likewise, dies with the child, and the child
starts another on the next write to that partition); a write it does not acknowledge raises
here, where the tiers count it like any store error (the vectors are computed again next
time, the request is served).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import secrets
from collections.abc import Sequence
from itertools import accumulate, pairwise
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import numpy as np

from cache.codec import RowEntries
from cache.stores import GiB, GroupCommit, LmdbByteStore, fsync_options
from proxy.cores import lower
from proxy.ipc import Handler, RpcClient, RpcServer, error_payload, payload_error

log = logging.getLogger("fleetcache.engine")

WRITE_TIMEOUT_S = 30.0  # a write the child has not acknowledged by then counts as failed
_RowsCall = tuple[RowEntries, Sequence[tuple[str, bytes]], "asyncio.Future[None]"]


def start_timeout(partitions: int) -> float:
    """How long ``partitions`` writer processes started at once are given to answer: 30 s,
    and 2 s more for each, since each imports as the others do (on the 2-core box 8 made a
    server ready in 15 s, 16 in 22 s, and 64 outlasted a fixed 30 s)."""
    return 30.0 + 2.0 * partitions


class LmdbWriterStore(LmdbByteStore):
    """An ``LmdbByteStore`` whose ``amset`` runs in a writer child (see the module docstring).
    ``start`` it inside the event loop that will write; ``close`` stops the child."""

    def __init__(
        self,
        path: Path | str,
        map_size: int = 4 * GiB,
        *,
        fsync_every_s: float = 0.0,
        partitions: int = 1,
        log_level: str = "info",
        nice: int = 0,
        cpus: Sequence[int] = (),
    ):
        """``nice``: the child (and the partitions' writers it starts, which inherit it) that
        many nice values below the thread that starts it; ``cpus``: where they run (empty:
        where this process does)."""
        # the child opens the directory as this made it (``LmdbByteStore``: its layout file)
        super().__init__(path, map_size, partitions=partitions, **fsync_options(fsync_every_s))
        self._map_size = map_size
        self._fsync_every_s = fsync_every_s
        self._log_level = log_level
        self._nice = nice
        self._cpus = tuple(cpus)
        self._address = f"ipc://@fleetcache-writer-{os.getpid()}-{secrets.token_hex(4)}"
        self._process: BaseProcess | None = None
        self._client: RpcClient | None = None
        self.starts = 0  # children started (a restart after a crash counts one more)
        self._rows_calls: list[_RowsCall] = []  # amset_rows calls of this turn, not sent yet
        self._sending: set[asyncio.Future[None]] = set()
        self.rows_messages = 0  # mset_rows messages sent (each holds one turn's calls)

    async def start(self, timeout_s: float | None = None) -> LmdbWriterStore:
        """Start the child; it answers once it (and a partitioned store's writers) can write.
        ``timeout_s``: by default 30 s more than its partition writers are given."""
        timeout_s = timeout_s or 30.0 + start_timeout(self.partitions)
        self._spawn()
        self._client = await RpcClient(self._address, role="engine", service="writer").start()
        if not await self._client.wait_up(timeout_s):
            raise RuntimeError(f"the LMDB writer did not answer within {timeout_s:.0f} s")
        return self

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        args = (
            *(str(self.path), self._map_size, self._fsync_every_s, self._address),
            *(self._log_level, self._cpus),
        )
        self._process = context.Process(
            target=writer_main, args=args, name="fleetcache-writer", daemon=True
        )
        self._process.start()
        if self._nice and self._process.pid is not None:  # before it starts any thread
            lower(self._process.pid, self._nice)
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def _live_client(self) -> RpcClient:
        """The client of a running child (another started if this one died)."""
        if self._client is None or self._process is None:
            raise RuntimeError("LmdbWriterStore.start() has not been called")
        if self._process.exitcode is not None:  # died (killed, or the OOM killer): again
            log.warning("the LMDB writer exited with %s; starting another", self._process.exitcode)
            self._spawn()
            await self._client.wait_up(WRITE_TIMEOUT_S)
        return self._client

    async def _commit(self, items: Sequence[tuple[str, bytes]]) -> None:
        """A group of ``amset`` calls (``LmdbByteStore``'s group commit) as one message."""
        client = await self._live_client()
        for key, _ in items:
            self._key(key)  # the same ValueError as a local write, before anything is sent
        await client.call("mset", [_joined(items)], **_cut(items), timeout_s=WRITE_TIMEOUT_S)

    async def amset_rows(self, rows: RowEntries, extra: Sequence[tuple[str, bytes]] = ()) -> None:
        """The rows encoded by the child (their keys checked there, before the call joins a
        transaction: a bad key fails this call alone), ``extra`` entries in the same
        transaction. The calls made in one turn of the event loop (the write-backs of one
        batch's requests) travel as one message, each call's rows a float32 frame; the child
        commits them with those that arrived meanwhile, as ``amset`` does."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._rows_calls.append((rows, extra, done))
        if len(self._rows_calls) == 1:  # sent once this turn's other write-backs queued
            loop.call_soon(self._send_rows)
        await done

    def _send_rows(self) -> None:
        calls, self._rows_calls = self._rows_calls, []
        if not calls:  # sent already, by ``aclose``
            return
        self.rows_messages += 1
        task = asyncio.ensure_future(self._rows_message(calls))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _rows_message(self, calls: list[_RowsCall]) -> None:
        """One ``mset_rows`` message of ``calls``; each call's future gets its own outcome."""
        try:
            client = await self._live_client()
            matrices = [np.ascontiguousarray(r.matrix, dtype=np.float32) for r, _, _ in calls]
            extra = [entry for _, entries, _ in calls for entry in entries]
            dated = any(r.expires_at is not None for r, _, _ in calls)
            reply, _ = await client.call(
                "mset_rows",
                [*(m.data for m in matrices), _joined(extra)],
                calls=[[len(r.keys), len(entries)] for r, entries, _ in calls],
                keys=[key for r, _, _ in calls for key in r.keys],
                dims=[int(m.shape[-1]) if m.ndim == 2 else 0 for m in matrices],
                dtypes=[r.dtype for r, _, _ in calls],
                expires_at=[e for r, _, _ in calls for e in (r.expires_at or [None] * len(r.keys))]
                if dated
                else None,
                extra=_cut(extra),
                timeout_s=WRITE_TIMEOUT_S,
            )
        except Exception as exc:  # the child, or the commit of the whole group, failed
            for _, _, done in calls:
                if not done.done():
                    done.set_exception(exc)
            return
        for (_, _, done), error in zip(calls, reply["errors"], strict=True):
            if not done.done():
                if error is None:
                    done.set_result(None)
                else:
                    done.set_exception(payload_error(error))

    async def aclose(self) -> None:
        """Stop the child once the writes sent to it are acknowledged (callers await them)."""
        self._send_rows()  # rows calls of this turn, not sent yet
        if self._sending:
            await asyncio.wait(set(self._sending), timeout=WRITE_TIMEOUT_S)
        if self._client is not None:
            await self._client.close()
            self._client = None
        process, self._process = self._process, None
        if process is not None and process.exitcode is None:
            process.terminate()  # SIGTERM: the child commits what it holds, then exits
            await asyncio.to_thread(process.join, 10.0)
            if process.exitcode is None:
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        self.close()


def writer_main(
    path: str,
    map_size: int,
    fsync_every_s: float,
    address: str,
    log_level: str,
    cpus: Sequence[int] = (),
) -> None:
    from proxy.processes import become_child

    become_child("writer", log_level, cpus)  # dies with the engine process (or its writer child)
    asyncio.run(_writer(path, map_size, fsync_every_s, address, log_level))


class PartitionWriters:
    """The writer processes of a partitioned ``store``, one a partition (each a
    ``writer_main`` on its partition's environment, with its own group commit), started by
    the writer child that opened ``store``."""

    def __init__(
        self, store: LmdbByteStore, fsync_every_s: float, address: str, log_level: str
    ) -> None:
        self._store = store
        self._args = [
            (str(directory), store.partition_map_size, fsync_every_s, f"{address}-p{i}", log_level)
            for i, directory in enumerate(store.directories)
        ]
        self._processes: list[BaseProcess] = []
        self._clients: list[RpcClient] = []
        self.starts = 0
        # the child's messages that arrive while a write is under way go out together in the
        # next: a message a partition and phase for all of them, not for each
        self._grouped = GroupCommit(self._fan_out, store.max_group * store.partitions)
        self.writes = 0  # fan-outs (each: a message to each partition it touches, a phase)

    async def start(self, timeout_s: float | None = None) -> PartitionWriters:
        # The engine started this child as a daemon (it is terminated with the engine), and
        # multiprocessing lets no daemon start processes; the flag means nothing else here.
        multiprocessing.current_process().daemon = False
        timeout_s = timeout_s or start_timeout(len(self._args))
        for i, args in enumerate(self._args):
            self._processes.append(self._spawn(args))
            client = RpcClient(args[3], role="writer", service=f"LMDB partition {i} writer")
            self._clients.append(await client.start())
        for client in self._clients:
            if not await client.wait_up(timeout_s):
                raise RuntimeError(f"the LMDB partition writers did not answer in {timeout_s} s")
        return self

    def _spawn(self, args: tuple[str, int, float, str, str]) -> BaseProcess:
        process = multiprocessing.get_context("spawn").Process(
            target=writer_main, args=args, name="fleetcache-writer-partition", daemon=True
        )
        process.start()
        self.starts += 1
        return process

    async def amset(self, items: Sequence[tuple[str, bytes]]) -> None:
        """``items`` written with those of the calls made meanwhile (``GroupCommit``)."""
        await self._grouped(items)

    async def _fan_out(self, items: Sequence[tuple[str, bytes]]) -> None:
        """Each partition's share of ``items`` to its writer, all at once: the links first
        (``LmdbByteStore.write_phases``), the rest once they are committed."""
        self.writes += 1
        for phase in self._store.write_phases([key.encode() for key, _ in items]):
            writes = [self._write(i, [items[j] for j in at]) for i, at in phase.items()]
            await asyncio.gather(*writes)

    async def _write(self, partition: int, items: list[tuple[str, bytes]]) -> None:
        if self._processes[partition].exitcode is not None:  # killed: another, as the engine
            log.warning("the writer of LMDB partition %d exited; starting another", partition)
            self._processes[partition] = self._spawn(self._args[partition])
            await self._clients[partition].wait_up(WRITE_TIMEOUT_S)
        await self._clients[partition].call(
            "mset", [_joined(items)], **_cut(items), timeout_s=WRITE_TIMEOUT_S
        )

    async def aclose(self) -> None:
        for client in self._clients:
            await client.close()
        for process in self._processes:
            if process.exitcode is None:
                process.terminate()  # commits what it holds, then exits
        for process in self._processes:
            await asyncio.to_thread(process.join, 10.0)
            if process.exitcode is None:
                process.kill()


async def _writer(
    path: str, map_size: int, fsync_every_s: float, address: str, log_level: str
) -> None:
    from proxy.processes import serve_until_stopped

    store = LmdbByteStore(path, map_size, **fsync_options(fsync_every_s))
    partitions = None
    if store.partitions > 1:
        partitions = await PartitionWriters(store, fsync_every_s, address, log_level).start()
    write = store.amset if partitions is None else partitions.amset

    async def ping(message: dict[str, Any], blobs: list[Any]) -> tuple[dict[str, Any], tuple[()]]:
        return {"pid": os.getpid()}, ()

    async def mset(message: dict[str, Any], blobs: list[Any]) -> tuple[dict[str, Any], tuple[()]]:
        await write(_split(message, blobs[0].bytes))
        return {}, ()

    async def mset_rows(
        message: dict[str, Any], blobs: list[Any]
    ) -> tuple[dict[str, Any], tuple[()]]:
        """``LmdbWriterStore._rows_message``: each call's rows encoded and its keys checked
        (a bad one fails that call alone, before anything is written), the others committed
        together; ``errors``: each call's, or None."""
        keys, expiry, extra = message["keys"], message["expires_at"], message["extra"]
        extras = _split(extra, blobs[-1].bytes)
        entries: list[tuple[str, bytes]] = []
        errors: list[dict[str, str] | None] = []
        at = at_extra = 0
        for i, (count, extra_count) in enumerate(message["calls"]):
            own = keys[at : at + count]
            matrix = np.frombuffer(blobs[i].buffer, "<f4").reshape(count, message["dims"][i])
            dates = None if expiry is None else expiry[at : at + count]
            call = RowEntries(own, matrix, message["dtypes"][i], dates).entries()
            call += extras[at_extra : at_extra + extra_count]
            at, at_extra = at + count, at_extra + extra_count
            try:
                for key, _ in call:
                    store._key(key)
            except ValueError as exc:
                errors.append(error_payload(exc))
                continue
            entries += call
            errors.append(None)
        await write(entries)  # a failed commit fails every call of the message
        return {"errors": errors}, ()

    handlers: dict[str, Handler] = {"ping": ping, "mset": mset, "mset_rows": mset_rows}
    try:
        await serve_until_stopped(RpcServer(address, handlers))
    finally:
        if partitions is not None:
            await partitions.aclose()
        store.close()


def _joined(items: Sequence[tuple[str, bytes]]) -> bytes:
    return b"".join(value for _, value in items)


def _cut(items: Sequence[tuple[str, bytes]]) -> dict[str, Any]:
    """``keys`` and ``cuts`` (where each value ends in their joined frame, the last left out)."""
    return {
        "keys": [key for key, _ in items],
        "cuts": list(accumulate(len(v) for _, v in items))[:-1],
    }


def _split(message: dict[str, Any], data: bytes) -> list[tuple[str, bytes]]:
    """The entries of ``_cut``'s ``keys`` and ``cuts`` over their joined ``data``."""
    if not message["keys"]:
        return []
    bounds = pairwise([0, *message["cuts"], len(data)])
    return [(key, data[a:b]) for key, (a, b) in zip(message["keys"], bounds, strict=True)]
