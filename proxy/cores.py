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
from collections.abc import Iterator
from pathlib import Path


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
