"""DriverRecords in and out of JSONL, CSV and Parquet files (``warmup``, ``gen-fleet``).

Reading streams: a file of any size is read a line (JSONL, CSV) or a batch of ``chunk_size``
rows (Parquet) at a time, in constant memory. A bad row never stops the job: it comes back as
a ``Row`` whose ``error`` names the field (``vehicle.capacity_kg: Input should be greater than
or equal to 0``) and whose ``line`` says where it is, so warm-up can skip it and report it.

CSV and flat Parquet share one layout, ``FLAT_COLUMNS``: one column per field, named by its
dotted path (``position.lat``, ``vehicle.capacity_kg``, ``profile.certifications``). An empty
cell means "absent" (the model's default applies, or a required field is reported missing);
list cells are ``;``-separated; booleans read ``true/false/1/0/yes/no``. Parquet files may
instead use nested struct columns (``position``, ``vehicle``, ``profile``); both are read.
"""

from __future__ import annotations

import csv
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import ValidationError

from features.models import DriverRecord

Format = Literal["jsonl", "csv", "parquet"]
_EXTENSIONS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
}
FORMAT_SUFFIXES = _EXTENSIONS  # what file_format knows, by extension

FLAT_COLUMNS: tuple[str, ...] = (
    "driver_id",
    "status",
    "position.lat",
    "position.lng",
    "position.ts",
    "vehicle.vehicle_id",
    "vehicle.type",
    "vehicle.energy",
    "vehicle.capacity_kg",
    "vehicle.cargo_volume_m3",
    "vehicle.cargo_height_m",
    "vehicle.refrigerated",
    "vehicle.tail_lift",
    "profile.on_time_rate",
    "profile.damage_rate",
    "profile.service_score",
    "profile.completed_orders",
    "profile.certifications",
    "profile.languages",
    "profile.home_zone",
)
LIST_COLUMNS = frozenset({"profile.certifications", "profile.languages"})
LIST_SEPARATOR = ";"

# Typed columns, so that an all-empty column still has the right type in the file.
PARQUET_SCHEMA = pa.schema(
    [
        ("driver_id", pa.string()),
        ("status", pa.string()),
        ("position.lat", pa.float64()),
        ("position.lng", pa.float64()),
        ("position.ts", pa.timestamp("us", tz="UTC")),
        ("vehicle.vehicle_id", pa.string()),
        ("vehicle.type", pa.string()),
        ("vehicle.energy", pa.string()),
        ("vehicle.capacity_kg", pa.float64()),
        ("vehicle.cargo_volume_m3", pa.float64()),
        ("vehicle.cargo_height_m", pa.float64()),
        ("vehicle.refrigerated", pa.bool_()),
        ("vehicle.tail_lift", pa.bool_()),
        ("profile.on_time_rate", pa.float64()),
        ("profile.damage_rate", pa.float64()),
        ("profile.service_score", pa.float64()),
        ("profile.completed_orders", pa.int64()),
        ("profile.certifications", pa.list_(pa.string())),
        ("profile.languages", pa.list_(pa.string())),
        ("profile.home_zone", pa.string()),
    ]
)

_WRITE_BATCH = 10_000


@dataclass(slots=True)
class Row:
    """One row of an input file: a valid ``record`` or the ``error`` that rejected it, or
    neither when a ``keep`` filter passed it by (another reader's row: not validated).

    ``line`` is the 1-based line in a JSONL or CSV file (the CSV header is line 1) where the
    row starts, or the 1-based row number in a Parquet file. Not frozen: a frozen dataclass
    is built through ``object.__setattr__`` (0.64 us a row against 0.18 on the 2-core box),
    and each of a job's N readers builds one for every line of the file.
    """

    line: int
    record: DriverRecord | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def passed_by(self) -> bool:
        return self.record is None and self.error is None


Keep = Callable[[int, Any], bool]
"""``keep(line, data)``: whether this reader validates a row (``data``: the parsed JSON object
or the CSV/Parquet row as a dict, before validation). Several readers of one file each keep
their share (``proxy.warmup.Shard``)."""

KeepRaw = Callable[[int, bytes], bool | None]
"""``keep_raw(line, raw)``: the same decision from a JSONL line's bytes, before parsing, where
they settle it (None: parse the line and ask ``keep``). A reader then parses only its own
lines, not every line of the file (each of N readers parsed all of them: N times the JSON
work of the file). It must decide each line alike in every reader."""


