"""Removing what the cache can never serve again: old namespaces and expired entries.

Every key carries its namespace (the engine fingerprint), so the entries of another
fingerprint are never served, but they keep taking space. ``prune(store, keep=namespace)``
walks every key of ``store`` (a second tier: LMDB or Redis; or any ByteStore), groups the
keys by namespace (vectors ``{ns}:...`` and entity links ``link:{ns}:...``), and removes
those of every namespace but ``keep``, plus the entries of ``keep`` whose expiry has passed
(LMDB keeps those until they are read again). ``dry_run`` only counts. Bytes are key plus
value bytes, as the stores hold them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from langchain_core.stores import ByteStore

from cache import codec
from cache.links import LINK_PREFIX, link_namespace


@dataclass
class NamespaceUsage:
    """What one namespace holds in the store, and what ``prune`` removed (or would)."""

    namespace: str
    current: bool
    entries: int = 0  # every key, links included
    links: int = 0
    bytes: int = 0
    freed_entries: int = 0
    freed_bytes: int = 0

    def add(self, key: str, size: int, *, freed: bool) -> None:
        self.entries += 1
        self.links += key.startswith(LINK_PREFIX)
        self.bytes += size
        if freed:
            self.freed_entries += 1
            self.freed_bytes += size


def _batched(items: Iterable[str], n: int) -> Iterator[list[str]]:
    it = iter(items)
    while batch := list(itertools.islice(it, n)):
        yield batch


def prune(
    store: ByteStore,
    keep: str,
    *,
    dry_run: bool = False,
    chunk: int = 1_000,
    wall_clock: Callable[[], float] = time.time,
) -> list[NamespaceUsage]:
    """Remove every namespace but ``keep`` and the expired entries of ``keep``; the usage
    per namespace, ``keep`` first, then the largest."""
    usage: dict[str, NamespaceUsage] = {}
    doomed: list[str] = []
    now = wall_clock()
    # Deleting only after the walk: a scan never sees the keyspace change under it.
    for keys in _batched(store.yield_keys(), chunk):
        for key, value in zip(keys, store.mget(keys), strict=True):
            if value is None:  # deleted (or expired in Redis) since the scan saw it
                continue
            ns = link_namespace(key)
            entry = usage.get(ns) or usage.setdefault(ns, NamespaceUsage(ns, ns == keep))
            expiry = codec.expires_at(value)
            freed = ns != keep or (expiry is not None and expiry <= now)
            entry.add(key, len(key.encode("utf-8", "surrogatepass")) + len(value), freed=freed)
            if freed:
                doomed.append(key)
    if not dry_run:
        for part in _batched(doomed, chunk):
            store.mdelete(part)
    return sorted(usage.values(), key=lambda u: (not u.current, -u.bytes, u.namespace))
