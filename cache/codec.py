"""Binary value format of one cached vector (never JSON).

Layout, little-endian: a header, then the payload. Version 1 (no expiry) has a 12-byte
header; version 2 adds the expiry time, for entries written with a TTL::

    offset  size  field
    0       2     magic b"FV"
    2       1     format version (1 or 2)
    3       1     dtype code: 1 = float32, 2 = float16
    4       4     dim (uint32)
    8       4     crc32 (zlib.crc32) of every byte after this field
    12      8     version 2 only: expires_at, float64 seconds since the Unix epoch
    12|20   n     payload: dim values of the dtype, little-endian

A 384-d float32 vector is 12 + 1,536 = 1,548 bytes (20 + 1,536 = 1,556 with an expiry;
float16: 780 or 788), against about 8,400 bytes for LangChain's default JSON. ``encode``
writes version 1 unless given ``expires_at``; ``decode`` reads both.

``decode`` raises :class:`CorruptEntryError` (a ``ValueError``) for anything it cannot trust:
too short, wrong magic or version, unknown dtype, a length that does not match ``dim``, a CRC
mismatch (the expiry is covered by it), or a ``dim`` other than ``expected_dim``. It never
returns a partial vector. Given ``now``, it raises :class:`ExpiredEntryError` for a sound
entry whose expiry is at or before ``now``. The cache turns either into a miss (and
overwrites the entry with the recomputed value); only corruption counts as a store error.

Decoded float32 vectors are read-only views over ``data`` (``np.frombuffer``, no copy); float16
entries are widened to a new float32 array.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

MAGIC = b"FV"
VERSION = 1  # without an expiry
VERSION_EXPIRING = 2  # with an expiry
HEADER = struct.Struct("<2sBBII")
HEADER_SIZE = HEADER.size  # 12
EXPIRY = struct.Struct("<d")
_CRC = struct.Struct("<I")
_HEADER_SIZES = {VERSION: HEADER_SIZE, VERSION_EXPIRING: HEADER_SIZE + EXPIRY.size}

Dtype = Literal["float32", "float16"]
_CODES: dict[str, tuple[int, np.dtype[Any]]] = {
    "float32": (1, np.dtype("<f4")),
    "float16": (2, np.dtype("<f2")),
}
_BY_CODE = {code: dt for code, dt in _CODES.values()}


class CorruptEntryError(ValueError):
    """A stored value cannot be decoded into a vector of the expected dimension."""


class ExpiredEntryError(Exception):
    """A sound entry whose expiry time has passed (a miss, not a store error)."""


def encoded_size(dim: int, dtype: Dtype = "float32", *, expiring: bool = False) -> int:
    """Bytes one encoded vector takes (header included)."""
    header = _HEADER_SIZES[VERSION_EXPIRING if expiring else VERSION]
    return header + dim * _CODES[dtype][1].itemsize


def encode(
    vec: npt.ArrayLike, dtype: Dtype = "float32", *, expires_at: float | None = None
) -> bytes:
    """Encode one 1-d vector; ``dtype`` is the stored precision (float16 halves the size).

    ``expires_at`` (seconds since the epoch, as ``time.time()``) writes a version-2 entry.
    """
    try:
        code, np_dtype = _CODES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'float32' or 'float16'") from None
    arr = np.asarray(vec)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-d vector, got shape {arr.shape}")
    payload = np.ascontiguousarray(arr, dtype=np_dtype).tobytes()
    if expires_at is None:
        return HEADER.pack(MAGIC, VERSION, code, arr.shape[0], zlib.crc32(payload)) + payload
    if not math.isfinite(expires_at):
        raise ValueError(f"expires_at must be finite, got {expires_at}")
    body = EXPIRY.pack(expires_at) + payload
    return HEADER.pack(MAGIC, VERSION_EXPIRING, code, arr.shape[0], zlib.crc32(body)) + body


def encode_many(
    rows: Sequence[npt.ArrayLike] | npt.NDArray[Any],
    dtype: Dtype = "float32",
    *,
    expires_at: Sequence[float | None],
) -> list[bytes]:
    """``encode`` of each row (with its own expiry), all built in one buffer: the same bytes
    as ``[encode(r, dtype, expires_at=e) for r, e in zip(rows, expires_at)]``, several times
    faster for a write-back of hundreds of rows. ``rows``: a (n, dim) array, or n vectors."""
    if len(rows) != len(expires_at):
        raise ValueError(f"{len(expires_at)} expiry times for {len(rows)} rows")
    if len(rows) == 0:
        return []
    code, np_dtype = _CODES[dtype]
    matrix = np.ascontiguousarray(rows, dtype=np_dtype)  # no copy when it is one already
    if matrix.ndim != 2:
        raise ValueError(f"expected equal-length 1-d vectors, got shape {matrix.shape}")
    dated = [i for i, e in enumerate(expires_at) if e is not None]
    if not dated:
        return _entries(matrix, VERSION, code, None)
    expiry = np.array([expires_at[i] for i in dated], dtype="<f8")
    if not np.isfinite(expiry).all():
        raise ValueError(f"expires_at must be finite, got {expiry[~np.isfinite(expiry)][0]}")
    out: list[bytes] = [b""] * len(expires_at)
    plain = [i for i, e in enumerate(expires_at) if e is None]
    for at, version, dates in ((dated, VERSION_EXPIRING, expiry), (plain, VERSION, None)):
        if at:
            for i, entry in zip(at, _entries(matrix[at], version, code, dates), strict=True):
                out[i] = entry
    return out


@dataclass(frozen=True, slots=True)
class RowEntries:
    """Vectors to store as entries of this format under ``keys``, not encoded yet: the store
    that writes them encodes them (``CacheStore.amset_rows``), so that one whose writes run
    in another process (``proxy.lmdb_writer``) encodes there, off the sender's interpreter.
    ``matrix``: (n, dim) float32 (or n vectors); ``expires_at``: one per row, or None."""

    keys: Sequence[str]
    matrix: npt.NDArray[np.float32] | Sequence[npt.NDArray[np.float32]]
    dtype: Dtype = "float32"
    expires_at: Sequence[float | None] | None = None

    def entries(self) -> list[tuple[str, bytes]]:
        expiry = self.expires_at or [None] * len(self.keys)
        values = encode_many(self.matrix, self.dtype, expires_at=expiry)
        return list(zip(self.keys, values, strict=True))


def _entries(
    matrix: npt.NDArray[Any], version: int, code: int, expiry: npt.NDArray[np.float64] | None
) -> list[bytes]:
    """The rows of ``matrix`` as entries of ``version``, in one buffer: header, expiry,
    payload per row; then each row's crc32 of what follows its header."""
    n, dim = matrix.shape
    head = _HEADER_SIZES[version]
    size = dim * matrix.itemsize
    width = head + size
    buf = np.empty((n, width), dtype=np.uint8)
    buf[:, :8] = np.frombuffer(HEADER.pack(MAGIC, version, code, dim, 0)[:8], np.uint8)
    if expiry is not None:
        buf[:, HEADER_SIZE:head] = expiry.view(np.uint8).reshape(n, EXPIRY.size)
    buf[:, head:] = matrix.view(np.uint8).reshape(n, size)
    flat = buf.data.cast("B")
    crcs = [zlib.crc32(flat[i + HEADER_SIZE : i + width]) for i in range(0, n * width, width)]
    buf[:, 8:12] = np.array(crcs, dtype="<u4").view(np.uint8).reshape(n, 4)
    data = buf.tobytes()
    return [data[i : i + width] for i in range(0, n * width, width)]


