"""The fleet vector index: the only package that imports llama_index and faiss.

``FleetTable`` (the live fleet on FAISS with real upsert/delete, bulk ``move`` with stale
times dropped (``Moved``; times as ``timestamp_us``), ``recommend`` with geo and constraint
filtering, crash-safe snapshots), ``FleetVectorStore`` (a thin LlamaIndex vector
store over a table), ``GeoGrid`` (the spatial index the table uses) and ``BatchingEmbedding``
(a LlamaIndex embedding over any LangChain-style ``Embeddings``).
"""

from indexes import gpu
from indexes.columns import timestamp_us
from indexes.embedding import BatchingEmbedding, EmbeddingsLike
from indexes.errors import FleetIndexError, SnapshotError, UnsupportedFilterError, VectorError
from indexes.geo import GeoGrid
from indexes.nodes import driver_node, record_from_node
from indexes.ranking import Candidate, Recommendation
from indexes.store import FleetVectorStore
from indexes.table import FleetTable, Moved, Prepared

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
