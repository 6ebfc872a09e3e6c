"""The fleet vector index: the only package that imports llama_index and faiss.

``FleetTable`` (the live fleet on FAISS with real upsert/delete, bulk ``move`` with stale
times dropped (``Moved``; times as ``timestamp_us``), ``recommend`` with geo and constraint
filtering, crash-safe snapshots), ``FleetVectorStore`` (a thin LlamaIndex vector
store over a table), ``GeoGrid`` (the spatial index the table uses) and ``BatchingEmbedding``
(a LlamaIndex embedding over any LangChain-style ``Embeddings``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from indexes import gpu
from indexes.columns import timestamp_us
from indexes.errors import FleetIndexError, SnapshotError, UnsupportedFilterError, VectorError
from indexes.geo import GeoGrid
from indexes.ranking import Candidate, Recommendation
from indexes.table import FleetTable, Moved, Prepared

if TYPE_CHECKING:
    from indexes.embedding import BatchingEmbedding, EmbeddingsLike
    from indexes.nodes import driver_node, record_from_node
    from indexes.store import FleetVectorStore

# The LlamaIndex side, imported on first use: llama_index.core alone takes 0.9 s to import on the
# 2-core box, and the processes that never touch it (HTTP workers, warm-up readers, the index
# owner) start that much sooner.
_LAZY = {
    "BatchingEmbedding": "indexes.embedding",
    "EmbeddingsLike": "indexes.embedding",
    "driver_node": "indexes.nodes",
    "record_from_node": "indexes.nodes",
    "FleetVectorStore": "indexes.store",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'indexes' has no attribute {name!r}")


__all__ = [
    "BatchingEmbedding",
    "Candidate",
    "EmbeddingsLike",
    "FleetIndexError",
    "FleetTable",
    "FleetVectorStore",
    "GeoGrid",
    "Moved",
    "Prepared",
    "Recommendation",
    "SnapshotError",
    "UnsupportedFilterError",
    "VectorError",
    "driver_node",
    "gpu",
    "record_from_node",
    "timestamp_us",
]
