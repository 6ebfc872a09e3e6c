"""``VectorWriter``: rows to codec entries under their namespace keys, written to one store.

The one place that knows how a cached vector is keyed and encoded, shared by the cache's
lookups (``CachedEmbedder``) and by whoever writes computed rows back (the flight, in this
process or in the engine process). Store failures are absorbed and counted in ``errors``: a
vector that could not be written is computed again next time, the request is still served.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
from langchain_core.stores import ByteStore

from cache import codec
from cache.base import CacheStore, ErrorLog
from cache.links import EntityLinks

Row = npt.NDArray[np.float32]
Rows = npt.NDArray[np.float32] | Sequence[Row]  # (n, dim), or n rows


class VectorWriter:
    def __init__(
        self,
        store: ByteStore,
        *,
        namespace: str,
        dtype: codec.Dtype = "float32",
        errors: ErrorLog | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not namespace or len(namespace) > 200 or any(c.isspace() for c in namespace):
            raise ValueError(f"namespace must be 1..200 non-blank characters: {namespace!r}")
        codec.encode(np.zeros(1, np.float32), dtype)  # fail fast on an unknown dtype
        self.store = store
        self.namespace = namespace
        self.dtype: codec.Dtype = dtype
        self.errors = errors or ErrorLog(f"cache namespace {namespace}")
        self._wall_clock = wall_clock
        self.links = EntityLinks(store, namespace, self.errors)

    def key(self, text: str) -> str:
        """``{namespace}:{blake2b-256(text)}`` (the text is valid Unicode: the cache checks)."""
        digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=32)
        return f"{self.namespace}:{digest.hexdigest()}"

    def encode_one(self, row: Row) -> bytes:
        return codec.encode(row, self.dtype)

    async def write(
        self,
        pairs: Sequence[tuple[str, Row]],
        ttl_s: Mapping[str, float],
        keys: Mapping[str, str] | None = None,
        links: Sequence[tuple[str, str, str]] = (),
    ) -> bool:
        """Write ``(text, row)`` pairs (a text given twice: the last row); ``keys`` are store
        keys the caller hashed already. Otherwise as ``write_rows``."""
        unique = dict(pairs)
        texts, known = list(unique), keys or {}
        hashed = [known.get(t) or self.key(t) for t in texts]
        return await self.write_rows(texts, list(unique.values()), ttl_s, hashed, links)

    async def write_rows(
        self,
        texts: Sequence[str],
        rows: Rows,
        ttl_s: Mapping[str, float],
        keys: Sequence[str] | None = None,
        links: Sequence[tuple[str, str, str]] = (),
    ) -> bool:
        """Write ``rows[i]`` as the vector of ``texts[i]`` (distinct texts), each with its TTL
        from ``ttl_s`` when it has one; ``keys``: their store keys, when the caller hashed
        them already. ``links``: ``(kind, id, text)`` of entities to link to their text's
        vector, in the same store call as the vectors (one transaction on LMDB: a link never
        lands before its vector; a link's text may also be one stored before, not among
        ``texts``); vectors the entities were linked to before are dropped after. False when
        the store failed (absorbed and counted)."""
        if not len(texts):
            return True
        now = self._wall_clock()
        expiry = None
        if ttl_s:
            expiry = [None if (ttl := ttl_s.get(t)) is None else now + ttl for t in texts]
        hashed = list(map(self.key, texts)) if keys is None else keys
        if len(hashed) != len(texts) or len(rows) != len(texts):
            raise ValueError(f"{len(hashed)} keys and {len(rows)} rows for {len(texts)} texts")
        entries = codec.RowEntries(hashed, rows, self.dtype, expiry)
        changed: list[tuple[str, bytes]] = []
        stale: list[str] = []
        try:
            if links:
                known = dict(zip(texts, hashed, strict=True))
                entities = [(kind, entity_id) for kind, entity_id, _ in links]
                targets = [known.get(t) or self.key(t) for *_, t in links]
                changed, stale = await self.links.plan(entities, targets)
            if isinstance(self.store, CacheStore):  # encoded by the store (a writer child)
                await self.store.amset_rows(entries, changed)
            else:
                await self.store.amset([*entries.entries(), *changed])
            if stale:
                await self.store.amdelete(stale)
        except Exception as exc:
            self.errors.record("mset", exc)
            return False
        return True
