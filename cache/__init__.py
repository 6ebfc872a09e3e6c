"""The embedding cache: the only package that imports LangChain.

``CachedEmbedder`` (embedder.py) runs LangChain's ``CacheBackedEmbeddings`` over a
``TieredByteStore`` (stores.py: memory LRU -> LMDB | Redis) with the binary vector codec
(codec.py), single-flight for identical texts in flight, and exact counters (stats.py).
"""

from cache.codec import CorruptEntryError
from cache.embedder import CachedEmbedder, ComputeFn, EmbedResult
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
    "LmdbByteStore",
    "MemoryByteStore",
    "RedisByteStore",
    "TieredByteStore",
    "build_store",
]
