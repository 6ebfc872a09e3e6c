"""``recommend``'s ranking over the candidates a ``FleetTable`` found near the pickup.

Candidates are rows of the geo grid's arena (``indexes.geo``), where each available driver's
position, constraint bits, cargo limits and int8 vector lie in its cell's contiguous block.
Three steps, each a handful of numpy operations read in place: ``eligible`` (constraint bits
and cargo), then ``rank``: with many candidates an int8 first pass (``indexes.quantized``)
keeps only those that may reach the top k, then one FAISS inner-product call scores the
survivors exactly on the table's float32 rows, and ``top`` orders the best of them by API.md's
rules (similarity desc, distance asc, driver_id asc; distances computed for those only). The
first pass drops only candidates that provably score below k others, so the answer is the
same, bit for bit, with or without it.

The caller holds the table's lock: nothing here locks or changes anything.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import faiss
import numpy as np
import numpy.typing as npt

from features.constraints import CONSTRAINTS
from features.models import DriverRecord, Order
from indexes.geo import GeoGrid
from indexes.quantized import Quantizer

Vectors = npt.NDArray[np.float32]
Slots = npt.NDArray[np.int64]
Distances = npt.NDArray[np.float64]

# recommend scores up to this many candidates exactly in one pass; above it (and above 4 k),
# an int8 first pass keeps only those that may reach the top k: it reads a quarter of the
# bytes, in the arena's contiguous runs, where exact scoring reads scattered float32 rows.
_EXACT_UP_TO = 512
# ``best_scored`` sorts up to this many candidates whole (the same order ``top`` gives: the k
# smallest by (-similarity, distance, driver_id, vehicle_id)) instead of selecting first.
_SORT_UP_TO = 64


class Candidate(NamedTuple):  # a tuple: a batch builds hundreds, and a tuple is built fastest
    driver_id: str
    vehicle_id: str
    similarity: float
    distance_km: float


_new_candidate = partial(tuple.__new__, Candidate)  # from one (driver, vehicle, sim, km) tuple


@dataclass(frozen=True)
class Recommendation:
    candidates: list[Candidate]
    considered: int  # available drivers inside the radius, before constraints and cargo


def eligible(
    grid: GeoGrid,
    constraints: tuple[str, ...],
    rows: Slots,
    names: list[str],
    order: Order,
    record: Callable[[int], DriverRecord],
) -> npt.NDArray[np.bool_]:
    """Which of the arena ``rows`` satisfy every named constraint and the order's cargo
    (equal fits).

    ``constraints`` are the names behind the ``cbits`` bits; a name registered after the
    table was built has no bit and is evaluated on ``record(slot)``.
    """
    keep = np.ones(rows.size, dtype=bool)
    mask = sum(1 << constraints.index(n) for n in names if n in constraints)
    if mask:
        need = np.uint64(mask)
        keep &= (grid.column("cbits")[rows] & need) == need
    cargo = order.cargo
    if cargo is not None:
        limits = grid.column("cargo")[rows]
        keep &= (
            (limits[:, 0] >= cargo.weight_kg)
            & (limits[:, 1] >= cargo.volume_m3)
            & (limits[:, 2] >= cargo.height_m)
        )
    for name in names:
        if name not in constraints:  # registered after this table was built
            pred = CONSTRAINTS[name]
            keep &= [pred(record(s)) for s in grid.column("ids")[rows].tolist()]
    return keep


def rank(
    vectors: Vectors,
    grid: GeoGrid,
    quant: Quantizer,
    q: Vectors,
    rows: Slots,
    pickup: tuple[float, float],
    k: int,
    ids: Sequence[str],
    vehicles: Sequence[str],
) -> list[Candidate]:
    """The best k of the eligible arena ``rows``, exactly (``vectors``: the table's rows, by
    slot; ``pickup``: (lat, lng) distances are measured from)."""
    if rows.size > max(_EXACT_UP_TO, 4 * k):
        # Many candidates: drop those that provably cannot reach the top k (ties included),
        # by int8 scores and their error bounds (``indexes.quantized``).
        rows = rows[may_reach_top(grid, quant, q, rows, k)]
    return best_of(
        vectors,
        q,
        grid.column("ids")[rows],
        lambda chosen: grid.row_distances(rows[chosen], *pickup),
        k,
        ids,
        vehicles,
    )


def best_of(
    vectors: Vectors,
    q: Vectors,
    slots: Slots,
    distances: Callable[[npt.NDArray[np.intp]], Distances],
    k: int,
    ids: Sequence[str],
    vehicles: Sequence[str],
) -> list[Candidate]:
    """The best k of ``slots`` (every candidate that may reach the top k, and maybe more)
    by exact score; ``distances(i)`` gives the distances of ``slots[i]``."""
    # Every candidate gets a score (the tie rules need them all), computed in place in the
    # flat index by FAISS's own kernel: bit-identical to what a FAISS search of the whole
    # index reports for that driver (numpy's BLAS would round a row differently depending
    # on its place in the batch).
    return best_scored(slots, inner_products(vectors, q, slots), distances, k, ids, vehicles)


def best_scored(
    slots: Slots,
    sims: Vectors,
    distances: Callable[[npt.NDArray[np.intp]], Distances],
    k: int,
    ids: Sequence[str],
    vehicles: Sequence[str],
) -> list[Candidate]:
    """``best_of`` with the exact scores ``sims`` of ``slots`` already computed."""
    if slots.size <= _SORT_UP_TO:  # few (a device first pass's survivors): sort them all
        keys = zip(
            (-sims).tolist(),
            distances(np.arange(slots.size)).tolist(),
            [ids[s] for s in slots.tolist()],
            [vehicles[s] for s in slots.tolist()],
            strict=True,
        )
        return [Candidate(d, v, -neg_sim, km) for neg_sim, km, d, v in sorted(keys)[:k]]
    chosen = np.arange(slots.size)
    if slots.size > k:  # only the k best and those tied with the k-th can be chosen
        chosen = np.flatnonzero(sims >= -np.partition(-sims, k - 1)[k - 1])
    return top(slots[chosen], sims[chosen], distances(chosen), k, ids, vehicles)


def best_scored_many(
    slots: Slots,
    sims: Vectors,
    dist: Distances,
    sizes: Sequence[int],
    ks: Sequence[int],
    ids: Sequence[str],
    vehicles: Sequence[str],
) -> list[list[Candidate]]:
    """``best_scored`` of several orders at once: ``slots``, their exact scores ``sims`` and
    distances ``dist`` hold each order's candidates one after another (``sizes[j]`` of them
    for order j, who wants ``ks[j]``). One sort orders them all by (order, similarity desc,
    distance asc); an order whose top k holds an exact (similarity, distance) tie, or one
    with the next candidate, has its driver_ids decide, through ``best_scored`` alone."""
    m = len(sizes)
    row = np.repeat(np.arange(m), sizes)  # the order of each candidate, non-decreasing
    at = np.lexsort((dist, -sims, row))  # rows stay where they were, each sorted
    s, d = sims[at], dist[at]
    starts = np.cumsum(sizes) - sizes
    taken = np.arange(row.size) - starts[row] < np.asarray(ks, dtype=np.int64)[row]
    tied = (row[1:] == row[:-1]) & (s[1:] == s[:-1]) & (d[1:] == d[:-1]) & taken[:-1]
    alone = set(row[:-1][tied].tolist())
    chosen = slots[at[taken]].tolist()
    found = list(  # built in C: the generated ``Candidate.__new__`` is a Python call each
        map(
            _new_candidate,
            zip(
                map(ids.__getitem__, chosen),
                map(vehicles.__getitem__, chosen),
                s[taken].tolist(),
                d[taken].tolist(),
                strict=True,
            ),
        )
    )
    out, start = [], 0
    for j, (size, k) in enumerate(zip(sizes, ks, strict=True)):
        n = min(size, k)
        if j in alone:
            a, b = int(starts[j]), int(starts[j]) + size
            out.append(best_scored(slots[a:b], sims[a:b], dist[a:b].__getitem__, k, ids, vehicles))
        else:
            out.append(found[start : start + n])
        start += n
    return out


def may_reach_top(
    grid: GeoGrid, quant: Quantizer, q: Vectors, rows: Slots, k: int
) -> npt.NDArray[np.bool_]:
    """Which of the arena ``rows`` (more than k) may be among the k best by exact score,
    ties included: those whose upper bound reaches the k-th largest lower bound. Every other
    one scores strictly below at least k candidates, so it is in no top k."""
    approx = quant.scores(grid.column("codes"), grid.column("scale"), q, rows)
    eps = quant.bounds(grid.column("err"), q, rows)
    lower = approx - eps
    kth_lower = np.partition(lower, rows.size - k)[rows.size - k]
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
    """rows[slots] @ query in float32 with FAISS's kernel, reading the rows in place."""
    return inner_products_many(rows, query[None, :], slots, [slots.size])


