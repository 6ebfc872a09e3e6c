"""The fleet vector index: the only package that imports llama_index and faiss.

``FleetVectorStore`` (a LlamaIndex vector store on FAISS with real upsert/delete, geo and
constraint filtering, crash-safe snapshots), ``GeoGrid`` (the spatial index it uses) and
``BatchingEmbedding`` (a LlamaIndex embedding over any LangChain-style ``Embeddings``).
"""

from indexes import gpu
from indexes.embedding import BatchingEmbedding, EmbeddingsLike
from indexes.errors import FleetIndexError, SnapshotError, UnsupportedFilterError, VectorError
from indexes.geo import GeoGrid
from indexes.nodes import driver_node, record_from_node
from indexes.store import Candidate, FleetVectorStore, Recommendation

__all__ = [
    "BatchingEmbedding",
    "Candidate",
    "EmbeddingsLike",
    "FleetIndexError",
    "FleetVectorStore",
    "GeoGrid",
    "Recommendation",
    "SnapshotError",
    "UnsupportedFilterError",
    "VectorError",
    "driver_node",
    "gpu",
    "record_from_node",
]