def format_validation_error(exc: ValidationError) -> str:
    """``vehicle.capacity_kg: Input should be ...; driver_id: Field required``."""
    return "; ".join(
        f"{'.'.join(str(part) for part in err['loc']) or 'record'}: {err['msg']}"
        for err in exc.errors(include_url=False)
    )


def file_format(path: str | os.PathLike[str]) -> Format:
    """The format a file's extension names; ValueError listing the known ones otherwise."""
    suffix = Path(path).suffix.lower()
    try:
        return _EXTENSIONS[suffix]
    except KeyError:
        known = ", ".join(_EXTENSIONS)
        raise ValueError(
            f"cannot tell the format of {os.fspath(path)!r} from its extension "
            f"{suffix or '(none)'!r}; known: {known}"
        ) from None


def check_jsonl(path: str | os.PathLike[str], empty_ok: bool = True) -> None:
    """ValueError when a JSON Lines input (by its extension: ``.json`` too) holds one JSON
    array instead of a record a line: read as lines, each of its rows would only be rejected;
    or, unless ``empty_ok``, nothing but blanks. Reads up to its first non-blank byte."""
    if file_format(path) != "jsonl":
        return
    start = b""
    with open(path, "rb") as f:
        while not start and (chunk := f.read(4096)):
            start = chunk.lstrip()
    if not start and not empty_ok:
        raise ValueError("it holds no rows; send one DriverRecord a line")
    if start.removeprefix(b"\xef\xbb\xbf").startswith(b"["):
        raise ValueError(
            "it holds a JSON array; warm-up reads JSON Lines, one record a line (convert it "
            "with: jq -c '.[]' FILE > FILE.jsonl)"
        )


# ---- flat rows (CSV, Parquet) ------------------------------------------------------------


def to_flat_dict(record: DriverRecord) -> dict[str, Any]:
    """``{"driver_id": ..., "position.lat": ..., "profile.languages": [...]}`` in
    ``FLAT_COLUMNS`` order; values stay Python objects (lists, datetimes, None)."""
    nested = record.model_dump()
    flat: dict[str, Any] = {}
    for column in FLAT_COLUMNS:
        value: Any = nested
        for part in column.split("."):
            value = value[part]
        flat[column] = value
    return flat


def _drop_absent(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _drop_absent(v) for k, v in value.items() if v is not None and v != ""}
    return value


def from_flat_dict(flat: Mapping[str, Any]) -> DriverRecord:
    """The record a flat (dotted) or nested row describes; raises ``ValidationError``.

    Empty cells and None mean absent; a string in a list column is split on ``;``. Unknown
    columns are ignored, like unknown fields anywhere (API.md).
    """
    nested: dict[str, Any] = {}
    for raw_key, value in flat.items():
        key = raw_key.strip()
        if value is None or value == "":
            continue
        if key in LIST_COLUMNS and isinstance(value, str):
            value = [item.strip() for item in value.split(LIST_SEPARATOR) if item.strip()]
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                break  # "vehicle" given both as a scalar and as columns: the model says why
            node = child
        else:
            value = _drop_absent(value)
            if isinstance(value, dict) and isinstance(node.get(leaf), dict):
                node[leaf].update(value)  # a struct column plus dotted columns inside it
            else:
                node[leaf] = value
    return DriverRecord.model_validate(nested)


def _validated(
    line: int, build: Callable[[Any], DriverRecord], data: Any, keep: Keep | None = None
) -> Row:
    if keep is not None and not keep(line, data):
        return Row(line, None, None)
    try:
        return Row(line, build(data), None)
    except ValidationError as exc:
        return Row(line, None, format_validation_error(exc))


# ---- readers -------------------------------------------------------------------------------


def iter_rows(
    path: str | os.PathLike[str],
    chunk_size: int = 1000,
    keep: Keep | None = None,
    keep_raw: KeepRaw | None = None,
) -> Iterator[Row]:
    """Every row of a JSONL, CSV or Parquet file of DriverRecords, valid or not, in order;
    with ``keep``, the rows it passes by come back neither validated nor rejected (JSONL:
    ``keep_raw`` first, where it decides).

    The format comes from the extension (checked now, before any reading). ``chunk_size`` is
    the Parquet batch size; JSONL and CSV are read a line at a time. Blank lines are skipped.
    """
    fmt = file_format(path)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if fmt == "jsonl":
        return _iter_jsonl(Path(path), keep, keep_raw)
    if fmt == "csv":
        return _iter_csv(Path(path), keep)
    return _iter_parquet(Path(path), chunk_size, keep)


