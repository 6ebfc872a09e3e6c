"""GPU support: a faiss-gpu replica of the table's flat index for whole-index searches, and
a torch mirror of what ``recommend`` reads, for a first pass over batches of orders.

``Replica``: used when the installed faiss has GPU support (the ``faiss-gpu`` wheels;
``faiss-cpu`` has none) and sees a GPU. The CPU index stays the one copy the table edits;
the replica is built with ``faiss.index_cpu_to_gpu`` on first use and again after vectors
change.

``DeviceFleet``: every slot's vector (in float16), unit 3-vector of its position (NaN where
no available driver is), constraint bits and cargo limits on a CUDA device (torch), refreshed
from the table before each batch (only the slots changed since, ``touch``). ``first_pass``
answers a batch of orders in a few kernels over the whole fleet: one matrix product scores
every driver for every order (FAISS GPU indexes ignore ID selectors, FACTS.md, so this is
torch), masks keep the available, eligible drivers in each circle, and a top-k per order sets
the bar. The device rounds the vectors to float16 and sums in another order than FAISS's CPU
kernel, so it is a *bounded* first pass: its score of a driver is within ``error(q)`` of the
real float32 one (``DeviceFleet.error``), so every driver whose device score is below the k-th
best device score minus twice that bound scores below k others exactly, and only the others
come back to be scored on the CPU by FAISS's own kernel. Drivers within ``geo.COS_BAND`` of
the circle come back too, for the haversine test. The answer is the CPU's, bit for bit
(tests/test_index_gpu.py).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

# What the table gives the mirror per slot (``DeviceFleet.sync``'s ``read``): "vectors"
# (float32), "xyz" (float64 unit 3-vector of the position), "available" (bool), "cbits"
# (uint64), "cargo" (float64, 3).
Columns = dict[str, npt.NDArray[Any]]

_log = logging.getLogger(__name__)

# GPU k-selection handles k up to this; larger searches run on the CPU index.
MAX_GPU_K = 2048


def why_not() -> str | None:
    """None when a GPU replica can be built, else the reason it cannot."""
    if not hasattr(faiss, "StandardGpuResources"):
        return "this faiss has no GPU support (install faiss-gpu instead of faiss-cpu)"
    if faiss.get_num_gpus() < 1:
        return "faiss sees no GPU"
    return None


def available() -> bool:
    return why_not() is None


class Replica:
    """A lazily (re)built GPU copy of a CPU flat index."""

    def __init__(self, device: int = 0) -> None:
        self._res: Any = faiss.StandardGpuResources()
        self._device = device
        self._index: Any = None

    def invalidate(self) -> None:
        self._index = None

    def search(
        self, flat: faiss.IndexFlatIP, query: npt.NDArray[np.float32], k: int
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        if k > MAX_GPU_K:
            return flat.search(query, k)
        if self._index is None:
            self._index = faiss.index_cpu_to_gpu(self._res, self._device, flat)
        return self._index.search(query, k)


def why_no_device(device: str) -> str | None:
    """None when ``DeviceFleet`` can run on ``device`` (a torch device: "cuda", "cuda:1";
    "cpu" runs the same code on the CPU, for tests), else the reason."""
    try:
        torch = importlib.import_module("torch")
    except ImportError:
        return "torch is not installed"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


@dataclass(frozen=True)
class Orders:
    """A batch of orders as ``DeviceFleet.first_pass`` needs them, one row per order."""

    centres: npt.NDArray[np.float64]  # (m, 3) unit 3-vectors of the pickups
    limits: npt.NDArray[np.float64]  # cos(radius / R)
    masks: npt.NDArray[np.int64]  # constraint bits every candidate must have (uint64 bits)
    cargo: npt.NDArray[np.float64]  # (m, 3) weight, volume, height needed; -inf: no cargo
    vectors: npt.NDArray[np.float32]  # (m, dim) the orders' unit embeddings
    ks: npt.NDArray[np.int64]

    def __len__(self) -> int:
        return len(self.ks)

    def take(self, rows: slice | npt.NDArray[np.int64]) -> Orders:
        return Orders(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass(frozen=True)
class Passed:
    """What the first pass keeps of one order: the number of available drivers surely inside
    the circle, the available drivers near its edge (haversine decides: ``band``), and the
    eligible drivers that may reach the top k (``slots``: surely inside or in the band)."""

    inside: int
    band: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int64]


class DeviceFleet:
    """What ``recommend`` reads of every slot, on a CUDA device; see the module docstring.

    Two passes answer a batch. The *top pass* keeps each order's best ``K`` eligible drivers
    surely inside its circle (``K`` at least twice its k) with, ahead of them, the drivers
    near its edge; its fixed shapes (batches padded to a power of two, the mirror's capacity)
    let it run as one captured CUDA graph, so that a batch costs one launch and two copies,
    not dozens of kernel launches from Python. An order is done there unless its survivors
    do not fit in ``K`` (near-ties); those orders go through the *dense pass*, which returns
    every survivor, however many.
    """

    def __init__(self, dim: int, device: str, unit_tolerance: float, cos_band: float) -> None:
        reason = why_no_device(device)
        if reason is not None:
            raise RuntimeError(f"no device fleet on {device}: {reason}")
        self._torch: Any = importlib.import_module("torch")
        self.dim, self.device = dim, self._torch.device(device)
        self._norm_max = 1.0 + unit_tolerance
        self._band = cos_band
        self._rows = 0  # slots mirrored
        self._tensors: dict[str, Any] = {}
        self._stale: set[int] | None = None  # None: everything
        self._vectors_stale: set[int] | None = None
        self._steps: dict[tuple[int, int], _TopStep] = {}  # (batch, K) -> its top pass
        # One memory pool for every captured pass: they run one at a time, on one stream.
        cuda = self.device.type == "cuda"
        self.graph_pool: Any = self._torch.cuda.graph_pool_handle() if cuda else None
        self.dense_orders = 0  # orders the dense pass answered (near-ties)
        # The top pass's masks in one Triton kernel where triton is installed (CUDA only).
        self._kernel: Any = _rank_kernel() if cuda else None

    def error(self, query: npt.NDArray[np.float32]) -> float:
        """``errors`` of one query."""
        return float(self.errors(query[None, :])[0])

    def errors(self, queries: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
        """For each query (rows), a bound on |device score - exact score| for it and any unit
        driver vector x (||x|| <= 1 + the table's tolerance), whatever the device's summation
        order.

        Both vectors are rounded to float16 (u16 = 2**-11 relative, or 2**-25 absolute
        where a component is subnormal): the products of the rounded vectors differ from the
        real ones by at most (2 u16 + u16**2) ||q|| ||x|| + 2**-25 (1 + u16) sqrt(d) (||q|| +
        ||x||) + d 2**-50 (Cauchy-Schwarz). Products of float16 numbers are exact in float32;
        their sum is accumulated in float32, within gamma(d) * ||q|| ||x|| (1 + u16)**2, and
        the bound takes u = 2**-20 for that sum instead of float32's 2**-24, so that tensor
        cores that truncate, or align a block of products before adding, stay inside it.
        """
        u16, tiny, d = 2.0**-11, 2.0**-25, self.dim
        q = queries.astype(np.float64)
        qn = np.sqrt(np.einsum("ij,ij->i", q, q))
        xn = self._norm_max
        rounding = (2 * u16 + u16 * u16) * qn * xn + tiny * (1 + u16) * math.sqrt(d) * (qn + xn)
        gamma = (d + 2) * _U_SUM / (1.0 - (d + 2) * _U_SUM)
        return (rounding + d * tiny * tiny + gamma * qn * xn * (1 + u16) ** 2) * (1.0 + 1e-6)

    def touch(self, slots: npt.ArrayLike, *, vectors: bool = False) -> None:
        """Slots whose columns (and, with ``vectors``, vectors) changed since the last batch."""
        items = np.asarray(slots, dtype=np.int64).ravel().tolist()
        if self._stale is not None:
            self._stale.update(items)
        if vectors and self._vectors_stale is not None:
            self._vectors_stale.update(items)

    def touch_all(self) -> None:
        self._stale = self._vectors_stale = None

    def sync(self, n: int, read: Callable[[npt.NDArray[np.int64], bool], Columns]) -> None:
        """Bring the mirror up to date for ``n`` slots; ``read(slots, with_vectors)`` gives
        the host values of those slots (``Columns``; "vectors" only ``with_vectors``)."""
        torch, dev = self._torch, self.device
        if n == self._rows and self._stale is not None and not self._stale:
            return  # nothing changed since the last batch
        if n > self._capacity():
            self.touch_all()
        if self._stale is None:
            cap = -(-max(n, 2 * self._capacity(), 1024) // _BLOCK) * _BLOCK
            self._drop_steps()  # their graphs read the tensors replaced here
            self._tensors = {
                "vectors": torch.zeros((cap, self.dim), dtype=torch.float16, device=dev),
                # NaN where no available driver is (nothing compares true with it)
                "xyz": torch.full((3, cap), np.nan, dtype=torch.float64, device=dev),  # by axis
                "cbits": torch.zeros(cap, dtype=torch.int64, device=dev),
                "cargo": torch.zeros((3, cap), dtype=torch.float64, device=dev),  # by column
            }
            for start in range(0, n, 65536):
                part = np.arange(start, min(n, start + 65536))
                self._put(part, read(part, True))
        else:
            stale = np.fromiter(self._stale, dtype=np.int64, count=len(self._stale))
            stale = stale[stale < n]
            moved = np.fromiter(self._vectors_stale or (), dtype=np.int64)
            with_vectors = np.isin(stale, moved)
            for slots, vectors in ((stale[~with_vectors], False), (stale[with_vectors], True)):
                if slots.size:
                    self._put(slots, read(slots, vectors))
            if n < self._rows:  # slots dropped (a delete moves the last slot into its place)
                self._tensors["xyz"][:, n : self._rows] = np.nan
        self._rows = n
        self._stale, self._vectors_stale = set(), set()

    def first_pass(self, orders: Orders) -> list[Passed]:
        """The batch's first pass (module and class docstrings); one answer per order, in
        order."""
        if self._rows == 0:
            return [Passed(0, _NONE, _NONE) for _ in range(len(orders))]
        out: list[Passed | None] = []
        for start in range(0, len(orders), _MAX_BATCH):
            out += self._top_pass(orders.take(slice(start, start + _MAX_BATCH)))
        redo = np.array([i for i, p in enumerate(out) if p is None], dtype=np.int64)
        if redo.size:
            self.dense_orders += redo.size
            for i, passed in zip(redo.tolist(), self._dense_pass(orders.take(redo)), strict=True):
                out[i] = passed
        return [p for p in out if p is not None]

    # -- the two passes ------------------------------------------------------------------------

    def _top_pass(self, orders: Orders) -> list[Passed | None]:
        """Each order's ``K`` best sure candidates; None where the dense pass must answer."""
        size = _bucket(len(orders), 1)
        k_top = _bucket(2 * int(orders.ks.max()), _LEAST_K)
        if k_top > self._capacity():
            return [None] * len(orders)
        try:
            values, slots, inside, near = self._step(size, k_top).run(orders)
        except Exception:  # the kernel does not build or run here: torch operations instead
            if self._kernel is None:
                raise
            _log.warning("the top pass's Triton kernel failed; torch runs it", exc_info=True)
            self._kernel = None
            self._drop_steps()
            values, slots, inside, near = self._step(size, k_top).run(orders)
        # Per order: the drivers near the edge (inf: eligible, float32 max: not), then the
        # eligible drivers surely inside by score, then -inf. Most orders have nobody near the
        # edge: theirs are decided together, the others one by one.
        out: list[Passed | None] = [None] * len(orders)
        alone = near > 0
        for j in np.flatnonzero(alone).tolist():
            out[j] = self._edge_order(j, orders, values[j], slots[j], int(inside[j]), int(near[j]))
        rows = np.flatnonzero(~alone)
        values, slots = values[rows], slots[rows]
        bars = self._bars(values[np.arange(rows.size), orders.ks[rows] - 1], orders.vectors[rows])
        keep = (values >= bars[:, None]) & (values > -np.inf)
        kept = np.where(keep, slots, np.iinfo(np.int64).max)
        kept.sort(axis=1)
        counts, full = keep.sum(axis=1).tolist(), keep[:, -1].tolist()
        for i, j in enumerate(rows.tolist()):
            if not full[i]:  # else the survivors may not end within K
                out[j] = Passed(int(inside[j]), _NONE, kept[i, : counts[i]])
        return out

    def _edge_order(
        self,
        j: int,
        orders: Orders,
        values: npt.NDArray[np.float32],
        slots: npt.NDArray[np.int64],
        inside: int,
        nb: int,
    ) -> Passed | None:
        """``_top_pass``'s answer for order ``j``, which has ``nb`` drivers near its edge."""
        k = int(orders.ks[j])
        if nb + k > len(values) or values[nb - 1] < _NOT_ELIGIBLE:
            return None  # not all of them fit
        real = values[nb:]
        bar = self._bars(real[k - 1 : k], orders.vectors[j : j + 1])[0]
        keep = (real >= bar) & (real > -np.inf)
        if keep[-1]:  # the survivors may not end within K
            return None
        band = slots[:nb]
        kept = np.concatenate([slots[nb:][keep], band[values[:nb] == np.inf]])
        return Passed(inside, np.sort(band), np.sort(kept))

    def _drop_steps(self) -> None:
        """Forget every captured pass. Their memory pool goes with the last of them, so
        later captures take a new one (torch's allocator asserts on capturing into a pool
        whose graphs are all gone)."""
        self._steps.clear()
        if self.device.type == "cuda":
            self.graph_pool = self._torch.cuda.graph_pool_handle()

    def _step(self, size: int, k_top: int) -> _TopStep:
        step = self._steps.get((size, k_top))
        if step is None:
            step = self._steps[(size, k_top)] = _TopStep(self, size, k_top)
        return step

    def top_tensors(self, inputs: Any, k_top: int) -> Any:
        """The top pass over the whole mirror, on device tensors only (so that it can be
        captured): ``inputs`` is the batch as ``_TopStep`` packs it; returns one float64 row
        per order: K values, K slots, the count inside, the count near the edge."""
        torch, t = self._torch, self._tensors
        q, f, mask = self._unpack(inputs)
        scores = self._scores(q)
        block_top = None
        if self._kernel is not None:
            ranked, block_top, inside, near = self._kernel.rank(
                torch, scores, t["xyz"], t["cbits"], t["cargo"], f, mask
            )
        else:
            ranked, inside, near = self._ranked(scores, f, mask)
        values, slots = _top(torch, ranked, k_top, block_top)
        counts = torch.stack([inside, near], dim=1)
        return torch.cat([values.double(), slots.double(), counts.double()], dim=1)

    def pack(self, host: npt.NDArray[np.int64], orders: Orders) -> None:
        """The orders as both passes read them, one row of int64 words each (``host`` has
        at least as many rows; rows past the orders are padding that matches nobody): the
        vector (float32), then float64 words: centre x, y, z, hi, lo, the cargo needs, then
        the constraint bits."""
        half, m = (self.dim + 1) // 2, len(orders)
        words = host[:, half:].view(np.float64)
        host[:, :half].view(np.float32)[:m, : self.dim] = orders.vectors
        words[:m, :3] = orders.centres
        words[:m, 3] = orders.limits + self._band  # at least this: surely inside
        words[:m, 4] = orders.limits - self._band  # above this and not inside: near the edge
        words[:m, 5:8] = orders.cargo
        host[:m, half + 8] = orders.masks
        host[m:] = 0
        words[m:, 3:5] = np.inf  # padding: nobody inside, nobody near

    def _width(self) -> int:
        return (self.dim + 1) // 2 + 9  # int64 words a packed order takes

    def _unpack(self, inputs: Any) -> tuple[Any, Any, Any]:
        """``pack``'s rows on the device as views: vectors, float64 words, constraint bits."""
        torch, half = self._torch, (self.dim + 1) // 2
        q = inputs[:, :half].view(torch.float32)[:, : self.dim]
        f = inputs[:, half : half + 8].view(torch.float64)  # centre, hi, lo, cargo need
        return q, f, inputs[:, half + 8 : half + 9]

    def _ranked(self, scores: Any, f: Any, mask: Any) -> tuple[Any, Any, Any]:
        """``rank_kernel.rank`` in torch operations: the ranking values (the drivers near the
        edge as inf, eligible, or float32 max, not; the eligible drivers surely inside by
        score; -inf), and the counts inside and near per order."""
        torch, t = self._torch, self._tensors
        dots = f[:, :3] @ t["xyz"]  # cos(d / R), float64; NaN where no available driver
        inside = dots >= f[:, 3:4]
        near = (dots > f[:, 4:5]) & ~inside
        del dots
        eligible = (t["cbits"][None] & mask) == mask
        for i in range(3):
            eligible &= t["cargo"][i][None] >= f[:, 5 + i : 6 + i]
        ranked = torch.where(inside & eligible, scores, -torch.inf)
        flags = torch.where(eligible, torch.inf, _NOT_ELIGIBLE).to(torch.float32)
        ranked = torch.where(near, flags, ranked)
        return ranked, inside.sum(dim=1), near.sum(dim=1)

    def _dense_pass(self, orders: Orders) -> list[Passed]:
        """Every survivor of each order, whatever their number: the top pass's ranking
        values (``_ranked``), a top-k of the scores to set each order's bar, and one copy back
        of what passed."""
        torch, n, m = self._torch, self._rows, len(orders)
        host = np.zeros((m, self._width()), dtype=np.int64)
        self.pack(host, orders)
        q, f, mask = self._unpack(torch.from_numpy(host).to(self.device))
        with _exact_products(torch):
            scores = self._scores(q)
        ranked, inside, _ = self._ranked(scores, f, mask)
        ranked = ranked[:, :n]
        near = ranked >= _NOT_ELIGIBLE  # the sentinels: available drivers near the edge
        real = torch.where(near, -torch.inf, ranked)  # eligible and surely inside: scores
        k_max = min(int(orders.ks.max()), n)
        best = real.topk(k_max, dim=1).values.cpu().numpy()
        kth = best[np.arange(m), np.minimum(orders.ks, k_max) - 1]
        bar = torch.from_numpy(self._bars(kth, orders.vectors)[:, None]).to(self.device)
        keep = ((real >= bar) & (real > -torch.inf)) | (ranked == torch.inf)
        kept, near_at_all = torch.nonzero(keep).cpu().numpy(), torch.nonzero(near).cpu().numpy()
        counts = inside.cpu().numpy()
        kept_at = np.searchsorted(kept[:, 0], np.arange(m + 1))
        near_at = np.searchsorted(near_at_all[:, 0], np.arange(m + 1))
        return [
            Passed(
                int(counts[j]),
                np.ascontiguousarray(near_at_all[near_at[j] : near_at[j + 1], 1]),
                np.ascontiguousarray(kept[kept_at[j] : kept_at[j + 1], 1]),
            )
            for j in range(m)
        ]

    def scores(self, queries: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The device scores of every mirrored slot for each query (rows): what both passes
        compare, within ``error`` of the exact ones."""
        torch = self._torch
        with _exact_products(torch):
            out = self._scores(torch.from_numpy(np.ascontiguousarray(queries)).to(self.device))
        return np.asarray(out[:, : self._rows].cpu().numpy())

    def _scores(self, q: Any) -> Any:
        """(batch, capacity) float32 device scores of every slot: float16 products summed in
        float32 (CUDA: one GEMM with float32 output; elsewhere the same in float32)."""
        torch, vectors = self._torch, self._tensors["vectors"]
        if self.device.type == "cuda":
            return torch.mm(q.half(), vectors.T, out_dtype=torch.float32)
        return q.half().float() @ vectors.float().T

    def _bars(
        self, kth: npt.NDArray[np.float32], vectors: npt.NDArray[np.float32]
    ) -> npt.NDArray[np.float32]:
        """The score a driver must reach (as float32 on the device) to be kept, for each
        order given its k-th best device score and its vector: k-th minus twice ``error``,
        in float64 and then rounded down to float32, so that comparing float32 scores with it
        keeps everyone the float64 comparison keeps; -inf where there is no k-th."""
        bars = (kth.astype(np.float64) - 2.0 * self.errors(vectors)).astype(np.float32)
        bars = np.nextafter(bars, np.float32(-np.inf))
        return np.where(np.isfinite(kth), bars, np.float32(-np.inf))

    # -- the mirror ----------------------------------------------------------------------------

    def _capacity(self) -> int:
        return 0 if not self._tensors else int(self._tensors["cbits"].shape[0])

    def _put(self, slots: npt.NDArray[np.int64], values: Columns) -> None:
        """The slots' columns, in one copy to the device (and the vectors in another)."""
        torch, t = self._torch, self._tensors
        host = np.empty((slots.size, 8), dtype=np.float64)  # slot, x, y, z, cargo, cbits
        words = host.view(np.int64)
        words[:, 0] = slots
        host[:, 1:4] = values["xyz"]
        host[:, 1:4][~values["available"]] = np.nan  # NaN where no available driver is
        host[:, 4:7] = values["cargo"]
        words[:, 7] = values["cbits"].view(np.int64)  # the same bits: torch has no uint64 `&`
        dev = torch.from_numpy(host).to(self.device)
        idx = dev.view(torch.int64)[:, 0]
        t["xyz"][:, idx] = dev[:, 1:4].T
        t["cargo"][:, idx] = dev[:, 4:7].T
        t["cbits"][idx] = dev.view(torch.int64)[:, 7]
        if "vectors" in values:
            t["vectors"][idx] = torch.from_numpy(values["vectors"]).to(self.device).half()


class _TopStep:
    """The top pass for batches of up to ``size`` orders and ``k_top`` kept each: its input
    and output buffers (pinned host memory on CUDA), and on CUDA the pass captured once as
    a graph over the mirror's tensors (dropped with them, ``DeviceFleet.sync``)."""

    def __init__(self, fleet: DeviceFleet, size: int, k_top: int) -> None:
        torch = fleet._torch
        self.fleet, self.size, self.k_top = fleet, size, k_top
        width, cuda = fleet._width(), fleet.device.type == "cuda"
        self.host_in = torch.zeros((size, width), dtype=torch.int64, pin_memory=cuda)
        self.host_out = torch.zeros((size, 2 * k_top + 2), dtype=torch.float64, pin_memory=cuda)
        self.inputs = torch.zeros((size, width), dtype=torch.int64, device=fleet.device)
        self.graph: Any = None
        if cuda:
            side = torch.cuda.Stream(fleet.device)
            side.wait_stream(torch.cuda.current_stream(fleet.device))
            with torch.cuda.stream(side), _exact_products(torch):
                fleet.top_tensors(self.inputs, k_top)  # cuBLAS and the allocator warmed up
            torch.cuda.current_stream(fleet.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: an engine thread of the same process (one-process serving) keeps
            # running its own CUDA work while this captures
            capture = torch.cuda.graph(
                self.graph, pool=fleet.graph_pool, capture_error_mode="thread_local"
            )
            with capture, _exact_products(torch):
                self.outputs = fleet.top_tensors(self.inputs, k_top)

    def run(self, orders: Orders) -> tuple[npt.NDArray[Any], ...]:
        """Per order: its K values (float32), their slots, the counts inside and near."""
        torch, fleet, k_top = self.fleet._torch, self.fleet, self.k_top
        m = len(orders)
        fleet.pack(self.host_in.numpy(), orders)
        self.inputs.copy_(self.host_in, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
            outputs = self.outputs
        else:
            with _exact_products(torch):
                outputs = fleet.top_tensors(self.inputs, k_top)
        self.host_out.copy_(outputs, non_blocking=True)
        if self.graph is not None:
            torch.cuda.current_stream(fleet.device).synchronize()
        out = self.host_out.numpy()[:m]
        return (
            out[:, :k_top].astype(np.float32),
            out[:, k_top : 2 * k_top].astype(np.int64),
            out[:, 2 * k_top],
            out[:, 2 * k_top + 1],
        )


_MAX_BATCH = 64  # orders in one top pass; larger batches take several
_LEAST_K = 64  # K at least this (near-ties of real embeddings fit)
_BLOCK = 1024  # the mirror's capacity is a multiple of this (``_top``'s blocks)
_NOT_ELIGIBLE = float(np.finfo(np.float32).max)  # a driver near the edge, not eligible
_NONE = np.zeros(0, dtype=np.int64)  # no slots (shared: read-only)
_NONE.setflags(write=False)
_U_SUM = 2.0**-20  # the unit roundoff ``DeviceFleet.error`` allows the device's float32 sums


def _top(torch: Any, ranked: Any, k: int, block_top: Any = None) -> tuple[Any, Any]:
    """Each row's k largest values and their columns, as ``topk`` but in two short steps
    when the rows are long: the k blocks of ``_BLOCK`` columns with the largest maxima hold
    every value above the k-th largest (any other block's values are at most the k-th
    largest maximum, and the k chosen blocks hold k values at least that), then a top-k
    of those k blocks. ``block_top``: the blocks' maxima, when already known."""
    rows, cols = ranked.shape
    if cols < 4 * k * _BLOCK:  # short rows: one top-k
        return ranked.topk(k, dim=1)
    blocks = ranked.view(rows, cols // _BLOCK, _BLOCK)
    if block_top is None:
        block_top = blocks.amax(dim=2)
    chosen = block_top.topk(k, dim=1).indices  # (rows, k)
    picked = blocks.gather(1, chosen[:, :, None].expand(rows, k, _BLOCK))
    values, at = picked.reshape(rows, k * _BLOCK).topk(k, dim=1)
    return values, chosen.gather(1, at // _BLOCK) * _BLOCK + at % _BLOCK


def _rank_kernel() -> Any:
    """``indexes.rank_kernel`` where triton can be imported, else None."""
    try:
        module = importlib.import_module("indexes.rank_kernel")
    except ImportError:
        return None
    return module if module.BLOCK == _BLOCK else None


def _bucket(n: int, least: int) -> int:
    """The power of two at least ``n`` and ``least``: the shapes graphs are captured for."""
    return max(least, 1 << max(0, n - 1).bit_length())


@contextlib.contextmanager
def _exact_products(torch: Any) -> Iterator[None]:
    """No TF32 and no float16 partial sums inside: ``DeviceFleet.error`` assumes float32
    accumulation."""
    cuda = torch.backends.cuda.matmul
    precision, reduced = (
        torch.get_float32_matmul_precision(),
        cuda.allow_fp16_reduced_precision_reduction,
    )
    torch.set_float32_matmul_precision("highest")
    cuda.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        cuda.allow_fp16_reduced_precision_reduction = reduced
