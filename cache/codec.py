"""Binary value format of one cached vector (never JSON).

Layout, little-endian, a 12-byte header then the payload::

    offset  size  field
    0       2     magic b"FV"
    2       1     format version (1)
    3       1     dtype code: 1 = float32, 2 = float16
    4       4     dim (uint32)
    8       4     crc32 of the payload (zlib.crc32)
    12      n     payload: dim values of the dtype, little-endian

A 384-d float32 vector is 12 + 1,536 = 1,548 bytes (float16: 780), against about 8,400 bytes
for LangChain's default JSON.

``decode`` raises :class:`CorruptEntryError` (a ``ValueError``) for anything it cannot trust:
too short, wrong magic or version, unknown dtype, a length that does not match ``dim``, a CRC
mismatch, or a ``dim`` other than ``expected_dim``. It never returns a partial vector. The
cache layer turns that error into a miss (and overwrites the entry with the recomputed value).

Decoded float32 vectors are read-only views over ``data`` (``np.frombuffer``, no copy); float16
entries are widened to a new float32 array.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt

MAGIC = b"FV"
VERSION = 1
HEADER = struct.Struct("<2sBBII")
HEADER_SIZE = HEADER.size  # 12

Dtype = Literal["float32", "float16"]
_CODES: dict[str, tuple[int, np.dtype[Any]]] = {
    "float32": (1, np.dtype("<f4")),
    "float16": (2, np.dtype("<f2")),
}
_BY_CODE = {code: dt for code, dt in _CODES.values()}


class CorruptEntryError(ValueError):
    """A stored value cannot be decoded into a vector of the expected dimension."""


def encoded_size(dim: int, dtype: Dtype = "float32") -> int:
    """Bytes one encoded vector takes (header included)."""
    return HEADER_SIZE + dim * _CODES[dtype][1].itemsize


def encode(vec: npt.ArrayLike, dtype: Dtype = "float32") -> bytes:
    """Encode one 1-d vector; ``dtype`` is the stored precision (float16 halves the size)."""
    try:
        code, np_dtype = _CODES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use 'float32' or 'float16'") from None
    arr = np.asarray(vec)
    if arr.ndim != 1:
        raise ValueError(f"expected a 1-d vector, got shape {arr.shape}")
    payload = np.ascontiguousarray(arr, dtype=np_dtype).tobytes()
    return HEADER.pack(MAGIC, VERSION, code, arr.shape[0], zlib.crc32(payload)) + payload


def decode(data: bytes, expected_dim: int | None = None) -> npt.NDArray[np.float32]:
    """Decode one entry to a float32 vector or raise :class:`CorruptEntryError`."""
    if len(data) < HEADER_SIZE:
        raise CorruptEntryError(f"entry too short ({len(data)} bytes)")
    magic, version, code, dim, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntryError("bad magic")
    if version != VERSION:
        raise CorruptEntryError(f"unsupported format version {version}")
    np_dtype = _BY_CODE.get(code)
    if np_dtype is None:
        raise CorruptEntryError(f"unknown dtype code {code}")
    if expected_dim is not None and dim != expected_dim:
        raise CorruptEntryError(f"dim {dim}, expected {expected_dim}")
    if len(data) != HEADER_SIZE + dim * np_dtype.itemsize:
        raise CorruptEntryError(f"length {len(data)} does not match dim {dim}")
    payload = memoryview(data)[HEADER_SIZE:]
    if zlib.crc32(payload) != crc:
        raise CorruptEntryError("crc mismatch")
    vec = np.frombuffer(data, dtype=np_dtype, offset=HEADER_SIZE)
    if vec.dtype != np.float32:  # float16, or float32 on a big-endian host
        return vec.astype(np.float32)
    return cast("npt.NDArray[np.float32]", vec)
