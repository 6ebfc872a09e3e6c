"""faiss-gpu support: a GPU replica of the store's flat index for whole-index searches.

Used when the installed faiss has GPU support (the ``faiss-gpu`` wheels; ``faiss-cpu`` has
none) and sees a GPU. The CPU index stays the one copy the store edits; the replica is built
with ``faiss.index_cpu_to_gpu`` on first use and again after vectors change.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

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
