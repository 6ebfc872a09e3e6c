"""``FleetVectorStore``: a ``FleetTable`` seen as a LlamaIndex vector store.

One driver is one document is one node (``indexes.nodes``), its id the driver_id. ``add``
upserts, ``delete``/``delete_nodes``/``clear`` delete, ``get_nodes`` and ``query`` read,
``persist`` saves a snapshot; LlamaIndex metadata filters become predicates on records. The
adapter holds no state of its own: everything lives in ``.table``, which the proxy and the
domain API (``upsert_drivers``, ``recommend``, ...) use directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
from llama_index.core.schema import BaseNode
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    MetadataFilters,
    VectorStoreQuery,
    VectorStoreQueryMode,
    VectorStoreQueryResult,
)
from pydantic import PrivateAttr

from indexes import snapshot
from indexes.errors import FleetIndexError, SnapshotError, VectorError
from indexes.nodes import RecordPredicate, compile_filters, driver_node, record_from_node
from indexes.table import FleetTable


class FleetVectorStore(BasePydanticVectorStore):
    """A LlamaIndex vector store over a ``FleetTable``: ``FleetVectorStore(dim)`` over a new
    table, or ``FleetVectorStore(table=table)`` over an existing one (both see every change).

    ``stores_text`` is True in LlamaIndex's sense: ``query`` returns complete nodes (record in
    the metadata), so no docstore is needed and ``VectorStoreIndex.from_vector_store`` accepts
    the store. It keeps no text of its own (the store never embeds).
    """

    stores_text: bool = True
    is_embedding_query: bool = True

    _table: FleetTable = PrivateAttr()

    def __init__(self, dim: int | None = None, *, table: FleetTable | None = None) -> None:
        super().__init__(stores_text=True)
        if table is None:
            if dim is None:
                raise ValueError("FleetVectorStore needs dim (for a new table) or table")
            table = FleetTable(dim)
        elif dim is not None:
            raise ValueError("FleetVectorStore takes dim or table, not both")
        self._table = table

    @classmethod
    def class_name(cls) -> str:
        return "FleetVectorStore"

    @property
    def table(self) -> FleetTable:
        """The drivers: the domain API (upsert_drivers, recommend, save, ...) lives there."""
        return self._table

    def __bool__(self) -> bool:
        # An empty store is still a store: LlamaIndex tests `if vector_store:` and would
        # silently swap an empty one for a SimpleVectorStore.
        return True

    def __eq__(self, other: object) -> bool:
        # Identity: a store equals only itself (pydantic's equality compares private state).
        return self is other

    __hash__ = object.__hash__

    @property
    def client(self) -> faiss.IndexFlatIP:
        """The FAISS index, row i = slot i (read it, don't mutate it)."""
        return self._table.flat

    def add(self, nodes: Sequence[BaseNode], **add_kwargs: Any) -> list[str]:
        """Upsert driver nodes: ``id_`` is the driver_id, the record is in the metadata."""
        records = [record_from_node(node) for node in nodes]
        try:
            vectors = [node.get_embedding() for node in nodes]
        except ValueError as exc:
            raise VectorError(f"every node needs an embedding: {exc}") from exc
        if records:
            self._table.upsert_drivers(records, vectors)
        return [node.node_id for node in nodes]

    def delete(self, ref_doc_id: str, **delete_kwargs: Any) -> None:
        """One driver is one document: ``ref_doc_id`` is the driver_id."""
        self._table.delete_driver(ref_doc_id)

    def delete_nodes(
        self,
        node_ids: list[str] | None = None,
        filters: MetadataFilters | None = None,
        **delete_kwargs: Any,
    ) -> None:
        if node_ids is None and filters is None:
            raise FleetIndexError("delete_nodes needs node_ids or filters (use clear() for all)")
        self._table.delete_drivers(node_ids, _predicate(filters))

    def get_nodes(
        self, node_ids: list[str] | None = None, filters: MetadataFilters | None = None
    ) -> list[BaseNode]:
        return [driver_node(r) for r in self._table.records(node_ids, _predicate(filters))]

    def clear(self) -> None:
        """Remove every driver. The id counter keeps counting: ids are never reused."""
        self._table.clear()

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        """Top ``similarity_top_k`` by inner product (cosine), optionally restricted to
        ``node_ids``/``doc_ids`` (driver ids) and ``filters``."""
        if query.mode != VectorStoreQueryMode.DEFAULT:
            raise FleetIndexError(f"query mode {query.mode.value!r} unsupported; use 'default'")
        if query.query_embedding is None:
            raise VectorError("query needs query_embedding")
        # An empty id list means "no restriction": VectorStoreIndex.as_retriever passes
        # node_ids=[] for every store that keeps its own nodes (as the other such stores do).
        restrict = _intersect(query.node_ids or None, query.doc_ids or None)
        hits = self._table.search(
            query.query_embedding,
            query.similarity_top_k,
            driver_ids=restrict,
            where=_predicate(query.filters),
        )
        nodes: list[BaseNode] = [driver_node(record) for record, _ in hits]
        return VectorStoreQueryResult(
            nodes=nodes,
            similarities=[score for _, score in hits],
            ids=[n.node_id for n in nodes],
        )

    def persist(self, persist_path: str, fs: Any | None = None) -> None:
        """Save a snapshot into the directory ``persist_path`` (local filesystem only)."""
        _require_local(fs)
        self._table.save(Path(persist_path))

    @classmethod
    def from_persist_path(
        cls, persist_path: str, fs: Any | None = None, *, dim: int | None = None
    ) -> FleetVectorStore:
        """Load a snapshot directory; ``dim`` defaults to the snapshot's own."""
        _require_local(fs)
        if dim is not None:
            return cls(table=FleetTable.load(Path(persist_path), dim))
        snap = snapshot.read(Path(persist_path))
        if snap is None:
            raise SnapshotError(f"no snapshot in {persist_path}: pass dim= for an empty store")
        return cls(table=FleetTable.from_snapshot(snap))


def _predicate(filters: MetadataFilters | None) -> RecordPredicate | None:
    """Filters as a predicate on records; UnsupportedFilterError before anything is read."""
    return None if filters is None else compile_filters(filters)


def _intersect(a: list[str] | None, b: list[str] | None) -> list[str] | None:
    if a is None or b is None:
        return a if b is None else b
    allowed = set(b)
    return [x for x in a if x in allowed]


def _require_local(fs: Any | None) -> None:
    if fs is None:
        return
    protocol = getattr(fs, "protocol", ())
    protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
    if "file" not in protocols and "local" not in protocols:
        raise FleetIndexError(f"FleetVectorStore persists to the local filesystem only, not {fs!r}")
