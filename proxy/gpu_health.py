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
does not support (ECC on consumer cards, for instance) reads ``null``; a device NVML cannot
reach any more (GPU lost, fallen off the bus) reads ``null`` everywhere, with its ``error``.

The readings act (API.md v1.1, "GPU health acts"): ``GpuCheck`` is the engine's ``watch``
(``engines.fallback``). ``judge`` turns a reading of the engine's GPU into a ``Condition``:

    fault (trips the engine)   the device lost (NVML cannot reach it, or it is gone from the
                               count), uncorrected ECC errors growing since the last reading
    slow (degraded)            temperature >= max_temp_c; hardware, thermal or power-brake
                               slowdown; the PCIe link below its maximum while the GPU is busy
                               (an idle GPU trains its link down); never a software power cap,
                               which is normal at peak

``python -m proxy.gpu_health`` prints one reading as JSON; ``--judge`` adds each device's
condition (the engine's trip logic, against a real reading).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

from engines.fallback import Condition

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
# ...of which these degrade the engine: a software power cap (0x4) is normal at peak
HARDWARE_SLOWDOWN_MASK = 0x8 | 0x20 | 0x40 | 0x80
# "busy" for the PCIe check: NVML's utilisation (percent of the last sample period with a
# kernel running); an idle GPU trains its link down to save power, and that is no fault
BUSY_PCT = 10

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1


def load_nvml() -> ModuleType:
    import pynvml  # nvidia-ml-py; optional, hence imported here

    return pynvml


def visible_gpus() -> int:
    """How many CUDA GPUs this process's children would see: ``CUDA_VISIBLE_DEVICES`` when
    set, else NVML's count (0 without NVML). Read without importing torch (the supervisor
    and an engine process that leaves CUDA to its device child stay free of it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e for e in visible.split(",") if e.strip()]
        return 0 if not entries or entries[0].strip() == "-1" else len(entries)
    try:
        nvml = load_nvml()
        nvml.nvmlInit()
        try:
            return int(nvml.nvmlDeviceGetCount())
        finally:
            nvml.nvmlShutdown()
    except Exception:  # no pynvml, no driver: no GPU
        return 0


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
        devices = [read_device_or_error(nvml, i) for i in range(count)]
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


def read_device_or_error(nvml: ModuleType, index: int) -> dict[str, Any]:
    """``read_device``, or the same keys all null with the ``error`` (NVMLError_GpuIsLost...)."""
    try:
        return read_device(nvml, index)
    except Exception as exc:
        return lost_device(index, f"{type(exc).__name__}: {exc}")


def lost_device(index: int, error: str) -> dict[str, Any]:
    keys = ("name", "uuid", "temperature_c", "memory_used_bytes", "memory_total_bytes")
    more = ("utilization_gpu_pct", "utilization_memory_pct", "power_w", "power_limit_w")
    clocks = ("sm_clock_mhz", "max_sm_clock_mhz")
    return {
        "index": index,
        **dict.fromkeys(keys + more + clocks),
        "ecc": {
            f"{k}_{c}": None
            for k in ("corrected", "uncorrected")
            for c in ("volatile", "aggregate")
        },
        "pcie": {"gen": None, "max_gen": None, "width": None, "max_width": None, "below_max": None},
        "throttle": {"mask": None, "reasons": [], "slowdown": None},
        "error": error,
    }


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
        "error": None,
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


# -- acting on readings ----------------------------------------------------------------------


def _uncorrected(device: Mapping[str, Any]) -> int | None:
    ecc = device["ecc"]
    value = ecc["uncorrected_volatile"]
    return ecc["uncorrected_aggregate"] if value is None else value


def judge(
    reading: Mapping[str, Any],
    index: int,
    *,
    max_temp_c: float,
    seen: bool = False,
    last_uncorrected: int | None = None,
) -> Condition:
    """The condition of GPU ``index`` in ``reading``. ``seen``: the device answered before
    (so its absence now is a loss, not a machine without NVML); ``last_uncorrected``: its
    uncorrected ECC count in the previous reading."""
    if not reading["available"]:
        return Condition(fault=f"GPU {index} lost: {reading['reason']}") if seen else Condition()
    device = next((d for d in reading["devices"] if d["index"] == index), None)
    if device is None:
        return Condition(fault=f"GPU {index} lost: NVML sees {len(reading['devices'])} GPUs")
    if device.get("error"):
        return Condition(fault=f"GPU {index} lost: {device['error']}")
    fault = None
    uncorrected = _uncorrected(device)
    if uncorrected is not None and last_uncorrected is not None and uncorrected > last_uncorrected:
        fault = f"GPU {index} uncorrected ECC errors grew from {last_uncorrected} to {uncorrected}"
    slow = []
    temperature = device["temperature_c"]
    if temperature is not None and temperature >= max_temp_c:
        slow.append(f"GPU {index} temperature {temperature} C >= {max_temp_c:g} C")
    mask = device["throttle"]["mask"]
    if mask is not None and mask & HARDWARE_SLOWDOWN_MASK:
        held = [
            name for bit, name in THROTTLE_REASONS.items() if mask & bit & HARDWARE_SLOWDOWN_MASK
        ]
        slow.append(f"GPU {index} clocks held back: {', '.join(held)}")
    pcie, busy = device["pcie"], device["utilization_gpu_pct"]
    if pcie["below_max"] and busy is not None and busy >= BUSY_PCT:
        slow.append(
            f"GPU {index} PCIe link gen {pcie['gen']} x{pcie['width']} below gen "
            f"{pcie['max_gen']} x{pcie['max_width']} while {busy}% busy"
        )
    return Condition(fault=fault, slow="; ".join(slow) or None)


def gpu_index(device: str, visible: str | None = None) -> int | None:
    """The NVML index of the engine's device (``cuda``, ``cuda:N``, ``cuda:N (name)``), or None
    for a device that is no GPU. ``visible``: CUDA_VISIBLE_DEVICES, when it lists indices
    (CUDA numbers the visible devices from 0). Assumes CUDA_DEVICE_ORDER=PCI_BUS_ID or one GPU
    per engine process (NVML numbers by PCI bus)."""
    found = re.match(r"cuda(?::(\d+))?\b", device)
    if found is None:
        return None
    cuda = int(found.group(1) or 0)
    listed = [part.strip() for part in (visible or "").split(",") if part.strip()]
    if listed and all(part.isdigit() for part in listed) and cuda < len(listed):
        return int(listed[cuda])
    return cuda


class GpuCheck:
    """The engine's ``watch``: reads NVML and judges the engine's GPU (``judge``). None (the
    watch stops) when the engine runs on no GPU; the device is asked for on the first call,
    after the engine loaded (``auto`` resolves then)."""

    def __init__(
        self,
        device: Callable[[], str],
        *,
        max_temp_c: float,
        monitor: GpuMonitor | None = None,
        visible: str | None = None,
    ) -> None:
        self._device = device
        self.max_temp_c = max_temp_c
        self._monitor = monitor or GpuMonitor(min_interval_s=0.0)
        self._visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
        self._seen = False
        self._uncorrected: int | None = None

    def __call__(self) -> Condition | None:
        index = gpu_index(self._device(), self._visible)
        if index is None:
            return None
        reading = self._monitor.read()
        condition = judge(
            reading,
            index,
            max_temp_c=self.max_temp_c,
            seen=self._seen,
            last_uncorrected=self._uncorrected,
        )
        for device in reading.get("devices", ()):
            if device["index"] == index and not device.get("error"):
                self._seen = True
                count = _uncorrected(device)
                if count is not None:  # the highest seen: a growth trips once per growth
                    self._uncorrected = max(count, self._uncorrected or 0)
        return condition


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m proxy.gpu_health")
    parser.add_argument("--judge", action="store_true", help="add each GPU's condition")
    parser.add_argument("--max-temp-c", type=float, default=83.0)
    args = parser.parse_args(argv)
    reading = GpuMonitor(min_interval_s=0.0).read()
    if args.judge:
        conditions = {}
        for device in reading.get("devices", ()):
            condition = judge(reading, device["index"], max_temp_c=args.max_temp_c, seen=True)
            conditions[str(device["index"])] = {"fault": condition.fault, "slow": condition.slow}
        reading = {**reading, "conditions": conditions}
    print(json.dumps(reading, indent=2))


if __name__ == "__main__":
    main()
