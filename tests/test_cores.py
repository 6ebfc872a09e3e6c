"""The cores a server may use, and the ``auto`` counts sized by them (proxy.cores).

A container limited to 4 CPUs on a 64-core host must start processes for 4 cores, not 64:
the cgroup files are laid out here as Linux shows them, under a temporary root."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy import cores, engine_host, jobs, supervisor
from proxy.cores import cgroup_cpus, usable_cores
from proxy.settings import Settings

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"


def machine(root: Path, cgroup: str, mounts: list[str], files: dict[str, str]) -> Path:
    """``/proc/self/cgroup``, ``/proc/self/mountinfo`` and cgroup files under ``root``."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text("\n".join(mounts) + "\n")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def test_a_container_with_a_cgroup_v2_quota_has_that_many_cpus(tmp_path: Path) -> None:
    """``docker run --cpus 4`` with a cgroup namespace: its cgroup is the mount's root."""
    root = machine(tmp_path, "0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "400000 100000\n"})
    assert cgroup_cpus(root) == 4.0


def test_a_quota_above_the_process_cgroup_counts(tmp_path: Path) -> None:
    """A Kubernetes pod's limit sits on the pod's cgroup, not the container's: the smallest
    quota on the way up is the one that holds."""
    pod = "sys/fs/cgroup/kubepods/pod1"
    root = machine(
        tmp_path,
        "0::/kubepods/pod1/ctr\n",
        [V2_MOUNT],
        {
            "sys/fs/cgroup/kubepods/cpu.max": "max 100000\n",
            f"{pod}/cpu.max": "250000 100000\n",
            f"{pod}/ctr/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_cpus(root) == 2.5


def test_a_cgroup_v1_quota_is_read_where_its_hierarchy_is_mounted(tmp_path: Path) -> None:
    """Docker on cgroup v1: the container's own cgroup (/docker/abc) mounted as the root of
    the cpu,cpuacct hierarchy."""
    mount = "40 31 0:30 /docker/abc /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct"
    root = machine(
        tmp_path,
        "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n",
        [mount],
        {
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "150000\n",
            "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cgroup_cpus(root) == 1.5


def test_no_quota_anywhere_is_none(tmp_path: Path) -> None:
    """A hybrid host (v1 cpu unlimited, v2 mounted without the cpu controller), and a
    machine whose /proc says nothing."""
    v1 = "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu"
    unified = "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw"
    root = machine(
        tmp_path / "hybrid",
        "1:cpu:/\n0::/\n",
        [v1, unified],
        {
            "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
            "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
            "sys/fs/cgroup/unified/cgroup.procs": "1\n",
        },
    )
    assert cgroup_cpus(root) is None
    assert cgroup_cpus(tmp_path / "empty") is None


def test_usable_cores_is_the_affinity_mask_capped_by_the_quota_rounded_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limited = machine(
        tmp_path / "limited", "0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "250000 100000"}
    )
    unlimited = machine(
        tmp_path / "unlimited", "0::/\n", [V2_MOUNT], {"sys/fs/cgroup/cpu.max": "max 100000"}
    )
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert usable_cores(limited) == 3  # 2.5 CPUs of time: three processes can use it
    assert usable_cores(unlimited) == 64
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_cores(limited) == 2  # taskset -c 0,1 under a 2.5-CPU quota


def test_every_auto_count_follows_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a 64-core host in a 3-CPU container: 2 workers (not 16), 1 warm-up reader (not 8),
    the writes in a thread (the child is for 4 cores or more)."""
    for module in (supervisor, jobs, engine_host):
        monkeypatch.setattr(module, "usable_cores", lambda: 3)
    assert supervisor.auto_workers() == 2
    assert jobs.shard_count(Settings(warmup_processes="auto")) == 1
    assert engine_host.lmdb_writer(Settings(lmdb_writer="auto")) == "thread"
    for module in (supervisor, jobs, engine_host):
        monkeypatch.setattr(module, "usable_cores", lambda: 16)
    assert supervisor.auto_workers() == 12
    assert jobs.shard_count(Settings(warmup_processes="auto")) == 8
    assert engine_host.lmdb_writer(Settings(lmdb_writer="auto")) == "process"


@pytest.mark.parametrize("name", ["FLEETCACHE_WORKERS", "FLEETCACHE_WARMUP_PROCESSES"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_process_count_below_one_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str
) -> None:
    """``FLEETCACHE_WARMUP_PROCESSES=0`` started a server whose every warm-up job then failed
    (no reader); the settings refuse it, naming the setting, as they do the other counts."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name.removeprefix("FLEETCACHE_").lower()):
        Settings()
    monkeypatch.setenv(name, "2")
    assert getattr(Settings(), name.removeprefix("FLEETCACHE_").lower()) == 2
