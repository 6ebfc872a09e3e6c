"""An int8 copy of the store's vectors, for a first pass of ``recommend`` that reads a quarter
of the bytes, with a proven bound on its error so the final answer stays exact.

Row r is kept as codes ``c`` (int8, -127..127) and a scale ``s`` (float32, ``max|x| / 127``),
standing for ``s * c``; ``err[r]`` is ``||x - s * c||`` (rounded up). For a query q the first
pass computes ``approx = s * (c . q)`` in float32. Then, for the float32 score ``exact`` that
FAISS computes for the row::

    |approx - exact| <= ||q|| * err[r]                     (Cauchy-Schwarz, real numbers)
                      + gamma * ||q|| * (||s c|| + ||x||)   (rounding of both float32 sums)

with gamma = (dim + 2) * 2**-24 / (1 - (dim + 2) * 2**-24), the classical bound on a
float32 dot product summed in any order (BLAS or FAISS, FMA or not) and one more product.
``bounds`` returns that per-row epsilon. Rows are unit vectors (the store checks their norm to
within ``unit_tolerance``), so ``||x|| <= 1 + tol`` and ``||s c|| <= ||x|| + err``.

Rows follow the store's slots: ``put`` on upsert, ``copy_row`` on a swap-remove; rows past
the live slots are ignored. Not persisted: a load rebuilds it from the vectors.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_EPS32 = 2.0**-24  # unit roundoff of float32
_CHUNK = 512  # rows per gather + cast + matvec: the float32 buffer stays in the L2 cache


class QuantizedRows:
    """int8 codes, per-row scales and per-row error norms, with spare capacity."""

    def __init__(self, dim: int, unit_tolerance: float) -> None:
        self.dim = dim
        self._norm_max = 1.0 + unit_tolerance
        n = dim + 2
        self._gamma = n * _EPS32 / (1.0 - n * _EPS32)
        self.codes: npt.NDArray[np.int8] = np.zeros((0, dim), dtype=np.int8)
        self.scale: npt.NDArray[np.float32] = np.zeros(0, dtype=np.float32)
        self.err: npt.NDArray[np.float32] = np.zeros(0, dtype=np.float32)

    @property
    def bytes_per_row(self) -> int:
        return self.dim + self.scale.itemsize + self.err.itemsize

    def grow(self, need: int) -> None:
        """Make room for ``need`` rows (capacity at least doubles when it grows)."""
        if need <= len(self.scale):
            return
        size = max(need, 2 * len(self.scale), 64)
        for name in ("codes", "scale", "err"):
            old = getattr(self, name)
            new = np.zeros((size, *old.shape[1:]), dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def put(self, rows: npt.NDArray[np.int64], vectors: npt.NDArray[np.float32]) -> None:
        """Quantise ``vectors`` into ``rows`` (which must fit: see ``grow``).

        All in float32, in place in one scratch array (a load quantises a million rows). The
        error norm is computed in float32 too, then rounded up past its rounding: with
        u = 2**-24, each difference x - fl(s c) is off by at most u |s c| + u |x - s c|, and
        the norm by a relative (dim + 2) u, so ``||x - s c|| <= err32 (1 + (dim + 4) u)
        + 4 u (1 + tol)``.
        """
        if not len(rows):
            return
        top = np.maximum(vectors.max(axis=1), -vectors.min(axis=1))
        top[top == 0] = 1.0
        scale = (top / np.float32(127.0)).astype(np.float32)
        work = vectors * (np.float32(127.0) / top)[:, None]
        np.rint(work, out=work)
        np.clip(work, -127, 127, out=work)
        self.codes[rows] = work  # integral values: the cast is exact
        np.multiply(work, scale[:, None], out=work)  # s * c
        np.subtract(vectors, work, out=work)
        err = np.sqrt(np.einsum("ij,ij->i", work, work)).astype(np.float64)
        bound = err * (1.0 + (self.dim + 4) * _EPS32) + 4.0 * _EPS32 * self._norm_max
        self.scale[rows] = scale
        self.err[rows] = np.nextafter(bound.astype(np.float32), np.float32(np.inf))

    def copy_row(self, src: int, dst: int) -> None:
        self.codes[dst] = self.codes[src]
        self.scale[dst] = self.scale[src]
        self.err[dst] = self.err[src]

    def scores(self, query: npt.NDArray[np.float32], rows: npt.NDArray[np.int64]) -> npt.NDArray:
        """The approximate score of each row (float32), chunk by chunk."""
        out = np.empty(len(rows), dtype=np.float32)
        codes = np.empty((_CHUNK, self.dim), dtype=np.int8)
        floats = np.empty((_CHUNK, self.dim), dtype=np.float32)
        for start in range(0, len(rows), _CHUNK):
            part = rows[start : start + _CHUNK]
            m = len(part)
            np.take(self.codes, part, axis=0, out=codes[:m])
            np.copyto(floats[:m], codes[:m], casting="unsafe")
            np.matmul(floats[:m], query, out=out[start : start + m])
        out *= self.scale[rows]
        return out

    def bounds(self, query: npt.NDArray[np.float32], rows: npt.NDArray[np.int64]) -> npt.NDArray:
        """Per row, an upper bound on |approximate score - FAISS's float32 score| (float64)."""
        qnorm = float(np.linalg.norm(query.astype(np.float64))) * (1.0 + 1e-9)
        err = self.err[rows].astype(np.float64)
        rounding = self._gamma * (2.0 * self._norm_max + err)
        return qnorm * (err + rounding) * (1.0 + 1e-9)
