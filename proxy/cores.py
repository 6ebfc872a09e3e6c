"""How many CPUs this server may use: what every ``auto`` count of it is sized by.

``os.cpu_count()`` counts the host's CPUs. In a container limited with ``docker run --cpus 4``
or a Kubernetes CPU limit (a cgroup CPU quota), or pinned with ``taskset`` or a cpuset, on a
64-core host it says 64: ``FLEETCACHE_WORKERS=auto`` would then start 16 HTTP workers, a
warm-up job 8 readers and the engine a writer child, for four cores' worth of time, and the
cached lookups' p99 would pay for it (on the 2-core box, more busy processes than cores took
paced lookups beside a warm-up to 2.5-4.8x their p99 alone, docs/BENCHMARKS.md).

``usable_cores``: the CPUs of this process's affinity mask, fewer when a CPU quota of its
cgroup or of one above it allows fewer (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``), rounded up. The Rust tokenizers' thread pool sizes itself the same way
(Rust's ``available_parallelism`` reads the affinity and the quota).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def lower(pid: int, steps: int) -> None:
    """Process or thread ``pid`` (Linux gives each thread a nice value of its own) ``steps``
    nice values below the calling thread, at most 19."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + steps))


def usable_cores(root: Path = Path("/")) -> int:
    """CPUs this process may use (see the module docstring); ``root``: where /proc and the
    cgroup mounts are read (tests)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpus(root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cgroup_cpus(root: Path = Path("/")) -> float | None:
    """The smallest CPU quota, in CPUs, of this process's cgroup and those above it; None
    without one ("max" or -1 all the way up, or nothing readable)."""
    try:
        memberships = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    quotas = [
        quota
        for mount, path, v2 in _cpu_cgroups(memberships, mounts)
        for quota in _quotas(root / mount.lstrip("/"), path, v2)
    ]
    return min(quotas) if quotas else None


def _cpu_cgroups(memberships: list[str], mounts: list[str]) -> Iterator[tuple[str, str, bool]]:
    """Each mounted hierarchy that holds the CPU controller (v2's unified one, v1's ``cpu``):
    its mount point, this process's cgroup path under it, and whether it is v2."""
    paths: dict[str, str] = {}  # "v2" | "cpu" -> the cgroup's path in that hierarchy
    for line in memberships:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            paths["v2"] = path
        elif "cpu" in controllers.split(","):
            paths["cpu"] = path
    for line in mounts:
        left, _, right = line.partition(" - ")
        fields, kinds = left.split(), right.split()
        if len(fields) < 5 or len(kinds) < 3:
            continue
        mount_root, mount_point = fields[3].rstrip("/"), fields[4]
        if kinds[0] == "cgroup2":
            which = "v2"
        elif kinds[0] == "cgroup" and "cpu" in kinds[2].split(","):
            which = "cpu"
        else:
            continue
        if which not in paths:
            continue
        # the path is from the hierarchy's root, the mount shows it from ``mount_root`` (a
        # container without a cgroup namespace gets its own cgroup mounted as the root)
        path = paths[which]
        if path == mount_root or path.startswith(mount_root + "/"):
            path = path[len(mount_root) :]
        yield mount_point, path, which == "v2"


def _quotas(mount: Path, path: str, v2: bool) -> Iterator[float]:
    """The quota of the cgroup at ``path`` under ``mount`` and of each one above it."""
    parts = [part for part in path.split("/") if part]
    for depth in range(len(parts), -1, -1):
        quota = _quota(mount.joinpath(*parts[:depth]), v2)
        if quota is not None:
            yield quota


def _quota(directory: Path, v2: bool) -> float | None:
    try:
        if v2:
            limit, period = (directory / "cpu.max").read_text().split()[:2]
        else:
            limit = (directory / "cpu.cfs_quota_us").read_text().strip()
            period = (directory / "cpu.cfs_period_us").read_text().strip()
        if limit in ("max", "-1") or float(period) <= 0:
            return None
        return float(limit) / float(period)
    except (OSError, ValueError):
        return None


