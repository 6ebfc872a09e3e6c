"""The region's shared fleet log: every fleet change of every replica, in one order, on a
Redis stream (API.md v1.1 "Durability", ARCHITECTURE.md "Scale-out beyond one machine").

With ``FLEETCACHE_FLEET_LOG_URL`` set, a replica's fleet index owner does not change its table
when a request asks; it *publishes* the change here and applies the stream, its own changes
and everyone else's, in stream order (``IndexHost.follow``). The stream's entry ids are the
changes' sequence numbers (``"<seq>-0"``), the same ``seq`` that ``FleetTable.seq``, the local
change log and snapshots count, so a replica resumes reading right after its table's ``seq``
and two replicas that applied the same prefix hold equal tables. One entry::

    XADD fleetcache:fleet <seq>-0  c <frame of indexes.changes, its seq 0>  by <writer token>

A Lua script takes the next number and appends in one step, so writers never race for a
number. ``by`` lets the writing replica find its own change again when it applies it, to
answer the request that made it.

The Redis behind it must keep its data (append-only file, ``noeviction``): not the cache's
Redis, which may evict (compose.yaml runs both).

The stream does not grow for ever (bulk positions alone can add megabytes a second). Every
``FLEETCACHE_FLEET_SNAPSHOT_PUBLISH_S`` one replica (a lock decides which) *publishes* its
latest local snapshot: the files of its snapshot directory in chunks under
``fleetcache:fleet:snapshot:<seq>:<file>:<i>``, then a manifest ``fleetcache:fleet:snapshot``
(seq, directory name, files) that names them, then the previous snapshot's keys deleted and the
stream trimmed up to the previous snapshot's seq (a replica that is live follows within
milliseconds; one a whole publish interval behind starts again from the snapshot). A replica
whose table is older than the stream's first entry (a new one with an empty data dir, or one
down for long) starts from the published snapshot plus the stream after it (``bootstrap``).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from indexes import changes, snapshot
from indexes.changes import Change
from proxy.ipc import ServiceUnavailableError

T = TypeVar("T")
STREAM = "fleetcache:fleet"
CHUNK_BYTES = 32 << 20  # a published snapshot's files travel in pieces of this size

# KEYS[1] the stream; ARGV[1] the frame, ARGV[2] the writer's token. Returns the new seq:
# one past the stream's last id (its "last-generated-id", which survives trimming).
_PUBLISH = """
local seq = 1
if redis.call('EXISTS', KEYS[1]) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEYS[1])
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      seq = tonumber(string.match(info[i + 1], '^(%d+)')) + 1
    end
  end
end
redis.call('XADD', KEYS[1], seq .. '-0', 'c', ARGV[1], 'by', ARGV[2])
return seq
"""


class FleetLogError(ServiceUnavailableError):
    """The shared log cannot be reached, or holds what this replica cannot apply (fleet
    writes answer 503 ``fleet_log_unavailable`` + Retry-After; reads go on)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "fleet_log")


class FleetLogGap(FleetLogError):
    """The stream no longer holds the changes right after this replica's table (trimmed
    after a snapshot was published): the replica must start again from that snapshot."""


@dataclass(frozen=True)
class Entry:
    change: Change  # numbered with its stream seq
    by: str  # the token of the replica request that published it


