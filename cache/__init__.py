"""The embedding cache: the only package that imports LangChain.

``CachedEmbedder`` (embedder.py) runs LangChain's ``CacheBackedEmbeddings`` over a
``TieredByteStore`` (stores.py: memory LRU -> LMDB | Redis) with the binary vector codec
(codec.py), single-flight for identical texts in flight, and exact counters (stats.py);
entity -> key links (links.py) and namespace pruning (prune.py).
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cache.codec import CorruptEntryError, ExpiredEntryError
    from cache.embedder import CachedEmbedder, EmbedResult, InvalidTextError
    from cache.flight import ComputeFn, Flight, Flown, SingleFlight
    from cache.links import Entity, EntityLinks
    from cache.stores import (
        CacheStore,
        LmdbByteStore,
        MemoryByteStore,
        RedisByteStore,
        TieredByteStore,
        build_store,
    )

# Each name from its module on first use (PEP 562): a process that needs only the stores
# (an LMDB partition's writer) does not import LangChain's embeddings (0.8 s, 80 MB).
_HOMES = {
    "CorruptEntryError": "codec",
    "ExpiredEntryError": "codec",
    "CachedEmbedder": "embedder",
    "EmbedResult": "embedder",
    "InvalidTextError": "embedder",
    "ComputeFn": "flight",
    "Flight": "flight",
    "Flown": "flight",
    "SingleFlight": "flight",
    "Entity": "links",
    "EntityLinks": "links",
    "CacheStore": "stores",
    "LmdbByteStore": "stores",
    "MemoryByteStore": "stores",
    "RedisByteStore": "stores",
    "TieredByteStore": "stores",
    "build_store": "stores",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'cache' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cache.{_HOMES[name]}"), name)


__all__ = [
    "CacheStore",
    "CachedEmbedder",
    "ComputeFn",
    "CorruptEntryError",
    "EmbedResult",
    "Entity",
    "EntityLinks",
    "ExpiredEntryError",
    "Flight",
    "Flown",
    "InvalidTextError",
    "LmdbByteStore",
    "MemoryByteStore",
    "RedisByteStore",
    "SingleFlight",
    "TieredByteStore",
    "build_store",
]
