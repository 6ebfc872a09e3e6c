"""GPU support: a faiss-gpu replica of the table's flat index for whole-index searches, and
a torch mirror of what ``recommend`` reads, for a first pass over batches of orders.

``Replica``: used when the installed faiss has GPU support (the ``faiss-gpu`` wheels;
``faiss-cpu`` has none) and sees a GPU. The CPU index stays the one copy the table edits;
the replica is built with ``faiss.index_cpu_to_gpu`` on first use and again after vectors
change.

``DeviceFleet``: every slot's float32 vector, unit 3-vector of its position, availability,
constraint bits and cargo limits on a CUDA device (torch), refreshed from the table before
each batch (only the slots changed since, ``touch``). ``first_pass`` answers a batch of
orders in a few kernels over the whole fleet: one float32 matrix product scores every driver
for every order (FAISS GPU indexes ignore ID selectors, FACTS.md, so this is torch), masks
keep the available, eligible drivers in each circle, and a top-k per order sets the bar.
The GPU sums in another order than FAISS's CPU kernel, so it is a *bounded* first pass: both
float32 dot products are within ``gamma * ||q|| * ||x||`` of the real one (gamma = (d + 2)
u / (1 - (d + 2) u), u = 2**-24, any summation order; TF32 is switched off for the product),
so every driver whose GPU score is below the k-th best GPU score minus twice that bound
scores below k others exactly, and only the others come back to be scored on the CPU by
FAISS's own kernel. Points within ``geo.COS_BAND`` of the circle come back too, for the
haversine test. The answer is the CPU's, bit for bit (tests/test_index_gpu.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

_EPS32 = 2.0**-24
# What the mirror holds per slot: "vectors" (float32), "xyz" (float64 unit 3-vector of the
# position), "available" (bool), "cbits" (uint64), "cargo" (float64, 3).
Columns = dict[str, npt.NDArray[Any]]

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
class Query:
    """One order of a batch, as ``DeviceFleet.first_pass`` needs it."""

    centre: npt.NDArray[np.float64]  # unit 3-vector of the pickup
    limit: float  # cos(radius / R)
    mask: int  # constraint bits every candidate must have
    cargo: tuple[float, float, float] | None  # weight, volume, height
    vector: npt.NDArray[np.float32]  # the order's unit embedding
    k: int


@dataclass(frozen=True)
class Passed:
    """What the first pass keeps of one order: the number of available drivers surely inside
    the circle, the available drivers near its edge (haversine decides: ``band``), and the
    eligible drivers that may reach the top k (``slots``: surely inside or in the band)."""

    inside: int
    band: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int64]


class DeviceFleet:
    """What ``recommend`` reads of every slot, on a CUDA device; see the module docstring."""

    def __init__(self, dim: int, device: str, unit_tolerance: float, cos_band: float) -> None:
        reason = why_no_device(device)
        if reason is not None:
            raise RuntimeError(f"no device fleet on {device}: {reason}")
        self._torch: Any = importlib.import_module("torch")
        self.dim, self.device = dim, self._torch.device(device)
        n = dim + 2
        self._gamma = n * _EPS32 / (1.0 - n * _EPS32)
        self._norm_max = 1.0 + unit_tolerance
        self._band = cos_band
        self._rows = 0  # slots mirrored
        self._tensors: dict[str, Any] = {}
        self._stale: set[int] | None = None  # None: everything
        self._vectors_stale: set[int] | None = None

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
        torch = self._torch
        if n > self._capacity():
            self.touch_all()
        if self._stale is None:
            cap = max(n, 2 * self._capacity(), 1024)
            self._tensors = {
                "vectors": torch.zeros((cap, self.dim), dtype=torch.float32, device=self.device),
                "xyz": torch.zeros((cap, 3), dtype=torch.float64, device=self.device),
                "available": torch.zeros(cap, dtype=torch.bool, device=self.device),
                "cbits": torch.zeros(cap, dtype=torch.int64, device=self.device),
                "cargo": torch.zeros((cap, 3), dtype=torch.float64, device=self.device),
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
        self._rows = n
        self._stale, self._vectors_stale = set(), set()

    def first_pass(self, queries: list[Query]) -> list[Passed]:
        """The batch's first pass (module docstring); one answer per query, in order.

        Laid out (queries, slots), so that each query's row is contiguous for its top-k; a
        few dozen kernels for the whole batch, and one copy back of what survived."""
        torch, t = self._torch, self._tensors
        n, m = self._rows, len(queries)
        if n == 0:
            empty = np.zeros(0, dtype=np.int64)
            return [Passed(0, empty, empty) for _ in queries]
        dev = self.device
        q = torch.from_numpy(np.stack([x.vector for x in queries])).to(dev)
        centres = torch.from_numpy(np.stack([x.centre for x in queries])).to(dev)
        limits = torch.tensor([[x.limit] for x in queries], dtype=torch.float64, device=dev)
        masks = torch.tensor([[_signed(x.mask)] for x in queries], dtype=torch.int64, device=dev)
        no_cargo = (-np.inf, -np.inf, -np.inf)
        need = torch.tensor([x.cargo or no_cargo for x in queries], dtype=torch.float64, device=dev)
        precision = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")  # no TF32: the bound assumes float32
        try:
            scores = q @ t["vectors"][:n].T  # (m, n)
        finally:
            torch.set_float32_matmul_precision(precision)
        off = centres @ t["xyz"][:n].T - limits  # cos(d / R) - cos(r / R), float64
        available = t["available"][None, :n]
        inside = (off >= self._band) & available
        band = (off.abs() < self._band) & available
        del off
        cargo = t["cargo"][:n]
        eligible = (t["cbits"][None, :n] & masks) == masks
        for i in range(3):
            eligible &= cargo[None, :, i] >= need[:, i, None]
        sure = inside & eligible
        k_max = min(max(x.k for x in queries), n)
        best = torch.where(sure, scores, -torch.inf).topk(k_max, dim=1).values  # (m, k_max)
        ks = torch.tensor([[min(x.k, k_max) - 1] for x in queries], device=dev)
        kth = best.gather(1, ks)  # (m, 1)
        qnorm = torch.linalg.vector_norm(q.double(), dim=1, keepdim=True) * (1.0 + 1e-9)
        eps = 2.0 * self._gamma * self._norm_max * qnorm * (1.0 + 1e-9)
        # The bar in float64, rounded down to float32: comparing float32 scores with it
        # keeps everyone the float64 comparison keeps.
        bar = torch.where(torch.isfinite(kth), kth.double() - 2.0 * eps, -torch.inf)
        bar32 = torch.nextafter(bar.float(), torch.tensor(-torch.inf, device=dev))
        keep = (sure & (scores >= bar32)) | (band & eligible)
        counts = inside.sum(dim=1)
        kept, near = torch.nonzero(keep), torch.nonzero(band)
        counts, kept, near = counts.cpu().numpy(), kept.cpu().numpy(), near.cpu().numpy()
        kept_at = np.searchsorted(kept[:, 0], np.arange(m + 1))
        near_at = np.searchsorted(near[:, 0], np.arange(m + 1))
        return [
            Passed(
                int(counts[j]),
                np.ascontiguousarray(near[near_at[j] : near_at[j + 1], 1]),
                np.ascontiguousarray(kept[kept_at[j] : kept_at[j + 1], 1]),
            )
            for j in range(m)
        ]

    def _capacity(self) -> int:
        return 0 if not self._tensors else int(self._tensors["available"].shape[0])

    def _put(self, slots: npt.NDArray[np.int64], values: Columns) -> None:
        torch, t = self._torch, self._tensors
        idx = torch.from_numpy(slots).to(self.device)
        for name, a in values.items():
            if name == "cbits":  # the same bits as int64: torch has no uint64 bitwise and
                a = a.view(np.int64)
            t[name][idx] = torch.from_numpy(np.ascontiguousarray(a)).to(self.device)


def _signed(mask: int) -> int:
    """A 64-bit mask as the int64 with the same bits (torch has no uint64 bitwise and)."""
    return mask - (1 << 64) if mask >= 1 << 63 else mask