# -- where each process of a server runs ------------------------------------------------------

ENGINE_CPUS = 2  # CPUs of an engine process's own ("auto" placement)
DEVICE_CPUS = 1  # of its device child's own
MIN_SHARED_CPUS = 8  # left to the workers, the index, the writers and the jobs, at least
MAX_CPU = 8192  # CPU numbers a placement may name are below this (Linux's own bound)


@dataclass(frozen=True)
class CpuPlan:
    """The CPUs each process of a server runs on (``FLEETCACHE_CPU_PLACEMENT``): engine
    process ``k`` on ``engines[k]``, its device child on ``devices[k]``, the workers, the
    index owner and the LMDB writers on ``shared``; the job starter and its warm-up jobs on
    every CPU of the server, below the others' priority (``proxy.jobs``): confined to
    ``shared``, a 200,000-driver job warmed 50,219 features/s where the server placed by the
    kernel warmed 59,678, and 55,435 on every CPU (H100 machine, 2026-12-06,
    docs/BENCHMARKS.md). Empty: wherever the kernel puts them."""

    shared: tuple[int, ...] = ()
    engines: tuple[tuple[int, ...], ...] = ()
    devices: tuple[tuple[int, ...], ...] = ()

    def engine(self, k: int) -> tuple[int, ...]:
        return self.engines[k] if k < len(self.engines) else ()

    def device(self, k: int) -> tuple[int, ...]:
        return self.devices[k] if k < len(self.devices) else ()

    def everything(self) -> tuple[int, ...]:
        """Every CPU of the plan (the server's): where warm-up jobs run, whoever started
        them (the job starter, or a worker on ``shared`` while the starter is down)."""
        return tuple(
            sorted(
                {
                    *self.shared,
                    *(c for e in self.engines for c in e),
                    *(c for d in self.devices for c in d),
                }
            )
        )

    @classmethod
    def of(cls, plan: CpuPlan | dict[str, Any]) -> CpuPlan:
        """A plan, or one read back from JSON (``asdict``'s lists)."""
        if isinstance(plan, CpuPlan):
            return plan
        return cls(
            tuple(plan["shared"]),
            tuple(map(tuple, plan["engines"])),
            tuple(map(tuple, plan["devices"])),
        )

    def describe(self) -> str:
        """One line for the log: which CPUs each kind of process has."""
        if not self.shared:
            return "CPU placement: none (the kernel's)"
        engines = "; ".join(
            f"engine {k} on {cpu_text(e)}" + (f", its device child on {cpu_text(d)}" if d else "")
            for k, (e, d) in enumerate(zip(self.engines, self.devices, strict=True))
        )
        return (
            f"CPU placement: {engines}; workers, index and writers on {cpu_text(self.shared)}; "
            "warm-up jobs on every CPU, below the others"
        )


NO_PLACEMENT = CpuPlan()


def cpu_list(text: str) -> tuple[int, ...]:
    """A taskset-style CPU list (``0-1,4``) as sorted CPU numbers; ``ValueError`` if it is
    not one."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            low = high = -1
        if not 0 <= low <= high < MAX_CPU:
            raise ValueError(f"{part.strip()!r} is not a CPU or a range of CPUs (0-{MAX_CPU - 1})")
        cpus.update(range(low, high + 1))
    return tuple(sorted(cpus))


def cpu_text(cpus: tuple[int, ...]) -> str:
    """``cpu_list``'s inverse: ``(0, 1, 2, 5)`` -> ``0-2,5``."""
    runs: list[list[int]] = []
    for cpu in cpus:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def check_placement(value: str) -> str:
    """``FLEETCACHE_CPU_PLACEMENT``: ``auto``, ``off``, or ``ENGINE/DEVICE`` (two CPU lists:
    the engine processes' and their device children's, every other process on the rest);
    ``ValueError`` saying why otherwise."""
    if value in ("auto", "off"):
        return value
    parts = value.split("/")
    if len(parts) != 2:
        raise ValueError(f"auto, off or ENGINE_CPUS/DEVICE_CPUS (0-1/2), got {value!r}")
    for part in parts:
        cpu_list(part)
    return value


