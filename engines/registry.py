"""Engines by name: a registry of lazy factories.

Each factory imports its engine module only when called and first checks that the optional
packages it needs are installed, so a missing extra is an ``EngineUnavailableError`` naming
what to install, never an ImportError deep inside a load. Nothing here installs anything.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

from engines.base import Engine, EngineUnavailableError
from engines.devices import unusable

EngineFactory = Callable[..., Engine]


def _require(kind: str, modules: tuple[str, ...], install: str) -> None:
    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        raise EngineUnavailableError(
            f"engine {kind!r} needs the python package(s) {', '.join(missing)}: {install}"
        )


def _fake(**options: Any) -> Engine:
    from engines.fake import FakeEngine

    return FakeEngine(**options)


def _torch(**options: Any) -> Engine:
    _require(
        "torch",
        ("torch", "sentence_transformers"),
        "pip install torch sentence-transformers (on CPU: pip install torch==2.13.0 first)",
    )
    from engines.torch_engine import TorchEngine

    if options.get("device", "auto") == "auto":
        import torch

        options["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return TorchEngine(**options)


def _onnxruntime(**options: Any) -> Engine:
    _require("onnxruntime", ("onnxruntime", "tokenizers"), "pip install 'fleetcache[onnx]'")
    from engines.onnxruntime_engine import OnnxRuntimeEngine

    why = unusable("onnxruntime", str(options.pop("device", "auto")))
    if why is not None:
        raise EngineUnavailableError(why)
    return OnnxRuntimeEngine(**options)


def cuda_ordinal(device: str | int) -> int:
    """The number of the CUDA device ``device`` names (``FLEETCACHE_DEVICE``'s form): ``auto``
    and ``cuda`` are 0, ``cuda:N`` is N; ``EngineUnavailableError`` for a CPU."""
    if isinstance(device, int):
        return device
    why = unusable("tensorrt", device)
    number = device.partition(":")[2]
    if why is None and (number.isdigit() or not number):
        return int(number or 0)
    raise EngineUnavailableError(why or f"engine 'tensorrt': no CUDA device {device!r}")


def _tensorrt(**options: Any) -> Engine:
    # Either TensorRT module will do; load() says if it cannot run on this GPU (or none).
    options["device"] = cuda_ordinal(options.get("device", 0))
    if all(importlib.util.find_spec(name) is None for name in ("tensorrt", "tensorrt_rtx")):
        raise EngineUnavailableError(
            "engine 'tensorrt' needs TensorRT: pip install 'fleetcache[tensorrt-rtx]' "
            "(RTX-class GPUs) or NVIDIA's tensorrt (data-center GPUs), plus cuda-python"
        )
    _require("tensorrt", ("cuda.bindings",), "pip install cuda-python")
    from engines.tensorrt_engine import TensorRTEngine

    return TensorRTEngine(**options)


_FACTORIES: dict[str, EngineFactory] = {
    "fake": _fake,
    "onnxruntime": _onnxruntime,
    "tensorrt": _tensorrt,
    "torch": _torch,
}


def engine_kinds() -> tuple[str, ...]:
    """The names ``create_engine`` accepts."""
    return tuple(sorted(_FACTORIES))


def create_engine(kind: str, **options: Any) -> Engine:
    """A new, not yet loaded engine of ``kind``; ``options`` go to its constructor.

    Raises ``ValueError`` for an unknown kind and ``EngineUnavailableError`` when the kind
    cannot run here (missing package, not implemented yet).
    """
    try:
        factory = _FACTORIES[kind]
    except KeyError:
        raise ValueError(
            f"unknown engine kind {kind!r}; known kinds: {', '.join(engine_kinds())}"
        ) from None
    return factory(**options)
