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
Redis, which may evict (compose.yaml runs both). Every entry is kept: a new replica with an
empty data dir replays the stream from its first change.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from indexes import changes
from indexes.changes import Change
from proxy.ipc import ServiceUnavailableError

STREAM = "fleetcache:fleet"

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
        try:
            return int(await self._publish(keys=[self.stream], args=[frame, token]))
        except RedisError as exc:
            raise FleetLogError(f"the fleet log is unavailable: {type(exc).__name__}") from exc

    async def last_seq(self) -> int:
        """The number of the last change ever appended (0: none yet)."""
        try:
            info = await self._client.xinfo_stream(self.stream)
        except ResponseError:  # no such key: nothing appended yet
            return 0
        except RedisError as exc:
            raise FleetLogError(f"the fleet log is unavailable: {type(exc).__name__}") from exc
        return int(info["last-generated-id"].split(b"-", 1)[0])

    async def read(
        self, after: int, *, block_ms: int | None = 1000, count: int = 512
    ) -> list[Entry]:
        """The entries after change ``after`` (waiting up to ``block_ms`` for one; None: not
        at all)."""
        try:
            answer = await self._reader.xread(
                {self.stream: f"{after}-0"}, count=count, block=block_ms
            )
        except RedisError as exc:
            raise FleetLogError(f"the fleet log is unavailable: {type(exc).__name__}") from exc
        return list(_entries(answer, after))

    async def close(self) -> None:
        await self._client.aclose()
        await self._reader.aclose()


def _entries(answer: Any, after: int) -> Iterator[Entry]:
    """The entries of an XREAD answer ``[[stream, [(id, fields), ...]]]``, numbered on from
    ``after`` without a gap."""
    expected = after + 1
    for _, items in answer:
        for entry_id, fields in items:
            seq = int(entry_id.split(b"-", 1)[0])
            if seq != expected:
                raise FleetLogError(
                    f"the fleet log skips from change {expected - 1} to {seq} (trimmed?)"
                )
            payloads = [p for _, p in changes.frames(fields[b"c"])]
            if len(payloads) != 1:
                raise FleetLogError(f"change {seq} on the fleet log is not one whole frame")
            change = msgspec.structs.replace(changes.decode(payloads[0]), seq=seq)
            yield Entry(change, fields.get(b"by", b"").decode())
            expected += 1