def cpu_plan(
    placement: str,
    device_children: Sequence[bool],
    cpus: Iterable[int] | None = None,
    cores: int | None = None,
) -> CpuPlan:
    """Where each process of a server with one engine process per entry of
    ``device_children`` (whether it drives its device from a child) runs, out of ``cpus``
    (default: this process's affinity; ``cores``: how many it may use, by default
    ``usable_cores`` of this process, or all of ``cpus`` when given).

    ``auto`` (the supervisor asks for it only where every engine drives a GPU from its
    child, and no fallback engine computes on the engine process's own threads): each
    engine process gets ``ENGINE_CPUS`` CPUs of its own and its child ``DEVICE_CPUS``, the
    first of ``cpus`` in that order, when ``MIN_SHARED_CPUS`` or more are left for the rest
    and no CPU quota allows fewer CPUs than ``cpus`` holds (other containers may then share
    them: pinning to the first would put every replica's engine on the same ones); else
    none. Measured on the H100 machine (16 cores, the server on 12, docs/BENCHMARKS.md,
    2026-12-06): so pinned from outside, in turns on one server, 8 workers served more new
    texts than in the unpinned run before in each of 6 pairs (by 5-20%, median +9%); with
    the child on 2 CPUs, or the engine on 1, no better.
    ``ENGINE/DEVICE``: those lists (every engine process shares the first, every device
    child the second), the rest of ``cpus`` for the others; ``ValueError`` when they are not
    among ``cpus`` or leave nothing. ``off``: none."""
    if placement == "off" or not device_children:
        return NO_PLACEMENT
    try:
        every = tuple(sorted(os.sched_getaffinity(0) if cpus is None else cpus))
    except (AttributeError, OSError):  # not Linux: nowhere to place anything
        return NO_PLACEMENT
    count = len(device_children)
    if placement != "auto":
        engine_part, device_part = (cpu_list(part) for part in placement.split("/"))
        named = set(engine_part + device_part)
        shared = tuple(c for c in every if c not in named)
        if not named <= set(every) or not shared:
            raise ValueError(
                f"FLEETCACHE_CPU_PLACEMENT={placement}: the CPUs named must be among this "
                f"server's ({cpu_text(every)}) and leave some to the other processes"
            )
        devices = tuple(device_part if child else () for child in device_children)
        return CpuPlan(shared, (engine_part,) * count, devices)
    per_engine = ENGINE_CPUS + DEVICE_CPUS
    reserved = per_engine * count
    usable = cores or (usable_cores() if cpus is None else len(every))
    if not all(device_children) or usable < len(every) or usable - reserved < MIN_SHARED_CPUS:
        return NO_PLACEMENT
    engines = tuple(every[k * per_engine : k * per_engine + ENGINE_CPUS] for k in range(count))
    devices = tuple(
        every[k * per_engine + ENGINE_CPUS : (k + 1) * per_engine] for k in range(count)
    )
    return CpuPlan(every[reserved:], engines, devices)


def pin_threads(cpus: Sequence[int]) -> None:
    """Every thread of this process onto ``cpus`` (a thread started later inherits its
    starter's, a child process its parent's); nothing for an empty list, or where the
    kernel refuses."""
    if not cpus:
        return
    for _ in range(2):  # again: a thread started meanwhile by one not yet moved
        try:
            tasks = [int(task.name) for task in Path("/proc/self/task").iterdir()]
        except OSError:  # not Linux: this thread only
            tasks = [0]
        for task in tasks:
            with contextlib.suppress(OSError, AttributeError):  # gone meanwhile, or not Linux
                os.sched_setaffinity(task, cpus)
