"""The engine process's LMDB writes, in a child process of their own.

``FLEETCACHE_LMDB_WRITER=process``, or ``auto`` (the default) on a machine of 8 cores or more
(``proxy.engine_host.lmdb_writer``). py-lmdb lets go of the GIL around every ``put`` and takes
it back after, so a thread of the engine process writing back 256 rows hands the interpreter
to and from the event loop that drives the device 256 times, and the loop, the batcher's
threads and the writes share one GIL. Here the engine process only sends the encoded entries;
a child process with an interpreter of its own owns the write transactions, and reads stay
local (LMDB readers never wait for the writer). Measured on the H200 (``bench/serve_bench.py``,
8 workers, all new texts, docs/BENCHMARKS.md): with no write-back at all (``--store memory``)
53,254 new texts/s against 28,819 with the thread (2026-12-02, the data dir on tmpfs); this
child 31,458 against 22,315 on that machine's disk and 37,123 against 25,904 on tmpfs (the
first form, a message per write-back, served less than the thread: 2026-12-01). The
write-backs that arrive while one group is on its way go together in the next (one message,
one transaction, one fsync)::

    engine process                                 writer child (writer_main)
      TieredByteStore                                LmdbByteStore.mset: one transaction
        LmdbWriterStore.amset: group ---- keys, values -->
        reads, deletes: its own transactions  <------ ack (the entries are committed)

The child dies with the engine process (PDEATHSIG) and the engine starts another on the next
write after it exited; a write it does not acknowledge raises here, where the tiers count it
like any store error (the vectors are computed again next time, the request is served).
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

from cache.stores import GiB, LmdbByteStore, fsync_options
from proxy.ipc import RpcClient, RpcServer

log = logging.getLogger("fleetcache.engine")

WRITE_TIMEOUT_S = 30.0  # a write the child has not acknowledged by then counts as failed


class LmdbWriterStore(LmdbByteStore):
    """An ``LmdbByteStore`` whose ``amset`` runs in a writer child (see the module docstring).
    ``start`` it inside the event loop that will write; ``close`` stops the child."""

    def __init__(
        self,
        path: Path | str,
        map_size: int = 4 * GiB,
        *,
        fsync_every_s: float = 0.0,
        log_level: str = "info",
    ):
        super().__init__(path, map_size, **fsync_options(fsync_every_s))
        self._map_size = map_size
        self._fsync_every_s = fsync_every_s
        self._log_level = log_level
        self._address = f"ipc://@fleetcache-writer-{os.getpid()}-{secrets.token_hex(4)}"
        self._process: BaseProcess | None = None
        self._client: RpcClient | None = None
        self.starts = 0  # children started (a restart after a crash counts one more)

    async def start(self, timeout_s: float = 30.0) -> LmdbWriterStore:
        self._spawn()
        self._client = await RpcClient(self._address, role="engine", service="writer").start()
        if not await self._client.wait_up(timeout_s):
            raise RuntimeError(f"the LMDB writer did not answer within {timeout_s:.0f} s")
        return self

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        args = (str(self.path), self._map_size, self._fsync_every_s, self._address, self._log_level)
        self._process = context.Process(
            target=writer_main, args=args, name="fleetcache-writer", daemon=True
        )
        self._process.start()
        self.starts += 1

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    async def _commit(self, items: Sequence[tuple[str, bytes]]) -> None:
        """A group of ``amset`` calls (``LmdbByteStore``'s group commit) as one message."""
        if self._client is None or self._process is None:
            raise RuntimeError("LmdbWriterStore.start() has not been called")
        if self._process.exitcode is not None:  # died (killed, or the OOM killer): again
            log.warning("the LMDB writer exited with %s; starting another", self._process.exitcode)
            self._spawn()
            await self._client.wait_up(WRITE_TIMEOUT_S)
        keys = [key for key, _ in items]
        for key in keys:
            self._key(key)  # the same ValueError as a local write, before anything is sent
        values = [value for _, value in items]
        cuts = list(accumulate(map(len, values)))[:-1]
        await self._client.call(
            "mset", [b"".join(values)], keys=keys, cuts=cuts, timeout_s=WRITE_TIMEOUT_S
        )

    async def aclose(self) -> None:
        """Stop the child once the writes sent to it are acknowledged (callers await them)."""
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
    path: str, map_size: int, fsync_every_s: float, address: str, log_level: str
) -> None:
    from proxy.processes import become_child

    become_child("writer", log_level)  # dies with the engine process
    asyncio.run(_writer(path, map_size, fsync_every_s, address))


async def _writer(path: str, map_size: int, fsync_every_s: float, address: str) -> None:
    from proxy.processes import serve_until_stopped

    store = LmdbByteStore(path, map_size, **fsync_options(fsync_every_s))

    async def ping(message: dict[str, Any], blobs: list[Any]) -> tuple[dict[str, Any], tuple[()]]:
        return {"pid": os.getpid()}, ()

    async def mset(message: dict[str, Any], blobs: list[Any]) -> tuple[dict[str, Any], tuple[()]]:
        data: bytes = blobs[0].bytes
        bounds = pairwise([0, *message["cuts"], len(data)])
        await store.amset(
            [(k, data[a:b]) for k, (a, b) in zip(message["keys"], bounds, strict=True)]
        )
        return {}, ()

    try:
        await serve_until_stopped(RpcServer(address, {"ping": ping, "mset": mset}))
    finally:
        store.close()