def _iter_jsonl(path: Path, keep: Keep | None, keep_raw: KeepRaw | None) -> Iterator[Row]:
    # Bytes, not text: an undecodable line is that line's error, not the end of the file.
    with path.open("rb") as file:
        for line_no, raw in enumerate(file, start=1):
            text = raw.removeprefix(b"\xef\xbb\xbf") if line_no == 1 else raw
            mine = keep_raw(line_no, text) if keep_raw is not None else None
            if mine is False:  # another reader's line (it holds an id: not blank)
                yield Row(line_no, None, None)
                continue
            if mine is None and not text.strip():
                continue
            own = None if mine else keep  # decided on its bytes: this reader's, valid or not
            try:
                data = orjson.loads(text)
            except orjson.JSONDecodeError as exc:
                data, error = None, f"invalid JSON: {exc}"
            else:
                error = f"expected a JSON object, got {type(data).__name__}"
            if not isinstance(data, dict):
                keeps = own is None or own(line_no, None)
                yield Row(line_no, None, error if keeps else None)
                continue
            yield _validated(line_no, DriverRecord.model_validate, data, own)


def _iter_csv(path: Path, keep: Keep | None) -> Iterator[Row]:
    # utf-8-sig: spreadsheets write a BOM; errors="replace": a bad byte spoils a cell, not
    # the rest of the file.
    with path.open(newline="", encoding="utf-8-sig", errors="replace") as file:
        reader = csv.reader(file)
        try:
            header = [name.strip() for name in next(reader)]
        except StopIteration:
            return
        while True:
            start = reader.line_num + 1
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                keeps = keep is None or keep(start, None)
                yield Row(start, None, f"invalid CSV: {exc}" if keeps else None)
                if reader.line_num < start:
                    return  # the reader cannot move past it
                continue
            if not cells:
                continue
            if len(cells) > len(header):
                error = f"row has {len(cells)} cells, the header has {len(header)}"
                yield Row(start, None, error if keep is None or keep(start, None) else None)
                continue
            yield _validated(start, from_flat_dict, dict(zip(header, cells, strict=False)), keep)


def _iter_parquet(path: Path, chunk_size: int, keep: Keep | None) -> Iterator[Row]:
    row_no = 0
    with pq.ParquetFile(path) as parquet:
        for batch in parquet.iter_batches(batch_size=chunk_size):
            for data in batch.to_pylist():
                row_no += 1
                yield _validated(row_no, from_flat_dict, data, keep)


# ---- writers -------------------------------------------------------------------------------


def write_jsonl(records: Iterable[DriverRecord], path: str | os.PathLike[str]) -> int:
    """One JSON object per line, as the API sends them; returns how many were written."""
    count = 0
    with Path(path).open("wb") as file:
        for record in records:
            file.write(record.model_dump_json().encode() + b"\n")
            count += 1
    return count


def _csv_cell(column: str, value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)  # shortest text that reads back as the same float
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, list):
        if any(LIST_SEPARATOR in item for item in value):
            raise ValueError(f"{column}: an item contains {LIST_SEPARATOR!r}: {value!r}")
        return LIST_SEPARATOR.join(value)
    return str(value)


def write_csv(records: Iterable[DriverRecord], path: str | os.PathLike[str]) -> int:
    """``FLAT_COLUMNS`` with a header row; ValueError if a list item contains ``;``."""
    count = 0
    with Path(path).open("w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(FLAT_COLUMNS)
        for record in records:
            flat = to_flat_dict(record)
            writer.writerow([_csv_cell(column, flat[column]) for column in FLAT_COLUMNS])
            count += 1
    return count


def write_parquet(records: Iterable[DriverRecord], path: str | os.PathLike[str]) -> int:
    """Flat ``PARQUET_SCHEMA`` columns, written in row groups of 10,000 records.

    ``position.ts`` is a UTC timestamp column: a naive timestamp is stored as if it were UTC.
    """
    count = 0
    records = iter(records)
    with pq.ParquetWriter(path, PARQUET_SCHEMA) as writer:
        while batch := [to_flat_dict(r) for r in itertools.islice(records, _WRITE_BATCH)]:
            writer.write_table(pa.Table.from_pylist(batch, schema=PARQUET_SCHEMA))
            count += len(batch)
    return count


def write_records(records: Iterable[DriverRecord], path: str | os.PathLike[str]) -> int:
    """Write in the format the extension names (``file_format``); returns the count."""
    writers = {"jsonl": write_jsonl, "csv": write_csv, "parquet": write_parquet}
    return writers[file_format(path)](records, path)
