"""The embedding cache: the only package that imports LangChain.

``CachedEmbedder`` (embedder.py) runs LangChain's ``CacheBackedEmbeddings`` over a
``TieredByteStore`` (stores.py: memory LRU -> LMDB | Redis) with the binary vector codec
(codec.py), single-flight for identical texts in flight, and exact counters (stats.py);
entity -> key links (links.py) and namespace pruning (prune.py).
"""

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