def inner_products_many(
    rows: Vectors, queries: Vectors, slots: Slots, sizes: Sequence[int]
) -> Vectors:
    """rows[s] @ queries[i] for the ``sizes[i]`` slots s of each query (rows of ``queries``)
    in ``slots``, one query's after another, in one call of FAISS's kernel (each product the
    same bits as alone: the kernel computes every pair on its own).

    One OpenMP thread: the kernel opens a parallel region over its queries, and on a busy
    2-core machine waiting for the second thread to wake up stalled calls for 10-150 ms.
    (``omp_set_num_threads`` applies to the calling thread only; restored after.)
    """
    counts = np.asarray(sizes, dtype=np.int64)
    x = np.ascontiguousarray(queries, dtype=np.float32)
    if x.shape != (counts.size, rows.shape[1]) or slots.size != counts.sum():
        # the kernel reads as many queries and ids as it is told: a wrong count crashes
        raise ValueError(f"{x.shape} queries for {counts.size} groups of {slots.size} slots")
    width = int(counts.max(initial=0))
    if width == 0:
        return np.zeros(0, dtype=np.float32)
    used = np.arange(width) < counts[:, None]  # row-major: the slots one after another
    ids = np.full((counts.size, width), -1, dtype=np.int64)  # -1: no product (FAISS: -inf)
    ids[used] = slots
    out = np.empty((counts.size, width), dtype=np.float32)
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        faiss.fvec_inner_products_by_idx(  # type: ignore[attr-defined]  # not in the stubs
            faiss.swig_ptr(out),
            faiss.swig_ptr(x),
            faiss.swig_ptr(rows),
            faiss.swig_ptr(ids),
            x.shape[1],
            counts.size,
            width,
        )
    finally:
        faiss.omp_set_num_threads(threads)
    return out[used]
