"""How drivers look to LlamaIndex: one driver is one document is one node, id = driver_id.

A node's metadata carries the full record as JSON under ``"record"`` (hidden from embedding and
LLM text) plus flat copies of the filterable fields. Metadata filters (``MetadataFilters``) are
translated here into a predicate on ``DriverRecord``; anything we cannot evaluate exactly is an
``UnsupportedFilterError`` that names it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from llama_index.core.schema import BaseNode, TextNode
from llama_index.core.vector_stores.types import (
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)
from pydantic import ValidationError

from features.models import DriverRecord
from indexes.errors import FleetIndexError, UnsupportedFilterError

RECORD_KEY = "record"

RecordPredicate = Callable[[DriverRecord], bool]

# Filterable metadata keys and how to read each from a record.
_FIELDS: dict[str, Callable[[DriverRecord], Any]] = {
    "driver_id": lambda r: r.driver_id,
    "vehicle_id": lambda r: r.vehicle.vehicle_id,
    "status": lambda r: r.status,
    "vehicle_type": lambda r: r.vehicle.type,
    "energy": lambda r: r.vehicle.energy,
    "refrigerated": lambda r: r.vehicle.refrigerated,
    "tail_lift": lambda r: r.vehicle.tail_lift,
}
_BOOL_FIELDS = frozenset({"refrigerated", "tail_lift"})
_OPERATORS = (FilterOperator.EQ, FilterOperator.NE, FilterOperator.IN, FilterOperator.NIN)


def node_metadata(record: DriverRecord) -> dict[str, Any]:
    vehicle = record.vehicle
    return {
        RECORD_KEY: record.model_dump_json(),
        "driver_id": record.driver_id,
        "vehicle_id": vehicle.vehicle_id,
        "status": record.status,
        "vehicle_type": vehicle.type,
        "energy": vehicle.energy,
        "refrigerated": vehicle.refrigerated,
        "tail_lift": vehicle.tail_lift,
        "capacity_kg": vehicle.capacity_kg,
        "cargo_volume_m3": vehicle.cargo_volume_m3,
        "cargo_height_m": vehicle.cargo_height_m,
        "lat": record.position.lat,
        "lng": record.position.lng,
    }


def driver_node(record: DriverRecord, embedding: npt.ArrayLike | None = None) -> TextNode:
    """The LlamaIndex node of a driver (what ``FleetVectorStore.add`` takes and ``query`` gives).

    The store keeps no text: the embedded text is ``features``' canonical rendering, produced
    before the vector reaches the store.
    """
    return TextNode(
        id_=record.driver_id,
        text="",
        embedding=None if embedding is None else np.asarray(embedding, dtype=float).tolist(),
        metadata=node_metadata(record),
        excluded_embed_metadata_keys=[RECORD_KEY],
        excluded_llm_metadata_keys=[RECORD_KEY],
    )


def record_from_node(node: BaseNode) -> DriverRecord:
    """Read the DriverRecord a node carries: ``metadata["record"]`` (JSON text or a dict), or
    else the metadata itself in ``DriverRecord`` shape. Its driver_id must be the node id."""
    meta = node.metadata
    try:
        raw = meta.get(RECORD_KEY)
        if isinstance(raw, str | bytes):
            record = DriverRecord.model_validate_json(raw)
        elif isinstance(raw, dict):
            record = DriverRecord.model_validate(raw)
        else:
            record = DriverRecord.model_validate({"driver_id": node.node_id, **meta})
    except ValidationError as exc:
        raise FleetIndexError(
            f"node {node.node_id!r}: metadata does not hold a DriverRecord "
            f"(put its JSON under {RECORD_KEY!r}): {exc}"
        ) from exc
    if record.driver_id != node.node_id:
        raise FleetIndexError(
            f"node id {node.node_id!r} differs from its record's driver_id "
            f"{record.driver_id!r}: a driver node's id is its driver_id"
        )
    return record


def compile_filters(filters: MetadataFilters) -> RecordPredicate:
    """A predicate equivalent to ``filters``; raises UnsupportedFilterError up front."""
    parts = [
        compile_filters(f) if isinstance(f, MetadataFilters) else _compile_one(f)
        for f in filters.filters
    ]
    condition = filters.condition or FilterCondition.AND
    if condition == FilterCondition.AND:
        return lambda r: all(p(r) for p in parts)
    if condition == FilterCondition.OR:
        return lambda r: any(p(r) for p in parts)
    raise UnsupportedFilterError(
        f"unsupported filter condition {condition.value!r}; supported: 'and', 'or'"
    )


def _compile_one(flt: MetadataFilter) -> RecordPredicate:
    key, op = flt.key, flt.operator
    get = _FIELDS.get(key)
    if get is None:
        raise UnsupportedFilterError(
            f"unsupported filter key {key!r} (operator {op.value!r}); "
            f"filterable keys: {', '.join(sorted(_FIELDS))}"
        )
    if op not in _OPERATORS:
        raise UnsupportedFilterError(
            f"unsupported filter operator {op.value!r} on {key!r}; "
            f"supported: {', '.join(o.value for o in _OPERATORS)}"
        )
    if op in (FilterOperator.IN, FilterOperator.NIN):
        if not isinstance(flt.value, list):
            raise UnsupportedFilterError(f"filter {key!r} {op.value!r} needs a list value")
        allowed = frozenset(_coerce(key, v) for v in flt.value)
        if op == FilterOperator.IN:
            return lambda r: get(r) in allowed
        return lambda r: get(r) not in allowed
    if isinstance(flt.value, list):
        raise UnsupportedFilterError(f"filter {key!r} {op.value!r} needs a single value")
    want = _coerce(key, flt.value)
    if op == FilterOperator.EQ:
        return lambda r: get(r) == want
    return lambda r: get(r) != want


def _coerce(key: str, value: Any) -> Any:
    """Booleans arrive as 1/0 or "true"/"false": MetadataFilter's strict types refuse bool."""
    if key not in _BOOL_FIELDS or isinstance(value, bool):
        return value
    if value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise UnsupportedFilterError(f"filter {key!r} needs a boolean (true/false, 1/0), got {value!r}")
