"""GPU health through NVML (nvidia-ml-py): the usual hidden causes of latency spikes.

Thermal or power throttling, ECC errors, a PCIe link trained below its rated generation or
width, and memory pressure all slow the engine without failing it. ``GpuMonitor.read()``
returns one JSON-ready reading for ``/v1/stats`` (section ``"gpu"``) and ``/metrics``::

    {"available": true, "driver_version": "...", "devices": [{"index": 0, "name": "...",
      "temperature_c": 41, "memory_used_bytes": ..., "memory_total_bytes": ...,
      "utilization_gpu_pct": 0, "utilization_memory_pct": 0, "power_w": 75.3, ...,
      "ecc": {"corrected_volatile": 0, "uncorrected_volatile": 0, ...},
      "pcie": {"gen": 5, "max_gen": 5, "width": 16, "max_width": 16, "below_max": false},
      "throttle": {"mask": 1, "reasons": ["gpu_idle"], "slowdown": false}}]}

Without a GPU or without ``pynvml`` the reading is ``{"available": false, "reason": "..."}``
and nothing raises. ``pynvml`` is imported lazily, on the first reading. A field the device
does not support (ECC on consumer cards, for instance) reads ``null``.

``python -m proxy.gpu_health`` prints one reading as JSON.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

# nvmlClocksEventReason* / nvmlClocksThrottleReason* bits (stable across NVML versions)
THROTTLE_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# reasons that mean the GPU is being held back while it has work (idle is not one of them)
SLOWDOWN_MASK = 0x4 | 0x8 | 0x20 | 0x40 | 0x80

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1


def load_nvml() -> ModuleType:
    import pynvml  # nvidia-ml-py; optional, hence imported here

    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class GpuMonitor:
    """Reads NVML at most once per ``min_interval_s``; initialises NVML on first use."""

    def __init__(
        self, loader: Callable[[], ModuleType] = load_nvml, min_interval_s: float = 1.0
    ) -> None:
        self._loader = loader
        self._min_interval_s = min_interval_s
        self._nvml: ModuleType | None = None
        self._failure: str | None = None
        self._last: tuple[float, dict[str, Any]] | None = None
        self._lock = threading.Lock()  # /metrics scrapes and /v1/stats may read at once

    def read(self) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self._min_interval_s:
                return self._last[1]
            reading = self._read()
            self._last = (now, reading)
            return reading

    def _init(self) -> ModuleType | None:
        if self._nvml is None and self._failure is None:
            try:
                nvml = self._loader()
            except ImportError as exc:
                self._failure = f"nvidia-ml-py is not installed ({exc})"
                return None
            try:
                nvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
                self._failure = f"NVML unavailable: {type(exc).__name__}: {exc}"
                return None
            self._nvml = nvml
        return self._nvml

    def _read(self) -> dict[str, Any]:
        nvml = self._init()
        if nvml is None:
            return {"available": False, "reason": self._failure or "NVML unavailable"}
        try:
            count = nvml.nvmlDeviceGetCount()
            driver = _optional(nvml.nvmlSystemGetDriverVersion)
        except Exception as exc:
            return {"available": False, "reason": f"NVML failed: {type(exc).__name__}: {exc}"}
        if not count:
            return {"available": False, "reason": "NVML sees no GPU"}
        devices = [read_device(nvml, i) for i in range(count)]
        return {
            "available": True,
            "driver_version": None if driver is None else _text(driver),
            "devices": devices,
        }

    def close(self) -> None:
        with self._lock:
            if self._nvml is not None:
                _optional(self._nvml.nvmlShutdown)
                self._nvml = None


def _optional(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, or None when NVML says the device cannot answer (Not Supported...)."""
    try:
        return fn(*args)
    except Exception:
        return None


def read_device(nvml: ModuleType, index: int) -> dict[str, Any]:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    memory = _optional(nvml.nvmlDeviceGetMemoryInfo, handle)
    util = _optional(nvml.nvmlDeviceGetUtilizationRates, handle)
    power_mw = _optional(nvml.nvmlDeviceGetPowerUsage, handle)
    limit_mw = _optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
    name = _optional(nvml.nvmlDeviceGetName, handle)
    uuid = _optional(nvml.nvmlDeviceGetUUID, handle)
    return {
        "index": index,
        "name": None if name is None else _text(name),
        "uuid": None if uuid is None else _text(uuid),
        "temperature_c": _optional(nvml.nvmlDeviceGetTemperature, handle, NVML_TEMPERATURE_GPU),
        "memory_used_bytes": None if memory is None else int(memory.used),
        "memory_total_bytes": None if memory is None else int(memory.total),
        "utilization_gpu_pct": None if util is None else int(util.gpu),
        "utilization_memory_pct": None if util is None else int(util.memory),
        "power_w": None if power_mw is None else power_mw / 1000.0,
        "power_limit_w": None if limit_mw is None else limit_mw / 1000.0,
        "sm_clock_mhz": _optional(nvml.nvmlDeviceGetClockInfo, handle, NVML_CLOCK_SM),
        "max_sm_clock_mhz": _optional(nvml.nvmlDeviceGetMaxClockInfo, handle, NVML_CLOCK_SM),
        "ecc": read_ecc(nvml, handle),
        "pcie": read_pcie(nvml, handle),
        "throttle": read_throttle(nvml, handle),
    }


def read_ecc(nvml: ModuleType, handle: Any) -> dict[str, int | None]:
    counts = {}
    for kind, error_type in (
        ("corrected", NVML_MEMORY_ERROR_TYPE_CORRECTED),
        ("uncorrected", NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
    ):
        for counter, counter_type in (
            ("volatile", NVML_VOLATILE_ECC),
            ("aggregate", NVML_AGGREGATE_ECC),
        ):
            value = _optional(nvml.nvmlDeviceGetTotalEccErrors, handle, error_type, counter_type)
            counts[f"{kind}_{counter}"] = None if value is None else int(value)
    return counts


def read_pcie(nvml: ModuleType, handle: Any) -> dict[str, Any]:
    link = {
        "gen": _optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
        "max_gen": _optional(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
        "width": _optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        "max_width": _optional(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
    }
    # An idle GPU may train its link down to save power: read this under load.
    below = [
        cur < top
        for cur, top in ((link["gen"], link["max_gen"]), (link["width"], link["max_width"]))
        if cur is not None and top is not None
    ]
    link["below_max"] = any(below) if below else None
    return link


def read_throttle(nvml: ModuleType, handle: Any) -> dict[str, Any]:
    getter = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
        nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
    )
    mask = None if getter is None else _optional(getter, handle)
    if mask is None:
        return {"mask": None, "reasons": [], "slowdown": None}
    mask = int(mask)
    reasons = [name for bit, name in THROTTLE_REASONS.items() if mask & bit]
    return {"mask": mask, "reasons": reasons, "slowdown": bool(mask & SLOWDOWN_MASK)}


@functools.lru_cache(maxsize=1)
def default_monitor() -> GpuMonitor:
    """The process's monitor: NVML is initialised once per process, not per app."""
    return GpuMonitor()


def main() -> None:
    print(json.dumps(GpuMonitor(min_interval_s=0.0).read(), indent=2))


if __name__ == "__main__":
    main()
