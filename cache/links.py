"""Entity -> key links: which cached vector a driver or a vehicle was last embedded to.

A link is one more entry in the cache's own store, ``link:{namespace}:{kind}:{id}`` -> the
entity's vector key (UTF-8), so replicas sharing Redis share their links, and ``fleetcache
cache prune`` removes the links of old namespaces with their vectors. ``relink`` (after each
embed of entity records) drops an entity's previous vector when its text changed; ``forget``
(``DELETE /v1/cache/entities/{kind}/{id}``) drops its current one from every tier.

Entities with identical features render identical texts and so share one vector: dropping it
for one of them only costs the others one recomputation. Another replica's memory tier keeps
a dropped vector until it is evicted (there is no cross-replica invalidation; the workers of
one server are all told, see ``drop``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from langchain_core.stores import ByteStore

from cache.base import ErrorLog
from cache.stores import TieredByteStore, read_uncounted

LINK_PREFIX = "link:"


class Entity(NamedTuple):
    """A record to embed: its kind (``driver`` | ``vehicle``), its id and its text."""

    kind: str
    id: str
    text: str


def link_namespace(key: str) -> str:
    """The namespace a store key belongs to, link or vector (``prune`` groups by it)."""
    if key.startswith(LINK_PREFIX):
        key = key[len(LINK_PREFIX) :]
    return key.partition(":")[0]


class EntityLinks:
    """The links of one namespace in ``store`` (the cache's tiered store)."""

    def __init__(self, store: ByteStore, namespace: str, errors: ErrorLog) -> None:
        self._store = store
        self.namespace = namespace
        self._errors = errors

    def key(self, kind: str, entity_id: str) -> str:
        return f"{LINK_PREFIX}{self.namespace}:{kind}:{entity_id}"

    async def relink(self, entities: Sequence[tuple[str, str]], keys: Sequence[str]) -> int:
        """Point each ``(kind, id)`` at its new vector key; drop the vectors they left.

        Returns how many previous vectors were dropped. Store failures are absorbed and
        counted (the vectors were served already; a stale link only leaves an old entry).
        """
        try:
            changed, stale = await self.plan(entities, keys)
            if stale:
                await self._store.amdelete(stale)
            if changed:
                await self._store.amset(changed)
        except Exception as exc:
            self._errors.record("relink", exc)
            return 0
        return len(stale)

    async def plan(
        self, entities: Sequence[tuple[str, str]], keys: Sequence[str]
    ) -> tuple[list[tuple[str, bytes]], list[str]]:
        """What pointing each ``(kind, id)`` at its key takes: the links that change, and the
        vectors no entity of these points at any more (stale). Reads, writes nothing."""
        links = {
            self.key(kind, eid): key.encode()
            for (kind, eid), key in zip(entities, keys, strict=True)
        }
        current = set(links.values())
        old = await read_uncounted(self._store, list(links))
        changed = [
            (lk, new) for (lk, new), was in zip(links.items(), old, strict=True) if was != new
        ]
        stale = {was for was in old if was is not None} - current
        return changed, sorted(k.decode() for k in stale)

    async def forget(self, kind: str, entity_id: str) -> int | None:
        """Drop the entity's vector and link from every tier: the number of vectors that
        were there (0 when they had expired or gone), or None for an entity never linked.

        Unlike ``relink`` this raises the store's errors: the caller must know the vector
        is really gone.
        """
        dropped = await self.drop(kind, entity_id)
        if dropped is None:
            return None
        await self.unlink(kind, entity_id)
        return dropped[0]

    async def drop(self, kind: str, entity_id: str) -> tuple[int, list[str]] | None:
        """``forget``'s first half: delete the entity's vectors from every tier, keeping its
        link (``unlink`` deletes it), so that a caller who must also reach other processes'
        memory tiers can fail and be retried; returns how many were there and every key to
        drop elsewhere (the vectors' and the link's)."""
        link = self.key(kind, entity_id)
        tiers = self._tiers()
        targets: set[str] = set()
        for tier in tiers:  # every tier: another replica may have relinked it in Redis
            value = (await tier.amget([link]))[0]
            if value is not None:
                targets.add(value.decode())
        if not targets:
            return None
        keys = sorted(targets)
        present = [False] * len(keys)
        for tier in tiers:
            found = [v is not None for v in await tier.amget(keys)]
            present = [p or f for p, f in zip(present, found, strict=True)]
            await tier.amdelete(keys)
        return sum(present), [*keys, link]

    async def unlink(self, kind: str, entity_id: str) -> None:
        """Delete the entity's link from every tier."""
        link = self.key(kind, entity_id)
        for tier in self._tiers():
            await tier.amdelete([link])

    def _tiers(self) -> list[ByteStore]:
        """The stores to read and delete in directly, so that their errors reach us."""
        s = self._store
        if isinstance(s, TieredByteStore):
            return [s.memory] if s.store is None else [s.store, s.memory]
        return [s]
