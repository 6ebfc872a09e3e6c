"""``recommend``'s ranking over the candidate slots a ``FleetTable`` found near the pickup.

Three steps, each a handful of numpy operations over the table's columns and rows, read in
place: ``eligible`` (constraint bits and cargo), then ``rank``: with many candidates an int8
first pass (``indexes.quantized``) keeps only those that may reach the top k, then one FAISS
inner-product call scores the survivors exactly, and ``top`` orders them by API.md's rules
(similarity desc, distance asc, driver_id asc). The first pass drops only candidates that
provably score below k others, so the answer is the same, bit for bit, with or without it.

The caller holds the table's lock: nothing here locks or changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import faiss
import numpy as np
import numpy.typing as npt

from features.constraints import CONSTRAINTS
from features.models import DriverRecord, Order
from indexes.columns import Columns
from indexes.quantized import QuantizedRows

Vectors = npt.NDArray[np.float32]
Slots = npt.NDArray[np.int64]
Distances = npt.NDArray[np.float64]

# recommend scores up to this many candidates exactly in one pass; above it (and above 4 k),
# an int8 first pass keeps only those that may reach the top k (a quarter of the bytes read).
_EXACT_UP_TO = 2048


@dataclass(frozen=True)
class Candidate:
    driver_id: str
    vehicle_id: str
    similarity: float
    distance_km: float


@dataclass(frozen=True)
class Recommendation:
    candidates: list[Candidate]
    considered: int  # available drivers inside the radius, before constraints and cargo


def eligible(
    cols: Columns,
    constraints: tuple[str, ...],
    slots: Slots,
    names: list[str],
    order: Order,
    record: Callable[[int], DriverRecord],
) -> npt.NDArray[np.bool_]:
    """Which of ``slots`` satisfy every named constraint and the order's cargo (equal fits).

    ``constraints`` are the names behind the column bits; a name registered after the table
    was built has no bit and is evaluated on ``record(slot)``.
    """
    keep = np.ones(slots.size, dtype=bool)
    mask = sum(1 << constraints.index(n) for n in names if n in constraints)
    if mask:
        need = np.uint64(mask)
        keep &= (cols.cbits[slots] & need) == need
    cargo = order.cargo
    if cargo is not None:
        limits = cols.cargo[slots]
        keep &= (
            (limits[:, 0] >= cargo.weight_kg)
            & (limits[:, 1] >= cargo.volume_m3)
            & (limits[:, 2] >= cargo.height_m)
        )
    for name in names:
        if name not in constraints:  # registered after this table was built
            pred = CONSTRAINTS[name]
            keep &= [pred(record(s)) for s in slots.tolist()]
    return keep


def rank(
    rows: Vectors,
    quant: QuantizedRows,
    q: Vectors,
    slots: Slots,
    dist: Distances,
    k: int,
    ids: Sequence[str],
    vehicles: Sequence[str],
) -> list[Candidate]:
    """The best k of the eligible ``slots`` (``dist`` their distances), exactly."""
    if slots.size > max(_EXACT_UP_TO, 4 * k):
        # Many candidates: drop those that provably cannot reach the top k (ties included),
        # by int8 scores and their error bounds (``indexes.quantized``).
        keep = may_reach_top(quant, q, slots, k)
        slots, dist = slots[keep], dist[keep]
    # Every remaining candidate gets a score (the tie rules need them all), computed in place
    # in the flat index by FAISS's own kernel: bit-identical to what a FAISS search of the
    # whole index reports for that driver (numpy's BLAS would round a row differently
    # depending on its place in the batch).
    sims = inner_products(rows, q, slots)
    return top(slots, sims, dist, k, ids, vehicles)


def may_reach_top(quant: QuantizedRows, q: Vectors, slots: Slots, k: int) -> npt.NDArray[np.bool_]:
    """Which of ``slots`` (more than k) may be among the k best by exact score, ties
    included: those whose upper bound reaches the k-th largest lower bound. Every other
    one scores strictly below at least k candidates, so it is in no top k."""
    approx = quant.scores(q, slots)
    eps = quant.bounds(q, slots)
    lower = approx - eps
    kth_lower = np.partition(lower, slots.size - k)[slots.size - k]
    return approx + eps >= kth_lower


def top(
    slots: Slots,
    sims: Vectors,
    dist: Distances,
    k: int,
    ids: Sequence[str],
    vehicles: Sequence[str],
) -> list[Candidate]:
    """The best k by (similarity desc, distance asc, driver_id asc); ``ids`` and ``vehicles``
    are indexed by slot."""
    if slots.size == 0:
        return []
    pool = np.arange(slots.size)
    if slots.size > k:
        # O(n) selection of the k best similarities plus everyone tied with the k-th.
        kth = -np.partition(-sims, k - 1)[k - 1]
        pool = np.flatnonzero(sims >= kth)
    pool = pool[np.lexsort((dist[pool], -sims[pool]))]
    if pool.size > k:
        # Keep exact (similarity, distance) ties with the k-th: driver_id decides below.
        last = pool[k - 1]
        tied = (sims[pool[k:]] == sims[last]) & (dist[pool[k:]] == dist[last])
        extra = tied.size if tied.all() else int(np.argmin(tied))  # leading run of ties
        pool = pool[: k + extra]
    entries = [
        (-float(sims[i]), float(dist[i]), ids[s], vehicles[s])
        for i, s in zip(pool.tolist(), slots[pool].tolist(), strict=True)
    ]
    entries.sort()
    return [Candidate(d, v, -neg_sim, km) for neg_sim, km, d, v in entries[:k]]


def inner_products(rows: Vectors, query: Vectors, slots: Slots) -> Vectors:
    """rows[slots] @ query in float32 with FAISS's kernel, reading the rows in place.

    One OpenMP thread: the kernel opens a parallel region over its one query, and on a busy
    2-core machine waiting for the second thread to wake up stalled calls for 10-150 ms.
    (``omp_set_num_threads`` applies to the calling thread only; restored after.)
    """
    slots = np.ascontiguousarray(slots, dtype=np.int64)
    out = np.empty(len(slots), dtype=np.float32)
    if len(slots):
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(1)
        try:
            faiss.fvec_inner_products_by_idx(  # type: ignore[attr-defined]  # not in the stubs
                faiss.swig_ptr(out),
                faiss.swig_ptr(query),
                faiss.swig_ptr(rows),
                faiss.swig_ptr(slots),
                len(query),
                1,
                len(slots),
            )
        finally:
            faiss.omp_set_num_threads(threads)
    return out
