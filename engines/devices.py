"""Where each engine kind runs, in ``FLEETCACHE_DEVICE``'s names (``auto``, ``cpu``, ``cpu:N``,
``cuda``, ``cuda:N``): the one table that the settings check a server's devices against and
the registry each engine's. No imports, so that the settings read it without the engines."""

from __future__ import annotations

# the fake engine names CPUs only, never claiming a GPU
RUNS_ON: dict[str, tuple[str, ...]] = {
    "fake": ("cpu",),
    "onnxruntime": ("cpu",),
    "tensorrt": ("cuda",),
    "torch": ("cpu", "cuda"),
}
_PLACES = {"cpu": "the CPU", "cuda": "a CUDA GPU"}


def runs_on_cuda(kind: str) -> bool:
    """Whether engine ``kind`` runs on a CUDA GPU where one is visible (``FLEETCACHE_DEVICE=
    auto``: one engine process per GPU, each in a device child by default)."""
    return "cuda" in RUNS_ON[kind]


def unusable(kind: str, device: str) -> str | None:
    """Why engine ``kind`` cannot run on ``device`` (a device of another kind), or None
    (``auto`` lets the engine pick)."""
    place = device.partition(":")[0]
    if device == "auto" or place in RUNS_ON[kind]:
        return None
    where = " or ".join(_PLACES[p] for p in RUNS_ON[kind])
    there = [repr(k) for k, places in RUNS_ON.items() if place in places and k != "fake"]
    return f"engine {kind!r} runs on {where}, not on {device!r} (use {' or '.join(there)})"