class FleetLog:
    """Publish changes to, and read them back from, the shared stream."""

    def __init__(self, url: str, stream: str = STREAM, *, timeout_s: float = 5.0) -> None:
        self.stream = stream
        self._client = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        # XREAD BLOCK holds its connection: a client of its own, with no socket timeout
        self._reader = aioredis.Redis.from_url(url, socket_connect_timeout=timeout_s)
        self._publish = self._client.register_script(_PUBLISH)
        self._prefix = uuid.uuid4().hex[:12]
        self._tokens = 0

    def token(self) -> str:
        """A token no other publish of any replica uses."""
        self._tokens += 1
        return f"{self._prefix}:{self._tokens}"

    async def publish(self, change: Change, token: str) -> int:
        """Append ``change`` (its seq is ignored); returns the seq the stream gave it."""
        frame = changes.encode(msgspec.structs.replace(change, seq=0))
        return int(await self._call(self._publish(keys=[self.stream], args=[frame, token])))

    async def last_seq(self) -> int:
        """The number of the last change ever appended (0: none yet)."""
        info = await self._info()
        return 0 if info is None else _seq(info["last-generated-id"])

    async def read(
        self, after: int, *, block_ms: int | None = 1000, count: int = 512
    ) -> list[Entry]:
        """The entries after change ``after`` (waiting up to ``block_ms`` for one; None: not
        at all)."""
        reading = self._reader.xread({self.stream: f"{after}-0"}, count=count, block=block_ms)
        return list(_entries(await self._call(reading), after))

    async def first_seq(self) -> int:
        """The number of the oldest change the stream still holds (one past the last when
        it holds none: all trimmed, or none ever appended)."""
        info = await self._info()
        if info is None:
            return 1
        first = info.get("first-entry")
        return _seq(first[0]) if first else _seq(info["last-generated-id"]) + 1

    async def _info(self) -> dict[Any, Any] | None:
        """XINFO STREAM of the stream; None while there is none (nothing appended yet)."""
        try:
            return dict(await self._client.xinfo_stream(self.stream))
        except ResponseError:  # no such key
            return None
        except RedisError as exc:
            raise _unavailable(exc) from exc

    async def manifest(self) -> dict[str, Any] | None:
        """The published snapshot: {"seq", "name", "files": [[name, size, chunks], ...]}."""
        raw = await self._call(self._client.get(f"{self.stream}:snapshot"))
        return None if raw is None else dict(json.loads(raw))

    async def publish_snapshot(self, directory: Path, seq: int, *, every_s: float) -> bool:
        """Publish the snapshot in ``directory`` (holding changes up to ``seq``) unless one
        at least as new is published, or another replica published one less than ``every_s``
        ago; then trim the stream up to the snapshot published before. True when published."""
        lock = f"{self.stream}:snapshot:lock"
        if not await self._call(
            self._client.set(lock, self._prefix, nx=True, ex=max(1, round(every_s)))
        ):
            return False
        before = await self.manifest()
        if before is not None and before["seq"] >= seq:
            return False
        files = []
        for path in await asyncio.to_thread(_files, directory):
            chunks = 0
            with await asyncio.to_thread(path.open, "rb") as fh:
                while piece := await asyncio.to_thread(fh.read, CHUNK_BYTES):
                    key = f"{self.stream}:snapshot:{seq}:{path.name}:{chunks}"
                    await self._call(self._client.set(key, piece))
                    chunks += 1
            files.append([path.name, (await asyncio.to_thread(path.stat)).st_size, chunks])
        manifest = {"seq": seq, "name": directory.name, "files": files}
        await self._call(self._client.set(f"{self.stream}:snapshot", json.dumps(manifest)))
        if before is not None:
            await self._delete_snapshot(before)
            await self._call(self._client.xtrim(self.stream, minid=f"{before['seq'] + 1}-0"))
        return True

    async def fetch_snapshot(self, manifest: dict[str, Any], root: Path) -> Path:
        """Write the published snapshot into ``root`` as its live snapshot (the layout of
        ``indexes.snapshot``: its directory, then ``CURRENT`` naming it); returns it."""
        target = root / manifest["name"]
        await asyncio.to_thread(target.mkdir, parents=True)
        for name, size, chunks in manifest["files"]:
            pieces: list[bytes] = []
            for i in range(chunks):
                key = f"{self.stream}:snapshot:{manifest['seq']}:{name}:{i}"
                piece = await self._call(self._client.get(key))
                if not isinstance(piece, bytes):  # None: deleted by a newer publish
                    raise FleetLogError(f"the published snapshot lost {name} (replaced?)")
                pieces.append(piece)
            if sum(map(len, pieces)) != size:
                raise FleetLogError(f"the published snapshot's {name} is not {size} bytes")
            await asyncio.to_thread(snapshot.write_durably, target / name, *pieces)
        await asyncio.to_thread(snapshot.make_live, root, target)
        return target

    async def _delete_snapshot(self, manifest: dict[str, Any]) -> None:
        keys = [
            f"{self.stream}:snapshot:{manifest['seq']}:{name}:{i}"
            for name, _, chunks in manifest["files"]
            for i in range(chunks)
        ]
        if keys:
            await self._call(self._client.delete(*keys))

    async def _call(self, pending: Awaitable[T]) -> T:
        try:
            return await pending
        except RedisError as exc:
            raise _unavailable(exc) from exc

    async def close(self) -> None:
        await self._client.aclose()
        await self._reader.aclose()


def _entries(answer: Any, after: int) -> Iterator[Entry]:
    """The entries of an XREAD answer ``[[stream, [(id, fields), ...]]]``, numbered on from
    ``after`` without a gap."""
    expected = after + 1
    for _, items in answer:
        for entry_id, fields in items:
            seq = _seq(entry_id)
            if seq != expected:
                raise FleetLogGap(
                    f"the fleet log skips from change {expected - 1} to {seq} (trimmed?)"
                )
            payloads = [p for _, p in changes.frames(fields[b"c"])]
            if len(payloads) != 1:
                raise FleetLogError(f"change {seq} on the fleet log is not one whole frame")
            change = msgspec.structs.replace(changes.decode(payloads[0]), seq=seq)
            yield Entry(change, fields.get(b"by", b"").decode())
            expected += 1


def _files(directory: Path) -> list[Path]:
    return sorted(directory.iterdir())


def _seq(entry_id: bytes) -> int:
    """The change number of a stream entry id (``b"<seq>-0"``)."""
    return int(entry_id.split(b"-", 1)[0])


def _unavailable(exc: RedisError) -> FleetLogError:
    return FleetLogError(f"the fleet log is unavailable: {type(exc).__name__}")