def expires_at(data: bytes) -> float | None:
    """The expiry written in a version-2 entry; None for anything else (nothing checked)."""
    if len(data) < HEADER_SIZE + EXPIRY.size or data[:2] != MAGIC or data[2] != VERSION_EXPIRING:
        return None
    return cast("float", EXPIRY.unpack_from(data, HEADER_SIZE)[0])


def decode(
    data: bytes, expected_dim: int | None = None, *, now: float | None = None
) -> npt.NDArray[np.float32]:
    """Decode one entry to a float32 vector, or raise :class:`CorruptEntryError` (or
    :class:`ExpiredEntryError` when ``now`` is given and the entry expired)."""
    if len(data) < HEADER_SIZE:
        raise CorruptEntryError(f"entry too short ({len(data)} bytes)")
    magic, version, code, dim, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError("bad magic")
    header_size = _HEADER_SIZES.get(version)
    if header_size is None:
        raise CorruptEntryError(f"unsupported format version {version}")
    np_dtype = _BY_CODE.get(code)
    if np_dtype is None:
        raise CorruptEntryError(f"unknown dtype code {code}")
    if expected_dim is not None and dim != expected_dim:
        raise CorruptEntryError(f"dim {dim}, expected {expected_dim}")
    if len(data) != header_size + dim * np_dtype.itemsize:
        raise CorruptEntryError(f"length {len(data)} does not match dim {dim}")
    if zlib.crc32(memoryview(data)[HEADER_SIZE:]) != crc:
        raise CorruptEntryError("crc mismatch")
    if now is not None and version == VERSION_EXPIRING:
        (expiry,) = EXPIRY.unpack_from(data, HEADER_SIZE)
        if expiry <= now:
            raise ExpiredEntryError(f"expired {now - expiry:.3f} s ago")
    vec = np.frombuffer(data, dtype=np_dtype, offset=header_size)
    if vec.dtype != np.float32:  # float16, or float32 on a big-endian host
        return vec.astype(np.float32)
    return cast("npt.NDArray[np.float32]", vec)
